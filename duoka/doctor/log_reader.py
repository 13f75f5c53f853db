"""The log as the failure detectors read it, and what they return: a `Log` (the text without
colour codes, its lines, where each match sits and which rank printed it, a short quote as
evidence), `rx` (a pattern with the words that must be in a log for it to match) and a
`Diagnosis` (a failure's kind, cause, fix and evidence).

The detectors: duoka.doctor.start_failures and duoka.doctor.rank_failures; their order and
`explain`: duoka.doctor.diagnose.
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass

EVIDENCE_CHARS = 300  # the evidence is a quote, not the log


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # a stable name: "cuda_oom", "nccl_timeout", ...
    cause: str  # what happened, with the numbers the log gives
    fix: str  # what to do
    evidence: str  # the matching log line(s), trimmed to about EVIDENCE_CHARS


# Colour codes (rich, tqdm) would split the words the patterns look for.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# torchrun's per-rank prefix "[rank1]:" (torch >= 2.2), the older --tee prefix "[default1]:",
# the process-group tag "[PG ID 0 PG GUID 0(default_pg) Rank 1]" / "[Rank 1]", and duoka's
# "... on rank 1".
_RANK_PREFIX = re.compile(r"^[ \t]*\[(?:rank|default)(\d+)\]:", re.MULTILINE)
_RANK_TAG = re.compile(r"\bRank (\d+)\]")
_RANK_WORDS = re.compile(r"\bon rank (\d+)\b")


_NEEDLES: dict[re.Pattern, tuple[str, ...]] = {}


def rx(pattern: str, *needles: str, flags: int = 0) -> re.Pattern:
    """A compiled pattern with its needles: lower-case words of which every match contains
    one. A log without any of them skips the pattern, which keeps a pattern that does not
    start with a literal (an alternation, \\S+, IGNORECASE) from crawling through a large log."""
    compiled = re.compile(pattern, flags)
    _NEEDLES[compiled] = needles
    return compiled


class Log:
    """The text with its lines, and where each match sits."""

    def __init__(self, text: str):
        text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
        self.text = text
        self.lines = text.split("\n")
        self.starts = []
        pos = 0
        for line in self.lines:
            self.starts.append(pos)
            pos += len(line) + 1

    @functools.cached_property
    def lower(self) -> str:
        return self.text.lower()

    def find(self, *patterns: re.Pattern) -> list[re.Match]:
        """Every match of the patterns, in the order they appear in the log."""
        out = [m for p in patterns if self._may_match(p) for m in p.finditer(self.text)]
        return sorted(out, key=lambda m: m.start())

    def _may_match(self, pattern: re.Pattern) -> bool:
        needles = _NEEDLES.get(pattern)
        return not needles or any(n in self.lower for n in needles)

    def line_no(self, m: re.Match | int) -> int:
        pos = m if isinstance(m, int) else m.start()
        return bisect.bisect_right(self.starts, pos) - 1

    def line(self, m: re.Match | int) -> str:
        return self.lines[self.line_no(m)]

    def around(self, m: re.Match, before: int, after: int) -> str:
        i = self.line_no(m)
        return "\n".join(self.lines[max(0, i - before):i + after + 1])

    def rank(self, m: re.Match) -> int | None:
        line = self.line(m)
        for p in (_RANK_PREFIX, _RANK_TAG, _RANK_WORDS):
            r = p.search(line)
            if r:
                return int(r.group(1))
        return None

    def ranks(self, matches: list[re.Match]) -> list[int]:
        return sorted({r for r in (self.rank(m) for m in matches) if r is not None})

    def all_ranks(self) -> set[int]:
        return {int(m.group(1)) for m in _RANK_PREFIX.finditer(self.text)}

    def evidence(self, matches: list[re.Match], most: int = 3) -> str:
        seen: list[int] = []
        for m in matches:
            i = self.line_no(m)
            if i not in seen:
                seen.append(i)
            if len(seen) == most:
                break
        text = "\n".join(" ".join(self.lines[i].split()) for i in seen)
        return text if len(text) <= EVIDENCE_CHARS else text[:EVIDENCE_CHARS - 3].rstrip() + "..."


def ranks_text(ranks: list[int]) -> str:
    """`rank 3`, `ranks 0, 1 and 5`, or the first six of many and their count."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return "ranks " + ", ".join(map(str, ranks[:6])) + f", ... ({len(ranks)} in all)"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


SIZE_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(size: str) -> float:
    """A size as PyTorch's messages write it (`2.00 GiB`), in bytes."""
    number, unit = size.split()
    return float(number) * SIZE_UNITS[unit]


def human_size(n: float) -> str:
    """Bytes as PyTorch's messages write them: `1.5 GiB`."""
    for unit in ("GiB", "MiB", "KiB"):
        if n >= SIZE_UNITS[unit]:
            return f"{n / SIZE_UNITS[unit]:.1f} {unit}"
    return f"{n:.0f} bytes"

