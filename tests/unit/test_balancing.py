"""The load-balance component's decisions that set which collective runs next must be the
same on every rank: every rank issues the same collectives in the same order, whatever its
local timing."""

import torch

from duoka.config import load_config
from duoka.parallel.dims import ParallelDims
from duoka.train.console import Silent
from duoka.train.load_balance import LoadBalancing


def _component(rank: int, *overrides: str) -> LoadBalancing:
    cfg = load_config(None, list(overrides))
    dims = ParallelDims.from_config(cfg.parallel, 2)
    return LoadBalancing(cfg, dims, rank, 2, torch.device("cpu"), global_batch=8, micro_batch=2, lag=4,
                         console=Silent())


def test_a_slowed_rank_and_its_peers_agree_on_the_step_end():
    # Only rank 1 is slowed (it alone has a timer); a deferred step end on rank 0 and a
    # synchronous one on rank 1 ran the metrics gather and the next step's all-reduce in
    # opposite orders: the job hung.
    ranks = [_component(r, "--parallel.balance=off", "--debug.slow_ranks=1:0.5") for r in (0, 1)]
    assert [r.timer is not None for r in ranks] == [False, True]
    assert [r.synchronous for r in ranks] == [True, True]


def test_without_balancing_or_slowdown_every_rank_defers():
    assert [_component(r, "--parallel.balance=off").synchronous for r in (0, 1)] == [False, False]
    assert [_component(r, "--parallel.balance=auto").synchronous for r in (0, 1)] == [True, True]
