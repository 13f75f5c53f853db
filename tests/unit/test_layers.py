"""The package's floors: every import points down (or stays inside its own package), and
no module imports duoka code inside a function, except where start-up time is the reason."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "duoka"

# Lowest first. A module may import its own package and anything on a lower floor.
FLOORS = [
    ("duoka", "duoka.errors"),
    ("duoka.config", "duoka.timing", "duoka.runtime", "duoka.hub", "duoka.cache", "duoka.state_files"),
    ("duoka.host",),
    ("duoka.models",),
    ("duoka.data",),
    ("duoka.parallel",),
    ("duoka.monitor",),
    ("duoka.plan",),
    ("duoka.train", "duoka.serve"),
    ("duoka.launch", "duoka.doctor", "duoka.bench"),
    ("duoka.cli",),
]
# Function-level imports of duoka code, each for start-up time: `duoka --help` and the quick
# commands load no torch, and the training launch imports torch only once its worker server
# (which imports torch too) has started, so the two imports overlap.
LAZY_ALLOWED = {"duoka.cli", "duoka.launch.training"}


def _group(module: str) -> str:
    """The unit a floor is made of: duoka.train.trainer -> duoka.train; duoka.errors stays."""
    for floor in FLOORS:
        for name in sorted(floor, key=len, reverse=True):
            if module == name or module.startswith(name + "."):
                if name == "duoka" and module != "duoka":
                    continue
                return name
    raise AssertionError(f"{module} is on no floor: add it to FLOORS in {__file__}")


def _floor(group: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if group in floor)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts).removesuffix(".__init__"), ast.parse(path.read_text())


def _imports(tree: ast.Module):
    """(imported duoka module, line, at module level?) for every import in the tree."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "duoka":
            names = [node.module] if node.module != "duoka" else [f"duoka.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "duoka"]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in top


MODULES = list(_modules())


@pytest.mark.parametrize("module, tree", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(module, tree):
    mine = _group(module)
    for name, line, _ in _imports(tree):
        if name == "duoka.__version__":  # `from duoka import __version__`: the package itself
            continue
        theirs = _group(name)
        if theirs == mine:
            continue
        assert _floor(theirs) < _floor(mine), (
            f"{module}:{line} imports {name}, which is not below it ({mine} is on floor {_floor(mine)}, "
            f"{theirs} on {_floor(theirs)}): move the shared piece down to where both can import it")


@pytest.mark.parametrize("module, tree", MODULES, ids=[m for m, _ in MODULES])
def test_no_function_level_imports(module, tree):
    if module in LAZY_ALLOWED:
        return
    inner = [f"{name} (line {line})" for name, line, top in _imports(tree) if not top]
    assert not inner, f"{module} imports duoka code inside a function: {inner}; import it at the top"


def test_the_floors_test_can_fail():
    assert _floor(_group("duoka.train.trainer")) > _floor(_group("duoka.models.qwen2.model"))
    with pytest.raises(AssertionError):
        test_imports_point_down("duoka.models.qwen2.model", ast.parse("from duoka.train import trainer\n"))
    with pytest.raises(AssertionError):
        test_no_function_level_imports("duoka.train.trainer", ast.parse("def f():\n    import duoka.errors\n"))
