"""Does a compiled function honour the SDPA kernel choice? (bench/NOTES.md section 16)

    python bench/sdpa_compile_check.py

Causal GQA attention (1.5B's heads, 2 x 2048 tokens), forward + backward, profiled; prints
the attention kernels that ran. The same function is compiled under PyTorch's
process-wide switches set to flash only, then (after torch._dynamo.reset()) to cuDNN
only; then with the choice made inside the function by sdpa_kernel(), as duoka's model
does (Attention.sdpa_backend). Run it in a fresh process: the compile caches persist.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile


def attention_kernels(fn, *args) -> list[str]:
    fn(*args).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args).sum().backward()
        torch.cuda.synchronize()
    words = ("flash", "fmha", "sdpa", "cudnn", "attention", "efficient")
    return sorted({e.key[:70] for e in prof.key_averages() if any(w in e.key.lower() for w in words)})


def switches(backend: SDPBackend) -> None:
    torch.backends.cuda.enable_flash_sdp(backend == SDPBackend.FLASH_ATTENTION)
    torch.backends.cuda.enable_cudnn_sdp(backend == SDPBackend.CUDNN_ATTENTION)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_math_sdp(False)


def plain(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def chosen(backend):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return fn


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, 2048, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for h in (12, 2, 2))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        switches(backend)
        torch._dynamo.reset()
        print(f"switches {backend.name}, compiled: {attention_kernels(torch.compile(plain), q, k, v)}")
    switches(SDPBackend.FLASH_ATTENTION)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        torch._dynamo.reset()
        print(f"sdpa_kernel({backend.name}) inside, compiled: "
              f"{attention_kernels(torch.compile(chosen(backend)), q, k, v)}")


if __name__ == "__main__":
    main()
