import pytest

from duoka.config import Config, load_config, reference_markdown, to_toml
from duoka.errors import DuokaError


def write(tmp_path, text):
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return p


def test_precedence_defaults_file_then_overrides(tmp_path):
    path = write(tmp_path, '[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 1e-4\n')
    cfg = load_config(path, ["--training.steps=7", "--optimizer.lr", "2e-4", "--training.steps=9"])
    assert cfg.training.steps == 9  # the last flag wins
    assert cfg.training.seq_len == 64  # from the file
    assert cfg.optimizer.lr == 2e-4
    assert cfg.training.global_batch_size == Config().training.global_batch_size  # default


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["--training.micro_batch_size=4", "--parallel.dp_mode=fsdp", "--job.output_dir=a \"b\""])
    again = load_config(write(tmp_path, to_toml(cfg)))
    assert again == cfg


@pytest.mark.parametrize("text", ["two\nlines", "cr\rlf", 'quote " and back\\slash', "tab\tbell\x07del\x7f nul\x00",
                                  "form\x0cfeed\x08", "unicode é 中文 \u2028", "\\n as written", ""])
def test_strings_with_newlines_and_control_characters_round_trip(tmp_path, text):
    """config.toml is valid TOML whatever a string holds, and reads back equal."""
    import tomllib

    cfg = load_config(None, [f"--job.output_dir=runs/{text}", f"--data.path={text}"])
    written = to_toml(cfg)
    assert tomllib.loads(written)["data"]["path"] == text
    assert load_config(write(tmp_path, written)) == cfg


@pytest.mark.parametrize("args, cause, fix", [
    (["--training.step=5"], "unknown config key 'training.step'", "did you mean training.steps?"),
    (["--training.lr=0.1"], "unknown config key 'training.lr'", "did you mean optimizer.lr?"),
    (["--trainig.steps=5"], "unknown config key 'trainig.steps'", "did you mean training.steps?"),
    (["--training.steps=0"], "training.steps=0 is out of range", "must be >= 1"),
    (["--training.steps=ten"], "training.steps='ten' is not an integer", "whole number"),
    (["--training.micro_batch_size=big"], "is not an integer", "or auto"),
    (["--optimizer.min_lr_ratio=2"], "out of range", "between 0.0 and 1.0"),
    (["--optimizer.lr=1e38"], "optimizer.lr=1e+38 is out of range", "between 0.0 and 1000000.0"),
    (["--parallel.dp_mode=zero3"], "parallel.dp_mode='zero3' is not allowed", "ddp, fsdp"),
    (["--training.compile=maybe"], "not a boolean", "use true, false or auto"),
    (["--checkpoint.enabled=maybe"], "not a boolean", "use true or false"),
    (["--training.steps"], "--training.steps has no value", "--training.steps=VALUE"),
])
def test_bad_overrides(args, cause, fix):
    with pytest.raises(DuokaError) as e:
        load_config(None, args)
    assert cause in e.value.cause and fix in e.value.fix


def test_bad_file(tmp_path):
    with pytest.raises(DuokaError, match="unknown config key 'optimiser.lr'") as e:
        load_config(write(tmp_path, "[optimiser]\nlr = 1.0\n"))
    assert "optimizer.lr" in e.value.fix
    with pytest.raises(DuokaError, match="not valid TOML"):
        load_config(write(tmp_path, "[training\nsteps = 1"))
    with pytest.raises(DuokaError, match="model.flavor = 7 is an integer, not a string"):
        load_config(write(tmp_path, "[model]\nflavor = 7\n"))
    with pytest.raises(DuokaError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("toml, cause, fix", [
    ('[training]\nsteps = "5"', 'training.steps = "5" is a string, not an integer',
     "write steps = 5 under [training] (without quotes"),
    ("[training]\nsteps = 5.0", "training.steps = 5.0 is a float, not an integer", "write steps = 5 under"),
    ("[training]\nsteps = true", "training.steps = true is a boolean, not an integer", "write steps = 5 under"),
    ('[training]\ncompile = "false"', 'training.compile = "false" is a string, not a boolean or "auto"',
     "compile = false"),
    ('[checkpoint]\nenabled = "false"', 'checkpoint.enabled = "false" is a string, not a boolean', "enabled = false"),
    ('[training]\nmicro_batch_size = "4"', 'is a string, not an integer or "auto"', "micro_batch_size = 4"),
    ('[optimizer]\nlr = "3e-4"', 'optimizer.lr = "3e-4" is a string, not a number', "lr = 0.0003"),
    ("[optimizer]\nlr = nan", "optimizer.lr=nan is not a finite number", "3e-4"),
])
def test_toml_values_carry_their_type(tmp_path, toml, cause, fix):
    """A TOML value of the wrong type is refused, naming key, file and the type expected;
    the same text as a flag converts (flags have no type)."""
    path = write(tmp_path, toml + "\n")
    with pytest.raises(DuokaError) as e:
        load_config(path)
    assert cause in e.value.cause and str(path) in e.value.cause and fix in e.value.fix


def test_flags_convert_and_typed_toml_loads(tmp_path):
    cfg = load_config(write(tmp_path, '[training]\nsteps = 5\nmicro_batch_size = "auto"\n[optimizer]\nlr = 1\n'),
                      ["--training.seq_len=64", "--training.compile=true", "--optimizer.eps=1e-6"])
    assert (cfg.training.steps, cfg.training.micro_batch_size, cfg.optimizer.lr) == (5, "auto", 1.0)
    assert (cfg.training.seq_len, cfg.training.compile, cfg.optimizer.eps) == (64, True, 1e-6)
    for flag in ("--optimizer.lr=nan", "--optimizer.lr=inf"):
        with pytest.raises(DuokaError, match="is not a finite number"):
            load_config(None, [flag])


def test_auto_or_int():
    assert load_config(None, ["--training.micro_batch_size=auto"]).training.micro_batch_size == "auto"
    assert load_config(None, ["--training.micro_batch_size=8"]).training.micro_batch_size == 8


def test_auto_or_bool(tmp_path):
    """training.compile: auto (the default), or a boolean, from flags and from TOML."""
    assert Config().training.compile == "auto"
    assert [load_config(None, [f"--training.compile={v}"]).training.compile for v in ("auto", "true", "false")] == \
        ["auto", True, False]
    assert load_config(write(tmp_path, '[training]\ncompile = "auto"\n')).training.compile == "auto"
    assert load_config(write(tmp_path, "[training]\ncompile = false\n")).training.compile is False


def test_docs_are_generated_from_the_code():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert docs.read_text() == reference_markdown(), "run: python -m duoka.config > docs/config.md"
