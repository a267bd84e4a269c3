"""PyTorch peer of the attention benchmark (bench/attention_bench.ts): causal scaled-dot-product
attention of GPT-2 124M and 345M (B = 8, T = 1024, D = 64, H = 12 / 16) forward and backward in
fp32, timed with CUDA events (median of --reps after warmup), for each SDPA backend that runs fp32
(memory-efficient, math) and the default dispatch, with TF32 off (as the fp32 training peer) and on.

Why: issue 38's attention backward target (30 TFLOP/s) is a figure of ours; this says what PyTorch's
own fp32 attention reaches on the same GPU in the same call. TFLOP/s count useful work once, as
attention_bench.ts does (FlashAttention-2 style): forward 2 products over the causal half
(4·B·H·D·T(T+1)/2), backward 2.5 times that. Prints one JSON line per (model, backend, tf32).
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS = {"gpt2-124M": 12, "gpt2-345M": 16}
BACKENDS = {
    "default": None,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def measure(model, backend, tf32, reps, B=8, T=1024, D=64):
    H = HEADS[model]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, H, T, D, device="cuda", generator=g)
    ctx = sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else torch.enable_grad()
    with ctx:
        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def bwd():
            torch.autograd.grad(y, (q, k, v), dy, retain_graph=True)

        for _ in range(3):
            fwd()
            bwd()
        torch.cuda.synchronize()
        f_ms, b_ms = median_ms(fwd, reps), median_ms(bwd, reps)
    flops = 4 * B * H * D * T * (T + 1) / 2
    return {
        "model": model,
        "backend": backend,
        "tf32": tf32,
        "forward_ms": round(f_ms, 4),
        "backward_ms": round(b_ms, 4),
        "forward_tflops": round(flops / f_ms / 1e9, 2),
        "backward_tflops": round(2.5 * flops / b_ms / 1e9, 2),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-124M,gpt2-345M")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    for model in args.models.split(","):
        for tf32 in (False, True):
            for backend in BACKENDS:
                try:
                    print(json.dumps(measure(model, backend, tf32, args.reps)), flush=True)
                except Exception as e:  # a backend that refuses fp32 or this shape
                    print(json.dumps({"model": model, "backend": backend, "tf32": tf32, "error": str(e)[:200]}),
                          flush=True)
