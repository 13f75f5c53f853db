"""duoka.train.load_balance: shares, micro-batch plans, the decision rule, parsing."""

import pytest

from duoka.errors import DuokaError
from duoka.train.load_balance import (
    SETTLE_STEPS,
    Balancer,
    micro_batch_sizes,
    parse_rank_factors,
    parse_weights,
    proportional_shares,
)


def test_proportional_shares_sum_floor_and_rounding():
    assert proportional_shares(16, [1, 1]) == [8, 8]
    assert proportional_shares(16, [1, 0.5]) == [11, 5]  # 10.67 : 5.33
    assert proportional_shares(10, [100, 1, 1], floor=2) == [6, 2, 2]
    assert sum(proportional_shares(1001, [0.3, 1.7, 2.2, 0.9])) == 1001
    with pytest.raises(ValueError):
        proportional_shares(3, [1, 1], floor=2)


def test_micro_batches_never_exceed_the_size_that_fits():
    # DDP: counts may differ per rank; FSDP2: the same count on every rank.
    assert micro_batch_sizes([11, 5], 4, equal_count=False) == [[4, 4, 3], [3, 2]]
    assert micro_batch_sizes([11, 5], 4, equal_count=True) == [[4, 4, 3], [2, 2, 1]]
    assert micro_batch_sizes([8, 8], 2, equal_count=True) == [[2] * 4, [2] * 4]


def test_fsdp_shares_never_fall_below_the_common_micro_batch_count():
    b = Balancer("static", 2, 16, 2, equal_count=True, weights=[1, 0.01])
    shares = b.shares_for(0)
    count = max(-(-s // 2) for s in shares)
    assert sum(shares) == 16 and min(shares) >= count  # no empty micro-batch on the slow rank
    offset, sizes = b.plan(0, 1)
    assert offset == shares[0] and sum(sizes) == shares[1] and len(sizes) == count


def test_auto_follows_the_measured_speed_with_lag_and_hysteresis():
    b = Balancer("auto", 2, 16, 2, equal_count=False, window=3, hysteresis=0.05, lag=4)
    fast, slow = 0.01, 0.02  # seconds per sample: rank 1 at half speed
    messages = [b.observe(step, [8 * fast, 8 * slow], [8, 8]) for step in range(4)]
    # Step 0 is warm-up, steps 1-3 fill the window; the change is decided after step 3.
    assert messages[:3] == [None, None, None] and "[8, 8] -> [11, 5] from step 8" in messages[3]
    assert [b.shares_for(s) for s in (6, 7, 100)] == [[8, 8], [11, 5], [11, 5]]  # 0-based; the log says 8
    # While the change is on its way in, nothing is measured or decided; nor in the first
    # steps on the new shares (they may compile for the new micro-batch sizes).
    assert b.observe(5, [1.0, 1.0], [8, 8]) is None and len(b.samples) == 0
    for step in range(7, 7 + SETTLE_STEPS):
        assert b.observe(step, [1.0, 100.0], [11, 5]) is None and len(b.samples) == 0
    b.observe(7 + SETTLE_STEPS, [11 * fast, 5 * slow], [11, 5])
    assert len(b.samples) == 1
    # Balanced now: noise below the hysteresis changes nothing.
    for step in range(8, 20):
        assert b.observe(step, [11 * fast * 1.01, 5 * slow], [11, 5]) is None
    assert b.shares_for(100) == [11, 5]


def test_state_round_trip_and_refusal_for_another_layout():
    b = Balancer("auto", 2, 16, 2, equal_count=False, window=2)
    for step in range(3):
        b.observe(step, [0.1, 0.3], [8, 8])
    state = b.state_dict()
    restored = Balancer("auto", 2, 16, 2, equal_count=False, window=2)
    assert restored.load_state_dict(state) and restored.schedule == b.schedule
    assert not Balancer("auto", 4, 16, 2, equal_count=False).load_state_dict(state)


def test_parsing_errors_name_the_fix():
    assert parse_rank_factors("1:0.5, 3:0.8", 4) == {1: 0.5, 3: 0.8}
    with pytest.raises(DuokaError, match="ranks 0..1"):
        parse_rank_factors("2:0.5", 2)
    with pytest.raises(DuokaError, match=r"\(0, 1\]"):
        parse_rank_factors("1:2", 2)
    with pytest.raises(DuokaError, match="RANK:FACTOR"):
        parse_rank_factors("1-0.5", 2)
    assert parse_weights("1,0.5", 2) == [1.0, 0.5]
    with pytest.raises(DuokaError, match="2 positive"):
        parse_weights("1,0.5,1", 2)


def test_balance_refuses_model_parallel_layouts_and_static_without_weights():
    """The launcher runs this check before any worker starts (duoka/train/spec.py resolve_run)."""
    from duoka.config import load_config
    from duoka.train.load_balance import check_config

    cfg = load_config(None, ["--parallel.pp=2", "--parallel.balance=auto"])
    with pytest.raises(DuokaError, match="pp_layers=measured"):
        check_config(cfg.parallel, cfg.debug, model_parallel=True, tp=1, pp=2, dp_size=1, world=2)
    cfg = load_config(None, ["--parallel.balance=static"])
    with pytest.raises(DuokaError, match="needs parallel.balance_weights"):
        check_config(cfg.parallel, cfg.debug, model_parallel=False, tp=1, pp=1, dp_size=2, world=2)
    cfg = load_config(None, ["--parallel.balance=static", "--parallel.balance_weights=1,0.5"])
    assert check_config(cfg.parallel, cfg.debug, model_parallel=False, tp=1, pp=1, dp_size=2, world=2) == [1.0, 0.5]
