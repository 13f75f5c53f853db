"""LoRA (duoka.models.lora, duoka.models.qwen2.peft, duoka.train.adapters) against Hugging
Face PEFT on tiny random Qwen2 models, fp32 on CPU: the same initial function, the same
gradients, adapters that PEFT loads with the same logits, PEFT's adapters merged here."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from duoka.config import load_config
from duoka.errors import DuokaError
from duoka.models.lora import LINEAR_NAMES, LoRAArgs, cast_frozen_, linear, quantize_weight_, trainable_numel
from duoka.models.qwen2.args import FLAVORS, ModelOptions
from duoka.models.qwen2.hf_adapter import load_hf_model
from duoka.models.qwen2.model import build_model
from duoka.models.qwen2.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge_adapter, peft_name, save_adapter
from duoka.train import adapters

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 1001  # tests/conftest.py's hf_config
TOKENS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(3))


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def peft_model(folder, lora: LoRAArgs, **config):
    """transformers' Qwen2ForCausalLM from `folder` with PEFT's LoRA of the same settings."""
    from transformers import Qwen2ForCausalLM

    base = Qwen2ForCausalLM.from_pretrained(folder).eval()
    cfg = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.targets), modules_to_save=list(lora.modules_to_save) or None,
                          ensure_weight_tying=base.config.tie_word_embeddings, task_type="CAUSAL_LM", **config)
    return peft.get_peft_model(base, cfg)


def randomise_adapters(ours, theirs=None, seed=0):
    """Give every adapter (B too, which starts at zero) random values, the same in PEFT's copy."""
    gen = torch.Generator().manual_seed(seed)
    named = dict(theirs.named_parameters()) if theirs is not None else {}
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
                if theirs is not None:
                    named[peft_name(name).replace(".weight", ".default.weight")].copy_(p)


def loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


# ------------------------------------------------------------------ configuration


def test_config_section_resolves_names_and_refuses_unknown_ones(tmp_path):
    assert adapters.lora_args(load_config()) is None  # rank 0: off
    on = adapters.lora_args(load_config(overrides=["--lora.rank=8"]))
    assert on == LoRAArgs(rank=8, alpha=16.0, dropout=0.0, targets=LINEAR_NAMES)  # all-linear, alpha = 2 x rank
    toml = tmp_path / "lora.toml"
    # PEFT's users write lists; their order does not matter.
    toml.write_text('[lora]\nrank = 4\nalpha = 8.0\ntarget_modules = ["v_proj", "q_proj"]\n'
                    'modules_to_save = ["lm_head"]\n')
    cfg = load_config(toml)
    assert cfg.lora.target_modules == "v_proj,q_proj"
    assert adapters.lora_args(cfg) == LoRAArgs(4, 8.0, 0.0, ("q_proj", "v_proj"), ("lm_head",))

    with pytest.raises(DuokaError) as e:
        adapters.lora_args(load_config(overrides=["--lora.rank=8", "--lora.target_modules=q_proj,qkv_proj"]))
    assert "'qkv_proj'" in e.value.cause and "q_proj, k_proj" in e.value.fix
    with pytest.raises(DuokaError) as e:
        adapters.lora_args(load_config(overrides=["--lora.rank=8", "--lora.target_modules=lm_head"]))
    assert 'modules_to_save = "lm_head"' in e.value.cause
    with pytest.raises(DuokaError) as e:
        adapters.lora_args(load_config(overrides=["--lora.rank=8", "--lora.modules_to_save=norm"]))
    assert "embed_tokens, lm_head" in e.value.fix
    with pytest.raises(DuokaError, match="out of range"):
        load_config(overrides=["--lora.rank=-1"])


QLORA = "--lora.quantize=nf4"


@pytest.mark.parametrize("overrides, cause", [
    (["--parallel.pp=2"], "pipeline parallelism"),
    (["--training.float8=rowwise"], "float8"),
    ([QLORA, "--parallel.tp=2"], "split by rows only"),
    ([QLORA, "--parallel.dp_mode=fsdp", "--parallel.dp_replicate=2"], "HSDP"),
    # The bundled model's k_proj (64 x 192) is one block of NF4 scales: it cannot be split in two.
    ([QLORA, "--parallel.dp_mode=fsdp"], r"k_proj \(64 x 192\)"),
], ids=["pp", "float8", "qlora-tp", "qlora-hsdp", "qlora-fsdp-shape"])
def test_layouts_lora_cannot_run_are_refused(overrides, cause):
    from duoka.hub import bundled_model_dir
    from duoka.models.qwen2.hf_adapter import read_config
    from duoka.parallel.dims import ParallelDims

    args = read_config(bundled_model_dir())
    cfg = load_config(overrides=["--lora.rank=8", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, 2)
    with pytest.raises(DuokaError, match=cause) as e:
        adapters.check_layout(cfg, dims, args)
    assert e.value.fix
    without = [o for o in overrides if o != QLORA]
    if without != overrides:  # the same layout for LoRA, and QLoRA under DDP and FSDP2 where the shapes split
        adapters.check_layout(load_config(overrides=["--lora.rank=8", *without]), dims, args)
        for layout in (["--nproc-per-node=2"], ["--parallel.dp_mode=fsdp"]):
            cfg = load_config(overrides=["--lora.rank=8", QLORA, *layout[1:]])
            adapters.check_layout(cfg, ParallelDims.from_config(cfg.parallel, 2), FLAVORS["qwen2-7b"])
    else:
        adapters.check_layout(load_config(overrides=overrides), dims, args)  # without LoRA: not this check's


def test_qlora_settings_parse_and_mistakes_are_refused(tmp_path):
    qlora = adapters.lora_args(load_config(overrides=["--lora.rank=4", QLORA]))
    assert qlora.quantize == "nf4"
    base = adapters.base_identity(None, FLAVORS["debug"], seed=0)
    state = {"config": {"lora": {"rank": 4, "alpha": 0.0, "target_modules": "all-linear", "quantize": "nf4"}},
             "base": base}
    adapters.check_resume(tmp_path, state, qlora, base)
    with pytest.raises(DuokaError, match="trained with LoRA rank 4, .*, base in nf4; this run asks for LoRA rank 4"):
        adapters.check_resume(tmp_path, state, LoRAArgs(rank=4, alpha=8.0), base)  # adapters of another base
    with pytest.raises(DuokaError, match="lora.rank is 0") as e:
        adapters.lora_args(load_config(overrides=[QLORA]))
    assert "lora.rank > 0" in e.value.fix
    with pytest.raises(DuokaError, match="nf4"):
        load_config(overrides=["--lora.quantize=int4"])
    with pytest.raises(DuokaError, match="not a whole number of NF4 blocks"):
        build_model(FLAVORS["debug"].replace(dim=104), lora=LoRAArgs(rank=4, alpha=8, quantize="nf4"))


# ------------------------------------------------------------------ the model


def test_only_adapters_and_saved_modules_train_and_the_frozen_base_is_stored_in_the_compute_dtype():
    args = FLAVORS["debug"]  # a tied head
    model = build_model(args, lora=LoRAArgs(rank=4, alpha=8, targets=("q_proj", "down_proj"),
                                            modules_to_save=("lm_head",)))
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    # The tied head is the embedding: training lm_head trains it (named once).
    assert trained == sorted(["tok_embeddings.weight"] + [
        f"layers.{i}.{layer}.lora_{ab}.weight" for i in range(args.n_layers)
        for layer in ("attention.wq", "feed_forward.w2") for ab in "ab"])
    cast_frozen_(model, torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert model.output.weight is model.tok_embeddings.weight  # still one matrix
    assert trainable_numel(model) == args.vocab_size * args.dim + args.n_layers * 4 * (
        args.dim + args.dim + args.intermediate_size + args.dim)
    with pytest.raises(ValueError, match="merge the adapter"):
        build_model(args, ModelOptions(packed_projections=True), lora=LoRAArgs(rank=4, alpha=8))


def test_the_trainer_s_model_holds_its_base_in_bf16_and_gives_the_optimizer_only_what_trains():
    """What a bf16 LoRA worker builds (duoka.train.model_setup): the base loaded from its
    folder into bf16 storage, fresh fp32 adapters, AdamW state for those alone; on resume
    the base is loaded again and the adapters are left for the checkpoint."""
    from duoka.hub import bundled_model_dir
    from duoka.models.qwen2.hf_adapter import read_config
    from duoka.parallel.dims import ParallelDims
    from duoka.parallel.parallelize import ParallelOptions
    from duoka.train.model_setup import Filler, build_training_model
    from duoka.train.optimizers import build_optimizer

    cfg = load_config(overrides=["--lora.rank=4"])
    base, lora = bundled_model_dir(), adapters.lora_args(cfg)
    args = read_config(base)
    par = ParallelOptions(compute_dtype=torch.bfloat16, activation_checkpointing=False, float8="none",
                          fsdp_blocks_per_unit=1, reshard_after_forward=True, ddp_bucket_mb=25)

    def build(resuming):
        return build_training_model(args, ModelOptions(), par, ParallelDims.from_config(cfg.parallel, 1), None,
                                    torch.device("cpu"), Filler(str(base), 0, resuming, False), None, lora)

    model = build(resuming=False)
    reference, _ = load_hf_model(base, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert ".lora_" in name and p.dtype == torch.float32, name
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, reference.get_parameter(name)), name
    assert model.get_parameter("layers.0.attention.wq.lora_a.weight").abs().max() > 0
    optimizer = build_optimizer(model, cfg.optimizer, 1e-3, "cpu")
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == args.adapter_params(lora)

    resumed = build(resuming=True)
    assert torch.equal(resumed.get_parameter("norm.weight"), reference.norm.weight)


# NF4 rounds each weight to one of 16 levels of its 64-weight block's absmax: about 9% of a
# normally distributed weight's norm (measured 9.2% on the bundled model's MLP). Across the
# layers the errors partly cancel in the logits: measured 3.2% relative (and 95% of the greedy
# tokens unchanged). 6% leaves room for the seed; a base left unquantized would differ by 0,
# and a misplaced scale or block by far more than 6%.
NF4_LOGITS_TOLERANCE = 0.06


def test_the_nf4_base_computes_close_to_the_bf16_one_and_exactly_its_dequantized_weights():
    """QLoRA's model: every decoder linear weight an NF4Tensor (4 bits a weight, plus the
    scales), released in its old form; its logits within NF4's rounding of the unquantized
    base's, and equal to those of a plain model holding the dequantized weights (the base
    that export --merge merges into)."""
    import gc
    import weakref

    from torchao.quantization import NF4Tensor

    from duoka.hub import bundled_model_dir
    from duoka.models.qwen2.hf_adapter import load_hf_weights, read_config
    from duoka.models.qwen2.model import materialize
    from duoka.models.qwen2.peft import dequantized_base_

    folder = bundled_model_dir()
    qlora = LoRAArgs(rank=4, alpha=8, quantize="nf4")
    model = materialize(build_model(read_config(folder), lora=qlora), "cpu", torch.float32)
    load_hf_weights(model, folder)
    model.init_weights(seed=0, adapters_only=True)
    before = [weakref.ref(layer.weight) for block in model.layers.values() for layer in block.base_linears()]
    model.quantize_base_()
    gc.collect()
    assert len(before) == 4 * 7 and all(ref() is None for ref in before)  # nothing holds the fp32 weights
    for block in model.layers.values():
        for layer in block.base_linears():
            w = layer.weight
            assert isinstance(w, NF4Tensor) and not w.requires_grad
            assert w.quantized_data.numel() == w.numel() // 2 and w.quantized_data.dtype == torch.uint8
    assert model.layers["0"].attention.wq.bias.dtype == torch.float32  # biases, norms, embedding: as they were

    tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
    base, _ = load_hf_model(folder)
    with torch.no_grad():
        ours, unquantized = model.eval()(tokens), base(tokens)
        dequantized = dequantized_base_(base)(tokens)
    assert 0 < rel_err(ours, unquantized) <= NF4_LOGITS_TOLERANCE
    assert rel_err(ours, dequantized) <= 1e-6


def test_a_few_qlora_steps_reduce_the_loss_and_change_only_the_adapters():
    """The trainer's model under QLoRA (duoka.train.model_setup): AdamW on the adapters alone
    fits a fixed batch; the NF4 base, the norms and the embedding stay as they were."""
    from duoka.hub import bundled_model_dir
    from duoka.models.qwen2.hf_adapter import read_config
    from duoka.parallel.dims import ParallelDims
    from duoka.parallel.parallelize import ParallelOptions
    from duoka.train.model_setup import Filler, build_training_model

    cfg = load_config(overrides=["--lora.rank=4", QLORA])
    folder, lora = bundled_model_dir(), adapters.lora_args(cfg)
    par = ParallelOptions(compute_dtype=torch.float32, activation_checkpointing=False, float8="none",
                          fsdp_blocks_per_unit=1, reshard_after_forward=True, ddp_bucket_mb=25)
    model = build_training_model(read_config(folder), ModelOptions(), par, ParallelDims.from_config(cfg.parallel, 1),
                                 None, torch.device("cpu"), Filler(str(folder), 0, False, False), None, lora)
    frozen = {n: (p.quantized_data if hasattr(p, "quantized_data") else p).clone()
              for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in trained) and len(trained) == 4 * 7 * 2
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-2)
    tokens = torch.randint(0, 4096, (4, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(5):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.quantized_data if hasattr(p, "quantized_data") else p, frozen[name]), name
    assert model.get_parameter("layers.0.attention.wq.lora_b.weight").abs().max() > 0


@pytest.mark.parametrize("target", [True, False], ids=["adapted", "not-adapted"])
def test_compiled_qlora_keeps_the_nf4_weight_for_backward_not_its_bf16_form(target):
    """Compiled, the partitioner would keep a dequantized weight for backward (the whole base
    in bf16 again); QLoRA's layers make backward dequantize again, with the gradients the
    uncompiled layer gives."""
    lora = LoRAArgs(rank=4, alpha=8, targets=("q_proj",), quantize="nf4")
    torch.manual_seed(0)
    layer = linear(256, 512, False, lora, "q_proj" if target else "o_proj")
    layer.to(torch.bfloat16)
    layer.weight.requires_grad_(False)
    quantize_weight_(layer)
    x0 = torch.randn(2, 32, 256, dtype=torch.bfloat16)

    def run(fn):
        x, saved = x0.clone().requires_grad_(True), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(x).float().square().sum().backward()
        return saved, x.grad

    eager_saved, eager_grad = run(layer)
    compiled_saved, compiled_grad = run(torch.compile(layer, fullgraph=True))
    assert any(type(t).__name__ == "NF4Tensor" for t in eager_saved)
    assert not any(t.shape == layer.weight.shape for t in compiled_saved), [t.shape for t in compiled_saved]
    assert any(t.dtype == torch.uint8 and t.numel() == layer.weight.numel() // 2 for t in compiled_saved)  # 4-bit codes
    # bf16: compiled and eager round in other places (relative difference ~1e-3 measured)
    assert (compiled_grad - eager_grad).float().norm() / eager_grad.float().norm() < 1e-2


def test_adapter_init_is_peft_s_and_a_function_of_seed_and_name():
    args = FLAVORS["debug"]
    lora = LoRAArgs(rank=8, alpha=16)

    def init(seed):
        model = build_model(args, device="cpu", lora=lora)
        model.init_weights(seed)
        return dict(model.named_parameters())

    a, b, c = init(0), init(0), init(1)
    q_a = a["layers.0.attention.wq.lora_a.weight"]
    # Kaiming-uniform with a = sqrt(5), PEFT's (and nn.Linear's) init: U(-1/sqrt(in), 1/sqrt(in)).
    bound = 1 / math.sqrt(args.dim)
    assert q_a.abs().max() <= bound and q_a.abs().max() > 0.95 * bound
    assert abs(q_a.std().item() - bound / math.sqrt(3)) < 0.05 * bound
    assert not a["layers.0.attention.wq.lora_b.weight"].any()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(q_a, c["layers.0.attention.wq.lora_a.weight"])
    assert not torch.equal(q_a, a["layers.1.attention.wq.lora_a.weight"])  # each its own draw


def test_a_fresh_adapter_computes_the_base_and_the_first_step_s_gradients_equal_peft_s(hf_folder):
    """The same A and B values in both (B made non-zero, else A's gradient would be zero):
    the same logits and the same gradients for every adapter and for the saved embedding."""
    hf, folder = hf_folder()
    lora = LoRAArgs(rank=4, alpha=8, modules_to_save=("lm_head",))
    ours, _ = load_hf_model(folder, lora=lora)
    with torch.no_grad():
        assert rel_err(ours(TOKENS), hf(TOKENS).logits) <= 1e-6  # B = 0: the base's function

    theirs = peft_model(folder, lora)
    randomise_adapters(ours, theirs)
    ours.train(), theirs.train()
    ours_logits = ours(TOKENS)
    loss(ours_logits, TOKENS).backward()
    theirs_logits = theirs(input_ids=TOKENS).logits
    loss(theirs_logits, TOKENS).backward()
    assert rel_err(ours_logits, theirs_logits) <= 1e-6
    assert rel_err(ours_logits, hf(TOKENS).logits) > 1e-3  # the adapters do change the function
    named = dict(theirs.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        if name == "tok_embeddings.weight":  # PEFT's saved copy of the tied pair
            other = named["base_model.model.model.embed_tokens.modules_to_save.default.weight"]
        else:
            other = named[peft_name(name).replace(".weight", ".default.weight")]
        assert rel_err(p.grad, other.grad) <= 1e-5, name
        compared += 1
    assert compared == 1 + 2 * 7 * 2  # the embedding, A and B of 7 layers x 2 blocks


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_adapter_folder_loads_in_peft_with_the_same_logits(hf_folder, tmp_path, tied):
    from transformers import Qwen2ForCausalLM

    hf, folder = hf_folder(tie_word_embeddings=tied)
    lora = LoRAArgs(rank=4, alpha=12, targets=("q_proj", "v_proj", "down_proj"), modules_to_save=("lm_head",))
    ours, _ = load_hf_model(folder, lora=lora)
    randomise_adapters(ours)
    with torch.no_grad():
        ours.output.weight.add_(torch.randn_like(ours.output.weight) * 0.1)  # the trained head
    trained = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    out = save_adapter(trained, lora, ours.args, tmp_path / "adapter", str(folder))
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str(folder) and config["target_modules"] == list(lora.targets)

    loaded = peft.PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(folder), out).eval()
    with torch.no_grad():
        assert rel_err(loaded(TOKENS).logits, ours(TOKENS)) <= 1e-6


def test_peft_s_adapter_merges_into_plain_and_packed_models(hf_folder, tmp_path):
    """An adapter PEFT trained (rsLoRA scaling, a subset of layers, a saved embedding) merged
    here computes what PEFT computes with it, in the training layout and the serving one."""
    hf, folder = hf_folder(tie_word_embeddings=False, vocab_size=997)
    lora = LoRAArgs(rank=4, alpha=6, targets=("k_proj", "v_proj", "o_proj", "up_proj"),
                    modules_to_save=("embed_tokens",))
    theirs = peft_model(folder, lora, use_rslora=True)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(tmp_path / "peft")
    tokens = TOKENS % 997
    with torch.no_grad():
        expected = theirs.eval()(tokens).logits
        for options in (ModelOptions(), ModelOptions(packed_projections=True)):
            model, _ = load_hf_model(folder, options=options)
            assert rel_err(merge_adapter(model, tmp_path / "peft")(tokens), expected) <= 1e-5, options


def test_adapters_duoka_cannot_apply_exactly_are_refused(hf_folder, tmp_path):
    hf, folder = hf_folder()
    lora = LoRAArgs(rank=4, alpha=8)
    ours, _ = load_hf_model(folder, lora=lora)
    out = save_adapter({n: p for n, p in ours.named_parameters() if p.requires_grad}, lora, ours.args,
                       tmp_path / "adapter", None)
    base, _ = load_hf_model(folder)
    before = {k: v.clone() for k, v in base.state_dict().items()}

    dora = tmp_path / "dora"
    shutil.copytree(out, dora)
    config = json.loads((dora / ADAPTER_CONFIG).read_text())
    (dora / ADAPTER_CONFIG).write_text(json.dumps(dict(config, use_dora=True)))
    with pytest.raises(DuokaError, match="use_dora"):
        merge_adapter(base, dora)

    other, other_folder = hf_folder(hidden_size=96, num_attention_heads=6)  # another shape
    wrong, _ = load_hf_model(other_folder, lora=lora)
    wrong_out = save_adapter({n: p for n, p in wrong.named_parameters() if p.requires_grad}, lora, wrong.args,
                             tmp_path / "wrong", None)
    with pytest.raises(DuokaError, match="does not fit this base") as e:
        merge_adapter(base, wrong_out)
    assert "layers.0.attention.wk.weight: adapter 32 x 96, model 32 x 64" in e.value.cause
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # nothing half merged

    from safetensors.torch import load_file, save_file

    tensors = load_file(out / ADAPTER_WEIGHTS)
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_embedding_A"] = torch.zeros(1)
    save_file(tensors, out / ADAPTER_WEIGHTS)
    with pytest.raises(DuokaError, match="no place for: .*lora_embedding_A"):
        merge_adapter(base, out)


def test_tensor_parallel_splits_each_adapter_like_its_layer_and_keeps_the_base_frozen():
    """The placements (the distributed test checks the numbers, which DTensor would keep
    right under any placement, at the price of extra collectives): under a column-parallel
    layer B by output rows and A whole, under a row-parallel one A by input columns and B
    whole. SequenceParallel re-creates the norms as parameters that train: put back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from duoka.parallel.parallelize import apply_tensor_parallel

    model = build_model(FLAVORS["debug"], device="cpu", lora=LoRAArgs(rank=4, alpha=8))
    trains = {n: p.requires_grad for n, p in model.named_parameters()}
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,)))
        params = dict(model.named_parameters())
        assert {n: p.requires_grad for n, p in params.items()} == trains
        column, row = [Shard(0), Replicate(), Shard(0)], [Shard(1), Shard(1), Replicate()]  # W, A, B
        for layer, placements in {"attention.wq": column, "attention.wo": row, "feed_forward.w1": column,
                                  "feed_forward.w2": row}.items():
            names = [f"layers.0.{layer}.{n}" for n in ("weight", "lora_a.weight", "lora_b.weight")]
            assert [params[n].placements[0] for n in names] == placements, layer
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ checkpoints and measurements


def test_resume_refuses_another_base_or_other_lora_settings(tmp_path, hf_folder):
    _, folder = hf_folder()
    args = FLAVORS["debug"]
    lora = LoRAArgs(rank=8, alpha=16)
    base = adapters.base_identity(folder, args, seed=0)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert adapters.base_identity(copy, args, seed=0)["fingerprint"] == base["fingerprint"]  # moved, same base

    def state(rank=8, alpha=0.0, dropout=0.0, base=base):
        return {"config": {"lora": {"rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": "all-linear",
                                    "modules_to_save": ""}}, "base": base}

    adapters.check_resume(tmp_path, state(dropout=0.1), lora, base)  # dropout changes no parameter
    with pytest.raises(DuokaError, match="rank 4, alpha 8"):
        adapters.check_resume(tmp_path, state(rank=4), lora, base)
    with pytest.raises(DuokaError, match="whole model trained without LoRA"):
        adapters.check_resume(tmp_path, state(rank=0), lora, base)
    with pytest.raises(DuokaError, match="this run has LoRA off"):
        adapters.check_resume(tmp_path, state(), None, None)
    adapters.check_resume(tmp_path, state(rank=0), None, None)  # neither: nothing to check

    # Other weights of the same shape: another fingerprint.
    from safetensors.torch import load_file, save_file

    weights = load_file(copy / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in weights.items()}, copy / "model.safetensors", metadata={"format": "pt"})
    other = adapters.base_identity(copy, args, seed=0)
    with pytest.raises(DuokaError) as e:
        adapters.check_resume(tmp_path, state(), lora, other)
    assert f"the base in {folder}" in e.value.cause and f"model.path={folder}" in e.value.fix
    random = adapters.base_identity(None, args, seed=0)
    with pytest.raises(DuokaError) as e:
        adapters.check_resume(tmp_path, state(base=random), lora, adapters.base_identity(None, args, seed=1))
    assert "training.seed=0" in e.value.fix


def test_flops_count_a_frozen_weight_at_4_per_token_and_a_trained_one_at_6():
    args = FLAVORS["qwen2-7b"]
    lora = LoRAArgs(rank=16, alpha=32)
    assert args.adapter_params(lora) == 40_370_176  # what PEFT reports for Qwen2-7B, r=16, all-linear
    n, seq = args.matmul_params(), 2048
    attention = args.flops_per_token(seq) - 6 * n
    assert args.flops_per_token(seq, lora) == 4 * n + 6 * 40_370_176 + attention
    head = args.vocab_size * args.dim
    with_head = LoRAArgs(rank=16, alpha=32, modules_to_save=("lm_head",))
    assert args.flops_per_token(seq, with_head) == args.flops_per_token(seq, lora) + 2 * head
