"""models.row_logprobs' kernel (one pass over each row of logits: log-sum-exp, the target's
logit and rank, the top-1) equals the same figures from torch ops on the fp32 row, in fp32 and
bf16, on a vocabulary that is no multiple of the kernel's block, with the target at the top,
in the middle and tied; and prompt logprobs launched through it pack what the torch path packs,
for k = 0, 1 and 3. Run by Triton's interpreter on the CPU (a process of its own, as
test_moe_gemv); on a GPU: `python3 tests/unit/test_row_logprobs.py --device cuda`."""

import json
import sys

import pytest
import torch

pytest.importorskip("triton")

VOCAB = 9000  # two whole 4,096 blocks and a partial one


def _logits(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, VOCAB, generator=g) * 3).to(dtype)
    targets = torch.randint(0, VOCAB, (6,), generator=g)
    targets[1] = logits[1].float().argmax()  # the target is the row's largest: rank 1
    logits[2, 8999] = logits[2].max() + 1  # the largest in the partial block
    logits[3, 17] = logits[3, 5000] = logits[3].max() + 2  # a tie for the top: the first index
    targets[3] = 5000  # the target tied with a larger-index equal: rank 1
    return logits.to(device), targets.to(device)


def _kernel_errors(device: str) -> dict:
    from duoka.models.row_logprobs import reference_row_stats, row_stats

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = _logits(dtype, device)
        got = [t.cpu() for t in row_stats(logits, targets)]
        want = [t.cpu() for t in reference_row_stats(logits, targets)]
        out[str(dtype)] = {
            "lse": (got[0] - want[0]).abs().max().item(), "target_equal": torch.equal(got[1], want[1]),
            "greater": got[2].tolist(), "greater_want": want[2].tolist(), "top_equal": torch.equal(got[3], want[3]),
            "top_ids": got[4].tolist(), "top_ids_want": want[4].tolist()}
    return out


def _packed(device: str) -> dict:
    """launch_prompt_logprobs, fused against torch ops: the packed host arrays' largest difference."""
    from duoka.serve.prompt_logprobs import PromptRows, launch_prompt_logprobs

    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(32, VOCAB, bias=False).to(device)
    hidden = torch.randn(11, 32, generator=g).to(device)
    targets = torch.randint(0, VOCAB, (11,), generator=g)
    diffs = {}
    for k in (0, 1, 3):
        prompt = PromptRows(torch.arange(11), targets, k, ())
        fused, plain = (launch_prompt_logprobs(head, hidden, prompt, 4, fused).copy.array() for fused in (True, False))
        diffs[k] = float(abs(fused - plain).max()) if fused.shape == plain.shape else None
    return diffs


def _run(device: str = "cpu") -> dict:
    return {"kernel": _kernel_errors(device), "packed": _packed(device)}


@pytest.fixture(scope="module")
def result(triton_interpreted):
    return triton_interpreted(__file__)


def test_one_pass_equals_torch_on_the_fp32_row(result):
    for dtype, r in result["kernel"].items():
        assert r["lse"] <= 1e-5 * 12, (dtype, r)  # |lse| ~ 12 here: a few fp32 ulps
        assert r["target_equal"] and r["top_equal"], (dtype, r)
        assert r["greater"] == r["greater_want"] and r["greater"][1] == 0 and r["greater"][3] == 0, (dtype, r)
        assert r["top_ids"] == r["top_ids_want"] and r["top_ids"][2] == 8999 and r["top_ids"][3] == 17, (dtype, r)


def test_prompt_logprobs_pack_the_same_fused_or_not(result):
    assert set(result["packed"]) == {"0", "1", "3"}, result["packed"]
    for k, diff in result["packed"].items():
        assert diff is not None and diff <= 1e-4, (k, diff)


if __name__ == "__main__":
    print(json.dumps(_run(sys.argv[2] if sys.argv[1:2] == ["--device"] else "cpu")))
