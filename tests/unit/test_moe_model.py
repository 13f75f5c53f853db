"""duoka's Qwen2-MoE against transformers' Qwen2MoeForCausalLM on tiny random configs (fp32, CPU):
logits, the loss with the router's load-balancing term, gradients, greedy decoding and
checkpoints both ways; the grouped-GEMM and per-expert-loop paths against a per-token
dense reference; init and routing statistics."""

import pytest
import torch
import torch.nn.functional as F

from duoka.errors import DuokaError
from duoka.models.loss import IGNORE_INDEX
from duoka.models.qwen2.args import FLAVORS, ModelArgs, ModelOptions, from_hf_config, to_hf_config
from duoka.models.qwen2.hf_adapter import hf_to_duoka, load_hf_model, save_hf_checkpoint
from duoka.models.qwen2.model import FeedForward, StageSlice, build_model, materialize
from duoka.models.qwen2.moe import GroupedExperts, Routing, load_balancing_loss, route, routed_experts
from duoka.models.qwen2.rope import rope_cos_sin

VOCAB = 97
# Both router normalisations; dense layers chosen both ways transformers allows: every other
# layer (decoder_sparse_step) or by index (mlp_only_layers).
CONFIGS = {
    "topk-raw-sparse-step-2": {"norm_topk_prob": False, "decoder_sparse_step": 2, "num_hidden_layers": 4,
                               "tie_word_embeddings": False},
    "topk-normalised-mlp-only-0": {"norm_topk_prob": True, "mlp_only_layers": [0], "num_hidden_layers": 3,
                                   "tie_word_embeddings": True},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tiny eager models run many times faster on one thread than on threads fighting
    over shared cores (as in test_optimizers.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_moe_config(**overrides):
    from transformers import Qwen2MoeConfig

    base = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "output_router_logits": True, "router_aux_loss_coef": 0.05,
            "attn_implementation": "sdpa",
            "experts_implementation": "eager"}  # transformers' loop over experts: the plainest reference
    return Qwen2MoeConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """hf_moe(name) -> (transformers model, its folder), made once per module: every parameter
    moved away from its init (zero biases, unit norms and a zero router would hide bugs)."""
    from transformers import Qwen2MoeForCausalLM

    made = {}

    def make(name):
        if name not in made:
            torch.manual_seed(0)
            model = Qwen2MoeForCausalLM(hf_moe_config(**CONFIGS[name])).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            made[name] = model, folder
        return made[name]

    return make


def tokens(batch=2, seq=13, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def shifted(t):
    """transformers' causal-LM labels (the inputs, shifted inside its loss) as duoka's targets."""
    return torch.cat([t[:, 1:], torch.full((t.shape[0], 1), IGNORE_INDEX)], dim=1)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(hf_moe, name, gemm):
    hf, folder = hf_moe(name)
    ours, _ = load_hf_model(folder, options=ModelOptions(moe_gemm=gemm))
    assert ours.args.moe_layers == tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate"))
    t = tokens()
    with torch.no_grad():
        assert (ours(t) - hf(t).logits).abs().max().item() <= 1e-5

    # The loss with the load-balancing term (output_router_logits) and its gradients.
    hf.zero_grad()
    out = hf(input_ids=t, labels=t)
    out.loss.backward()
    targets = shifted(t)
    loss = ours(t, labels=targets) / (targets != IGNORE_INDEX).sum()
    loss.backward()
    assert out.aux_loss.item() > 1.0  # E x sum(f * P) >= 1: the term is really there
    assert abs(loss.item() - out.loss.item()) <= 1e-5

    mine = dict(ours.named_parameters())
    layer = ours.args.moe_layers[-1]
    theirs = dict(hf.named_parameters())
    hidden = ours.args.moe_intermediate_size
    gate_up = theirs[f"model.layers.{layer}.mlp.experts.gate_up_proj"].grad  # [E, 2 x hidden, dim]
    pairs = {
        "router": (mine[f"layers.{layer}.feed_forward.router.weight"].grad,
                   theirs[f"model.layers.{layer}.mlp.gate.weight"].grad),
        "expert gate_proj": (mine[f"layers.{layer}.feed_forward.experts.w1"].grad, gate_up[:, :hidden]),
        "expert up_proj": (mine[f"layers.{layer}.feed_forward.experts.w3"].grad, gate_up[:, hidden:]),
        "expert down_proj": (mine[f"layers.{layer}.feed_forward.experts.w2"].grad,
                             theirs[f"model.layers.{layer}.mlp.experts.down_proj"].grad),
        "shared_expert_gate": (mine[f"layers.{layer}.feed_forward.shared_expert_gate.weight"].grad,
                               theirs[f"model.layers.{layer}.mlp.shared_expert_gate.weight"].grad),
        "shared_expert": (mine[f"layers.{layer}.feed_forward.shared_expert.w2.weight"].grad,
                          theirs[f"model.layers.{layer}.mlp.shared_expert.down_proj.weight"].grad),
        "embedding": (mine["tok_embeddings.weight"].grad, theirs["model.embed_tokens.weight"].grad),
    }
    for what, (a, b) in pairs.items():
        assert (a - b).abs().max().item() <= 1e-5 and rel_err(a, b) <= 1e-5, what


def test_logits_with_router_aux_give_the_same_loss(hf_moe):
    """The unfused path (logits and the router's term, the trainer's cross-entropy) = the fused one."""
    _, folder = hf_moe("topk-raw-sparse-step-2")
    ours, _ = load_hf_model(folder)
    t, targets = tokens(), shifted(tokens())
    logits, aux = ours(t, with_router_aux=True)
    unfused = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") + aux * (targets >= 0).sum()
    assert aux.item() > 0
    assert torch.allclose(unfused, ours(t, labels=targets), rtol=1e-6)


def test_inference_mode_makes_no_routing_statistics(hf_moe):
    """Serving runs in inference mode, where nothing reads the routing statistics: the layers
    make none and the recorder keeps no load, with the same logits as a no-grad forward (whose
    statistics, as in training, are recorded)."""
    _, folder = hf_moe("topk-raw-sparse-step-2")
    ours, _ = load_hf_model(folder)
    t = tokens()
    with torch.no_grad():
        want = ours(t)
    assert set(ours.routing.load) == {1, 3} and ours.routing.take_totals()  # the sparse layers
    ours.routing.load = {}
    x, rope = torch.randn(1, 5, 32), rope_cos_sin(torch.arange(5)[None], 8, 10000.0, torch.float32)
    with torch.inference_mode():  # (compiled, the one-token path: test_moe_gemv.py)
        got = ours(t)
        _, stats = ours.layers["1"]._block(x, rope, None, False)
    assert torch.equal(got, want) and stats is None
    assert ours.routing.load == {} and ours.routing.take_totals() == {}


def test_greedy_generation_matches_transformers(hf_moe):
    hf, folder = hf_moe("topk-normalised-mlp-only-0")
    ours, _ = load_hf_model(folder)
    prompt = tokens(batch=1, seq=6, seed=3)
    expected = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           pad_token_id=0, eos_token_id=None)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, ours(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert seq.tolist() == expected.tolist()
    assert len(set(seq[0, 6:].tolist())) > 2  # a real continuation, not one token repeated


def test_the_serving_engine_decodes_as_transformers(hf_moe, tmp_path):
    """duoka's engine (paged KV cache, continuous batching, packed projections) on a MoE folder:
    greedy tokens of two requests batched together equal transformers' generate."""
    import shutil

    from duoka.hub import bundled_model_dir
    from duoka.serve.engine import LLM
    from duoka.serve.params import SamplingParams

    hf, folder = hf_moe("topk-normalised-mlp-only-0")
    served = tmp_path / "served"
    shutil.copytree(folder, served)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer: the prompts are token ids
        shutil.copy(bundled_model_dir() / name, served / name)
    prompts = [tokens(batch=1, seq=6, seed=3)[0].tolist(), tokens(batch=1, seq=9, seed=4)[0].tolist()]
    outs = LLM(str(served), device="cpu", max_model_len=64, log=lambda m: None).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                               pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert out.token_ids == expected


def test_checkpoints_round_trip_through_transformers(hf_moe, tmp_path):
    from transformers import Qwen2MoeForCausalLM

    hf, folder = hf_moe("topk-raw-sparse-step-2")
    ours, _ = load_hf_model(folder)
    assert from_hf_config(to_hf_config(ours.args)) == ours.args
    out = save_hf_checkpoint(ours, tmp_path / "one")
    back = Qwen2MoeForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    # Against transformers' own load of the original folder: since transformers 5.25 a loaded
    # model's logits differ from the in-memory one it was saved from by ~5e-7, weights equal.
    source = Qwen2MoeForCausalLM.from_pretrained(folder, experts_implementation="eager").eval()
    t = tokens()
    with torch.no_grad():
        assert torch.equal(back(t).logits, source(t).logits)
        assert (back(t).logits - hf(t).logits).abs().max().item() <= 1e-5
    assert back.config.num_experts == 4 and back.config.decoder_sparse_step == 2

    sharded = save_hf_checkpoint(ours, tmp_path / "sharded", max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    again, _ = load_hf_model(sharded)
    # Serving's packed projections (the shared expert's gate and up in one weight) load too.
    packed, _ = load_hf_model(sharded, options=ModelOptions(packed_projections=True))
    assert packed.layers["1"].feed_forward.shared_expert.w13.weight.shape == (80, 32)
    with torch.no_grad():
        assert torch.equal(again(t), ours(t))
        assert (packed(t) - ours(t)).abs().max().item() <= 1e-5
    assert hf_to_duoka("model.layers.1.mlp.experts.3.up_proj.weight") == "layers.1.feed_forward.experts.w3"


def _dense_reference(x, routing: Routing, experts: GroupedExperts):
    """Token by token: sum over its k experts of weight x SwiGLU of that expert."""
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(x.shape[1], dtype=x.dtype)
        for w, e in zip(routing.weights[t], routing.experts[t]):
            h = F.silu(experts.w1[e] @ x[t]) * (experts.w3[e] @ x[t])
            row = row + w * (experts.w2[e] @ h)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_grouped_gemm_and_loop_equal_a_per_token_reference(norm_topk_prob):
    gen = torch.Generator().manual_seed(0)
    dim, hidden, n_experts, top_k, n_tokens = 16, 24, 5, 2, 29
    router = torch.randn(n_experts, dim, generator=gen)
    router[4] = -10 * router.abs().sum(0)  # expert 4 is never chosen for positive inputs: an empty group
    x = torch.rand(n_tokens, dim, generator=gen)
    routing = route(x, router, top_k, norm_topk_prob)
    assert 4 not in routing.experts.tolist()
    weights = [torch.randn(shape, generator=gen) * 0.3
               for shape in ((n_experts, hidden, dim), (n_experts, hidden, dim), (n_experts, dim, hidden))]
    results = {}
    for gemm in ("grouped", "loop"):
        experts = GroupedExperts(n_experts, dim, hidden, gemm)
        with torch.no_grad():
            for p, w in zip((experts.w1, experts.w3, experts.w2), weights):
                p.copy_(w)
        xs = x.clone().requires_grad_(True)
        out, counts = routed_experts(xs, routing, experts)
        out.square().sum().backward()
        results[gemm] = out, xs.grad, experts.w1.grad, experts.w2.grad
        assert counts.tolist() == torch.bincount(routing.experts.flatten(), minlength=n_experts).tolist()
        assert (out - _dense_reference(x, routing, experts)).abs().max().item() <= 1e-5
    for a, b in zip(results["grouped"], results["loop"]):
        assert (a - b).abs().max().item() <= 1e-5
    assert results["grouped"][2][4].abs().max() == 0  # the empty expert gets no gradient


def test_load_balancing_loss_is_transformers(hf_moe):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    _, folder = hf_moe("topk-raw-sparse-step-2")
    ours, _ = load_hf_model(folder)
    t = tokens()
    h = ours.tok_embeddings(t)
    stats, logits = [], []
    for layer in ours.args.moe_layers:  # the routing of random inputs is enough here
        x = h.reshape(-1, h.shape[-1]) + layer
        moe = ours.layers[str(layer)].feed_forward
        r = route(x, moe.router.weight, moe.top_k, moe.norm_topk_prob)
        logits.append(r.logits)
        _, stat = moe(x[None])
        stats.append(stat)
    expected = load_balancing_loss_func(tuple(logits), 4, 2)
    assert abs(load_balancing_loss(stats, 4).item() - expected.item()) <= 1e-6


def test_init_is_a_function_of_the_name_and_covers_the_experts():
    args = FLAVORS["qwen2-moe-tiny"]
    whole = materialize(build_model(args), "cpu")
    whole.init_weights(seed=3)
    stage = materialize(build_model(args, stage=StageSlice(2, 4, first=False, last=True)), "cpu")
    stage.init_weights(seed=3)
    mine = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, mine[name]), name
    experts = whole.layers["1"].feed_forward.experts
    assert experts.w1.shape == (8, 64, 128) and experts.w2.shape == (8, 128, 64)
    for name in ("layers.1.feed_forward.experts.w1", "layers.1.feed_forward.router.weight",
                 "layers.1.feed_forward.shared_expert_gate.weight", "layers.3.feed_forward.experts.w2"):
        assert abs(mine[name].std().item() - args.initializer_range) < 0.004, name
    assert not torch.equal(experts.w1[0], experts.w1[1])
    assert isinstance(whole.layers["0"].feed_forward, FeedForward) and not whole.layers["0"].sparse


def test_training_steps_lower_the_loss_and_record_the_load():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    args = FLAVORS["qwen2-moe-tiny"].replace(n_layers=3, vocab_size=512)
    model = materialize(build_model(args), "cpu")
    model.init_weights(seed=0)
    t = torch.randint(0, args.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    targets = shifted(t)
    n = (targets != IGNORE_INDEX).sum()
    # Activation checkpointing recomputes the blocks during backward: the same gradients, and
    # the recompute's routing is not recorded (nothing is held after the step).
    plain = model(t, labels=targets) / n
    plain.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    (model(t, labels=targets) / n).backward()
    assert not model.routing.stats and not model.routing.open
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[name.replace("_checkpoint_wrapped_module.", "")], atol=1e-6), name

    load = model.expert_load()
    assert sorted(load) == [1, 2] and all(abs(v.sum().item() - 1) < 1e-6 for v in load.values())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = model(t, labels=targets) / n
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("changes, field", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"mlp_only_layers": (0, 7)}, "mlp_only_layers"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_bad_moe_arguments_are_refused_naming_the_field(changes, field):
    with pytest.raises(DuokaError) as e:
        FLAVORS["qwen2-moe-tiny"].replace(**changes)
    assert field in e.value.cause and e.value.fix


def test_moe_config_json_is_read_and_refusals_name_the_field():
    cfg = hf_moe_config(mlp_only_layers=[1]).to_dict()
    args = from_hf_config(cfg)
    assert (args.num_experts, args.num_experts_per_tok, args.moe_intermediate_size) == (4, 2, 24)
    assert args.mlp_only_layers == (1,) and args.moe_layers == (0, 2) and args.router_aux_loss
    assert ModelArgs(**{**args.__dict__, "mlp_only_layers": [1]}) == args  # a list read back from JSON
    for changes, field in (({"qkv_bias": False}, "qkv_bias"), ({"num_experts": 0}, "num_experts"),
                           ({"architectures": ["Qwen2ForCausalLM"]}, "architectures")):
        with pytest.raises(DuokaError) as e:
            from_hf_config({**cfg, **changes})
        assert field in e.value.cause and e.value.fix
    del cfg["moe_intermediate_size"]
    with pytest.raises(DuokaError, match="moe_intermediate_size is missing"):
        from_hf_config(cfg)


@pytest.mark.parametrize("override, refused", [
    ("--parallel.tp=2", "parallel.tp=2"), ("--parallel.pp=2", "parallel.pp=2"), ("--lora.rank=8", "LoRA"),
])
def test_training_layouts_not_supported_yet_are_refused(override, refused):
    from duoka.config import load_config
    from duoka.parallel.dims import ParallelDims
    from duoka.train.spec import check_moe_layout

    cfg = load_config(None, ["--model.flavor=qwen2-moe-tiny", override])
    with pytest.raises(DuokaError) as e:
        check_moe_layout(cfg, ParallelDims.from_config(cfg.parallel, 2), FLAVORS["qwen2-moe-tiny"])
    assert refused in e.value.cause and "mixture-of-experts" in e.value.cause and e.value.fix
    plain = load_config(None, ["--model.flavor=qwen2-moe-tiny"])
    check_moe_layout(plain, ParallelDims.from_config(plain.parallel, 2), FLAVORS["qwen2-moe-tiny"])  # FSDP2: fine
