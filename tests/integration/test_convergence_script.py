"""bench/convergence.py end to end on the CPU: duoka train (2 gloo processes, DDP) against
the transformers peer (torchrun, DDP) from the same initial weights on the same batches.
fp32, so the two sides compute the same numbers up to summation order: the first loss
(same weights, same data, before any update) must agree to 1e-4 relative, and the later
ones stay as close because the updates agree too. About 35 s on 2 cores, most of it the
two process groups starting and importing torch and transformers."""

import json
import subprocess
import sys

import pytest


def test_duoka_and_the_transformers_peer_follow_the_same_loss_curve(duoka, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "convergence.json"
    proc = subprocess.run(
        [sys.executable, str(duoka.root / "bench" / "convergence.py"), "--flavor", "debug", "--steps", "6",
         "--seq", "32", "--micro-batch", "2", "--global-batch", "8", "--nproc", "2",
         "--layout-flags", "--parallel.dp_mode=ddp", "--dtype", "fp32", "--workdir", str(tmp_path / "work"),
         "--out", str(out)],
        check=False, capture_output=True, text=True, cwd=duoka.root, timeout=300, stdin=subprocess.DEVNULL,
        env=duoka.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())

    duoka, peer = r["duoka"], r["peer"]
    assert len(duoka) == len(peer) == 6
    assert (r["flavor"], r["steps"], r["nproc"], r["dtype"], r["device"]) == ("debug", 6, 2, "fp32", "cpu")
    # Step 1: same weights, same batch, no update yet.
    assert abs(duoka[0] - peer[0]) <= 1e-4 * abs(peer[0]), (duoka[0], peer[0])
    # Later steps: the same updates (same lr schedule, clipping, decay grouping) keep them together.
    for d, p in zip(duoka, peer, strict=True):
        assert abs(d - p) <= 1e-3 * abs(p), (duoka, peer)
    assert r["details"]["duoka_lr"] == r["details"]["peer_lr"]
    assert r["details"]["duoka_grad_norm"] == pytest.approx(r["details"]["peer_grad_norm"], rel=1e-3)
    assert duoka[-1] < duoka[0] - 0.1  # it trained: a comparison of two frozen models would prove little

    assert r["final_window"] == 6  # the whole run is shorter than the usual 10-step window
    assert r["duoka_final"] == pytest.approx(sum(duoka) / 6) and r["peer_final"] == pytest.approx(sum(peer) / 6)
    assert r["relative_difference"] <= 1e-3 and r["within_1pct"] is True
    assert "--parallel.dp_mode=ddp" in r["duoka_flags"] and "--training.dtype=fp32" in r["duoka_flags"]
    assert r["wall_s"]["duoka"] > 0 and r["wall_s"]["peer"] > 0
    assert r["details"]["corpus"]["tokens"] >= 6 * 8 * 33
    # The one-line summary on stdout.
    assert "within 1%" in proc.stdout and str(out) in proc.stdout
