"""int4_gemv's kernel compiled for a GPU without one (Triton's bundled ptxas and cuobjdump): the
instructions its main loop issues per weight, by opcode, for each candidate tile and 1-4 token rows. A one-row int4
GEMV is bound by instruction issue before memory (an H100 SM issues 128 lane-instructions a
clock and must widen ~26 weights a clock to read at 3 TB/s: ~4.9 instructions a weight at most),
so this count is the kernel's first figure of merit, measurable on a CPU (bench/NOTES.md 49).

    python bench/kernel_sass.py [--arch 90] [--rows 1,2,3,4] [--out sass.json]

The arguments are specialised as Triton's launcher specialises them for the 7B shapes (pointers
and the widths N and K/8 divisible by 16, the group 128 columns, tiles that divide the widths).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from duoka.models.quant import int4_gemv

SIGNATURE = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*bf16", "Y": "*bf16", "N": "i32", "WORDS": "i32",
             "MAGIC_BITS": "i32"}
DIVISIBLE = ("X", "W", "S", "Z", "Y", "N", "WORDS")
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)")


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the kernel's reduction loop."""
    body = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
            if (m := INSTRUCTION.match(line))]
    loops = []
    for addr, op, line in body:
        target = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", line) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    start, end = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(op for addr, op, _ in body if start <= addr <= end)


def compile_tile(tiles: int4_gemv.Int4Tiles, arch: int, rows: int = 1, group_words: int = 16) -> dict:
    fn = int4_gemv._int4_gemv_kernel
    names = fn.arg_names
    constexprs = {"GROUP_WORDS": group_words, "ROWS": rows, "BLOCK_N": tiles.block_n, "BLOCK_WORDS": tiles.block_words,
                  "EVEN": True}
    signature = {name: SIGNATURE.get(name, "constexpr") for name in names}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
    counts = loop_counts(sass)
    weights = tiles.block_n * tiles.block_words * 8 / (32 * tiles.num_warps)  # per thread and iteration
    total = sum(counts.values())
    return {"tiles": str(tiles), "rows": rows, "loop_instructions": total, "weights_per_thread": weights,
            "instructions_per_weight": round(total / weights, 2), "opcodes": dict(counts.most_common())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--rows", default="1,2,3,4", help="token rows (the kernel's ROWS) to compile for")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    rows = [compile_tile(t, a.arch, r) for r in map(int, a.rows.split(",")) for t in int4_gemv.CANDIDATES]
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in list(r["opcodes"].items())[:6])
        print(f"rows {r['rows']} {r['tiles']:<66} {r['instructions_per_weight']:>5} a weight   {top}")
    if a.out:
        a.out.write_text(json.dumps({"arch": a.arch, "triton": triton.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
