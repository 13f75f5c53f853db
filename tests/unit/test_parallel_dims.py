"""Layout arithmetic and the checks that refuse impossible layouts (no processes)."""

import pytest
import torch

from duoka.config import ParallelConfig
from duoka.errors import DuokaError
from duoka.models.qwen2.args import FLAVORS, ModelOptions
from duoka.models.qwen2.context_parallel import (
    CONTEXT_METHODS,
    ContextGroup,
    resolve_context_method,
    shard_sequence,
    ulysses_kv_repeat,
)
from duoka.models.qwen2.stages import layer_counts, stage_ids
from duoka.parallel.dims import ParallelDims
from duoka.parallel.pipeline import build_stage_model


def dims(world, **kw):
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_sizes_fill_in_and_coordinates_are_row_major():
    d = dims(16, dp_mode="fsdp", dp_replicate=2, tp=2, pp=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp) == (2, 2, 2, 2)
    assert d.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert d.coordinates(13) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}  # 13 = 8 + 4 + 1
    assert d.dp_rank(13) == 2 and d.dp_size == 4
    assert dims(8, tp=2).dp_replicate == 4 and dims(8, tp=2).fsdp  # ddp under tp: replicated FSDP2
    assert dims(4).describe() == "DDP x4"
    assert dims(4, tp=2, pp=2).describe() == "TP x2 | PP x2"


@pytest.mark.parametrize("world, kw, message", [
    (4, {"tp": 3}, "does not divide the 4 processes"),
    (8, {"dp_mode": "fsdp", "dp_replicate": 3, "tp": 2}, "dp_replicate=3 does not divide the 4 data-parallel"),
    (2, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "set parallel.pp_stages_per_rank=2"),
    (2, {"pp": 2, "pp_schedule": "1f1b", "pp_stages_per_rank": 2}, "runs one stage per rank"),
    (4, {"dp_mode": "ddp", "dp_shard": 2}, "needs parallel.dp_mode=fsdp"),
])
def test_impossible_layouts_name_the_fix(world, kw, message):
    with pytest.raises(DuokaError) as e:
        dims(world, **kw)
    assert message in str(e.value)


def test_tp_must_divide_heads_and_kv_heads():
    qwen7b = FLAVORS["qwen2-7b"]  # 28 heads, 4 KV heads
    dims(8, tp=4).check_model(qwen7b.n_heads, qwen7b.n_kv_heads, qwen7b.n_layers)
    with pytest.raises(DuokaError) as e:
        dims(8, tp=8).check_model(qwen7b.n_heads, qwen7b.n_kv_heads, qwen7b.n_layers)
    assert "28 attention heads and 4 KV heads" in str(e.value) and "[1, 2, 4]" in str(e.value)
    with pytest.raises(DuokaError, match="at most 4 stages"):
        dims(8, pp=8).check_model(4, 2, 4)


def test_layer_splits():
    q05 = FLAVORS["qwen2-0.5b"]
    assert layer_counts(q05, 2, "even") == [12, 12]  # 24 layers + embedding + head = 26 units
    assert layer_counts(FLAVORS["qwen2-7b"], 4, "even") == [6, 8, 8, 6]
    flops = layer_counts(q05, 2, "flops")
    assert sum(flops) == 24 and flops[1] < flops[0]  # the 152k-vocabulary head weighs on the last stage
    assert layer_counts(q05, 3, "4,10,10") == [4, 10, 10]
    with pytest.raises(DuokaError, match="summing to the model's 24 layers"):
        layer_counts(q05, 2, "10,10")
    assert stage_ids(1, 4, 2) == [1, 5]


def test_stage_models_keep_names_and_the_tied_weight():
    args = FLAVORS["debug"]  # tied embeddings
    first, last = (build_stage_model(args, ModelOptions(), s, [2, 2]) for s in (0, 1))
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.output is None and first.norm is None and first.takes_tokens
    assert not last.takes_tokens and last.output.weight is last.tok_embeddings.weight
    middle = build_stage_model(args, ModelOptions(), 1, [1, 2, 1])
    assert middle.tok_embeddings is None and middle.output is None


def test_measured_split_balances_the_timed_costs():
    import torch

    from duoka.models.qwen2.stages import balanced_counts
    from duoka.parallel.pipeline import measure_stage_costs

    layer, head = measure_stage_costs(FLAVORS["debug"], 2, 32, torch.device("cpu"), torch.float32, repeats=2)
    assert layer > 0 and head > 0
    # A head worth 3 layers: the last of 2 stages takes 3 of 10 layers (7 | 3 + head).
    assert balanced_counts(10, 2, 1.0, 3.0) == [7, 3]  # largest stage 7 either way; ties favour the head's
    assert balanced_counts(12, 3, 1.0, 0.0) == [4, 4, 4]
    assert sum(balanced_counts(24, 4, 1.0, 9.0)) == 24


def test_the_context_method_follows_the_heads():
    """parallel.cp_method: auto takes Ulysses where the query heads divide by cp (whole heads per
    rank), else the all-gather; Ulysses asked for where they do not is refused, naming the fix."""
    assert [resolve_context_method("auto", cp, 28) for cp in (2, 4, 7, 8)] == \
        ["ulysses", "ulysses", "ulysses", "allgather"]
    assert resolve_context_method("allgather", 4, 28) == "allgather"
    with pytest.raises(DuokaError, match="does not divide 28") as e:
        resolve_context_method("ulysses", 8, 28)
    assert "parallel.cp_method=allgather" in e.value.fix and "2, 4, 7, 14, 28" in e.value.fix
    # KV heads fewer than cp (or not dividing by it) are repeated up to lcm(kv heads, cp).
    assert [ulysses_kv_repeat(kv, cp) for kv, cp in ((4, 4), (4, 2), (2, 4), (4, 8), (4, 6))] == [1, 1, 2, 2, 3]
    d = dims(8, dp_mode="fsdp", cp=8, cp_method="ulysses")
    with pytest.raises(DuokaError, match="parallel.cp_method=ulysses"):
        d.check_model(28, 4, 28)  # before any worker starts: resolve_run calls it
    assert dims(8, dp_mode="fsdp", cp=4).context_method(28) == "ulysses"
    assert dims(8, dp_mode="fsdp", cp=8).context_method(28) == "allgather"


def test_ulysses_keeps_the_whole_sequences_varlen_offsets():
    """shard_sequence cuts every [batch, seq] tensor to the rank's chunks; cu_seqlens, which
    describes the whole sequence, stays for Ulysses (its attention sees the whole sequence in
    order) and goes for the all-gather (its dense mask replaces it)."""
    tokens = torch.arange(16).view(1, 16)
    batch = {"tokens": tokens, "labels": tokens + 100, "cu_seqlens": torch.tensor([0, 5, 16], dtype=torch.int32)}
    for method in CONTEXT_METHODS:
        local = shard_sequence(batch, ContextGroup(None, 2, 1, method))
        assert local["tokens"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 1 and 2 of 4
        assert local["labels"].tolist() == [[104, 105, 106, 107, 108, 109, 110, 111]]
        assert ("cu_seqlens" in local) == (method == "ulysses")
