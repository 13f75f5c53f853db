"""Make the tiny model and corpus bundled in duoka/assets (run once; the outputs are committed).

    python tools/make_tiny_model.py [--steps 600] [--minutes 12]

Corpus: the docstrings of CPython's standard library (PSF licence), read with `ast` (no
module is imported), deduplicated, one document per docstring. It is English technical
prose, it is on every machine with Python, and it is small enough to ship.

Model: a 4-layer Qwen2 (hidden 192, 6 query / 2 KV heads, tied head) with a 4096-entry
byte-level BPE trained on the same corpus, trained for a few minutes on the CPU with
AdamW. It is there so `duoka generate` works on a fresh machine without a download and
shows text that resembles its corpus; it is not a useful language model.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duoka.data.tokenizer import train_bpe_tokenizer  # noqa: E402
from duoka.models.qwen2.args import ModelArgs  # noqa: E402
from duoka.models.qwen2.hf_adapter import save_hf_checkpoint  # noqa: E402
from duoka.models.qwen2.model import build_model, materialize  # noqa: E402

ASSETS = ROOT / "duoka" / "assets"


def stdlib_docstrings() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen, docs = set(), []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in ("test", "site-packages", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80 and doc not in seen:
                    seen.add(doc)
                    docs.append(doc.strip())
    return docs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--minutes", type=float, default=12.0, help="stop early after this much training time")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    a = p.parse_args()
    torch.manual_seed(0)

    docs = stdlib_docstrings()
    corpus_dir = ASSETS / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with gzip.open(corpus_dir / "stdlib_docstrings.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as f:
        import json

        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    print(f"corpus: {len(docs)} docstrings, {sum(map(len, docs)) / 1e6:.1f} M characters", flush=True)

    out = ASSETS / "tiny-qwen2"
    tok_dir = ASSETS / ".tokenizer-build"
    tokenizer = train_bpe_tokenizer(docs, 4096, tok_dir)
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    print(f"tokens: {len(data) / 1e6:.2f} M", flush=True)

    args = ModelArgs(vocab_size=tokenizer.vocab_size, dim=192, n_layers=4, n_heads=6, n_kv_heads=2,
                     intermediate_size=512, max_seq_len=1024, tie_word_embeddings=True,
                     bos_token_id=None, eos_token_id=eos)
    model = materialize(build_model(args), "cpu")
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 30
    start = time.time()
    for step in range(a.steps):
        lr = 3e-3 * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - a.seq - 1, (a.batch,))
        batch = torch.stack([data[s : s + a.seq + 1] for s in starts])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} {time.time() - start:.0f}s", flush=True)
        if time.time() - start > a.minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break

    save_hf_checkpoint(model.to(torch.bfloat16), out, dtype=torch.bfloat16,
                       extra_files=[tok_dir / "tokenizer.json", tok_dir / "tokenizer_config.json"])
    (out / "generation_config.json").write_text(f'{{"eos_token_id": {eos}, "max_new_tokens": 128}}\n')
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()
    print(f"saved {out}", flush=True)


if __name__ == "__main__":
    main()
