"""What torch's varlen attention on this machine can do (paged KV? GQA? causal alignment?)."""
import inspect, sys, torch, math
from torch.nn.attention.varlen import varlen_attn
print("torch", torch.__version__, file=sys.stderr)
sig = inspect.signature(varlen_attn)
print("signature", sig)
try:
    import triton; print("triton", triton.__version__)
except Exception as e:
    print("triton missing", e)
dev = "cuda"
H, KVH, D, bs = 8, 2, 128, 16
ctx = [37, 100, 5]; ql = [5, 1, 5]
nb = 64
kc = torch.randn(nb, bs, KVH, D, device=dev, dtype=torch.bfloat16)
vc = torch.randn(nb, bs, KVH, D, device=dev, dtype=torch.bfloat16)
tables = torch.randperm(nb, device=dev)[:3 * 8].view(3, 8).to(torch.int32)
q = torch.randn(sum(ql), H, D, device=dev, dtype=torch.bfloat16)
cu_q = torch.tensor([0, 5, 6, 11], device=dev, dtype=torch.int32)
ref = []
for b in range(3):
    keys = kc[tables[b].long()].reshape(-1, KVH, D)[:ctx[b]]
    vals = vc[tables[b].long()].reshape(-1, KVH, D)[:ctx[b]]
    qb = q[cu_q[b]:cu_q[b + 1]]
    qpos = torch.arange(ctx[b] - ql[b], ctx[b], device=dev)
    mask = torch.arange(ctx[b], device=dev)[None] <= qpos[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(qb.transpose(0, 1)[None].float(), keys.transpose(0, 1)[None].float(), vals.transpose(0, 1)[None].float(), attn_mask=mask, enable_gqa=True)
    ref.append(o[0].transpose(0, 1))
ref = torch.cat(ref)
params = sig.parameters
kw = {}
if "block_table" in params:
    try:
        out = varlen_attn(q, kc, vc, cu_q, None, 5, 100, window_size=(-1, 0), enable_gqa=True,
                          seqused_k=torch.tensor(ctx, device=dev, dtype=torch.int32), block_table=tables)
        print("paged varlen max err", (out.float() - ref).abs().max().item())
    except Exception as e:
        print("paged varlen failed", type(e).__name__, str(e)[:300])
# gathered contiguous
ks = torch.cat([kc[tables[b].long()].reshape(-1, KVH, D)[:ctx[b]] for b in range(3)])
vs = torch.cat([vc[tables[b].long()].reshape(-1, KVH, D)[:ctx[b]] for b in range(3)])
cu_k = torch.tensor([0, 37, 137, 142], device=dev, dtype=torch.int32)
try:
    if "window_size" in params:
        kw = {"window_size": (-1, 0)}
    else:
        kw = {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    out = varlen_attn(q, ks, vs, cu_q, cu_k, 5, 100, **kw)
    print("gathered varlen max err", (out.float() - ref).abs().max().item())
except Exception as e:
    print("gathered varlen failed", type(e).__name__, str(e)[:300])
