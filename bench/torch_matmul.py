"""PyTorch (cuBLAS) peer of the training matmuls, shape by shape: each of GPT-2 124M's and 345M's
training matmuls at B·T = 8192 rows, in the layout our step runs it (A stored [K, M] for the weight
gradients, B stored [N, K] for the input gradients and the LM head), fp32 with TF32 off, bias added
by `addmm` where ours fuses one. Timed with CUDA events over batches of back-to-back calls (median
of --reps batches after warmup), TFLOP/s = 2·M·N·K / time.

Why: issue 38 asks every training shape of ours to reach 36 TFLOP/s. This says what NVIDIA's own
fp32 GEMM reaches on the same shapes on the same GPU in the same call, the small ones (8192 × 768 ×
768) among them. The last lines give each model's matmuls for one training step at these rates (each
shape's time times its runs a step), to set beside the step's matmul_fwd + matmul_bwd.

The shapes come from our own list: `deno task bench matmul --list-shapes > shapes.json`, then
`python3 bench/torch_matmul.py shapes.json`. Prints one JSON line per shape and a table.
"""
import argparse
import json

import torch


def median_ms(fn, reps, batch):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / batch)
    times.sort()
    return times[len(times) // 2]


def measure(s, reps, batch):
    M, N, K = s["M"], s["N"], s["K"]
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=g)  # noqa: E731
    a = rand(K, M).t() if s["transA"] else rand(M, K)
    b = rand(N, K).t() if s["transB"] else rand(K, N)
    c = torch.empty(M, N, device="cuda")
    if s["bias"]:
        bias = rand(N)
        fn = lambda: torch.addmm(bias, a, b, out=c)  # noqa: E731
    else:
        fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ms = median_ms(fn, reps, batch)
    return ms, 2 * M * N * K / ms / 1e9


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shapes", help="JSON from `deno task bench matmul --list-shapes`")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=10)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shapes = json.load(open(args.shapes))
    print(f"# {torch.cuda.get_device_name()}, PyTorch {torch.__version__}, TF32 off")
    rows = []
    for s in shapes:
        ms, tflops = measure(s, args.reps, args.batch)
        layout = ("T" if s["transA"] else "N") + ("T" if s["transB"] else "N")
        rec = {"model": s["model"], "op": s["op"], "M": s["M"], "N": s["N"], "K": s["K"], "layout": layout,
               "bias": s["bias"], "per_step": s["perStep"], "ms": round(ms, 4), "tflops": round(tflops, 2)}
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    print(f"{'model':10} {'op':13} {'M x N x K':>20} {'layout':6} {'ms':>8} {'TFLOP/s':>8}")
    for r in rows:
        shape = f"{r['M']}x{r['N']}x{r['K']}"
        print(f"{r['model']:10} {r['op']:13} {shape:>20} {r['layout']:6} {r['ms']:8.4f} {r['tflops']:8.2f}")
    # What a training step's matmuls would take at these rates (each shape times its runs a step).
    for model in dict.fromkeys(r["model"] for r in rows):
        total = sum(r["ms"] * r["per_step"] for r in rows if r["model"] == model)
        print(json.dumps({"model": model, "step_matmul_ms": round(total, 2)}))


if __name__ == "__main__":
    main()
