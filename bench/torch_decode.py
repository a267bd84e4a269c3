"""PyTorch CUDA-graph decode peer of the generation benchmark (bench/generate_bench.ts).

Why: the strongest simple PyTorch baseline for batched decoding on the same GPU. The GPT-2 model is
written here (nanoGPT style, no downloads; tied LM head over the padded vocabulary 50304, GELU tanh,
LayerNorm eps 1e-5; fp32 with TF32 off, or with --dtype bf16 weights, activations and KV cache in
bfloat16 as a PyTorch user who serves would run it, the sampling's softmax in fp32). The KV cache is static (B, H, 1024, D) per layer; one
decode step for the whole batch (embed at each row's position, write the cache with index_copy_,
masked attention over the full cache, LM head, sampling with torch.multinomial at temperature 0.8
and top-k 40) is captured once with torch.cuda.graph and replayed; tokens stay on
the GPU and are read back once at the end. Prints one JSON line per batch size:
{"model", "dtype", "batch", "new_tokens", "tokens_per_s", "step_ms"}.

  python3 bench/torch_decode.py --model gpt2-124M --batches 1,16,64 --new-tokens 128 [--dtype fp32|bf16]
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

PRESETS = {"gpt2-124M": (12, 12, 768), "gpt2-345M": (24, 16, 1024)}  # n_layer, n_head, n_embd
VOCAB, PADDED_VOCAB, T_MAX = 50257, 50304, 1024


def params(L, C, dev, dtype):
    g = torch.Generator(device="cpu").manual_seed(1)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(dev, dtype)
    z = lambda *s: torch.zeros(*s, device=dev, dtype=dtype)
    o = lambda *s: torch.ones(*s, device=dev, dtype=dtype)
    p = {"wte": r(PADDED_VOCAB, C), "wpe": r(T_MAX, C), "lnf_w": o(C), "lnf_b": z(C)}
    p["layers"] = [
        {
            "ln1_w": o(C), "ln1_b": z(C), "attn_w": r(C, 3 * C), "attn_b": z(3 * C),
            "proj_w": r(C, C), "proj_b": z(C), "ln2_w": o(C), "ln2_b": z(C),
            "fc_w": r(C, 4 * C), "fc_b": z(4 * C), "fcproj_w": r(4 * C, C), "fcproj_b": z(C),
        }
        for _ in range(L)
    ]
    return p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-124M", choices=list(PRESETS))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    L, H, C = PRESETS[a.model]
    D = C // H
    p = params(L, C, dev, dtype)
    for B in [int(b) for b in a.batches.split(",")]:
        kc = [torch.zeros(B, H, T_MAX, D, device=dev, dtype=dtype) for _ in range(L)]
        vc = [torch.zeros(B, H, T_MAX, D, device=dev, dtype=dtype) for _ in range(L)]
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.full((B,), a.prompt, dtype=torch.long, device=dev)
        ar = torch.arange(T_MAX, device=dev)
        torch.manual_seed(0)  # the default CUDA generator is graph-safe

        def step():
            x = p["wte"][tok] + p["wpe"][pos]  # (B, C)
            mask = (ar[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, T)
            for l, w in enumerate(p["layers"]):
                h = F.layer_norm(x, (C,), w["ln1_w"], w["ln1_b"], 1e-5)
                q, k, v = (h @ w["attn_w"] + w["attn_b"]).split(C, dim=1)
                q, k, v = (t.view(B, H, 1, D) for t in (q, k, v))
                # Write this token's key and value at each row's position.
                idx = pos.view(B, 1, 1, 1).expand(B, H, 1, D)
                kc[l].scatter_(2, idx, k)
                vc[l].scatter_(2, idx, v)
                att = (q @ kc[l].transpose(-1, -2)) / math.sqrt(D)  # (B, H, 1, T)
                att = att.masked_fill(~mask, float("-inf")).softmax(-1)
                y = (att @ vc[l]).reshape(B, C)
                x = x + y @ w["proj_w"] + w["proj_b"]
                h = F.layer_norm(x, (C,), w["ln2_w"], w["ln2_b"], 1e-5)
                x = x + F.gelu(h @ w["fc_w"] + w["fc_b"], approximate="tanh") @ w["fcproj_w"] + w["fcproj_b"]
            x = F.layer_norm(x, (C,), p["lnf_w"], p["lnf_b"], 1e-5)
            logits = (x @ p["wte"].t())[:, :VOCAB].float() / 0.8
            top, ids = logits.topk(40, dim=-1)
            pick = torch.multinomial(top.softmax(-1), 1).squeeze(1)
            tok.copy_(ids.gather(1, pick[:, None]).squeeze(1))
            pos.add_(1).clamp_(max=T_MAX - 1)
            return tok

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out = torch.zeros(a.new_tokens, B, dtype=torch.long, device=dev)
        for _ in range(5):
            graph.replay()
        pos.fill_(a.prompt)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(a.new_tokens):
            graph.replay()
            out[i].copy_(tok)
        out.cpu()
        ms = (time.perf_counter() - t0) * 1000
        print(json.dumps({
            "model": a.model, "dtype": a.dtype, "batch": B, "new_tokens": a.new_tokens,
            "tokens_per_s": B * a.new_tokens / (ms / 1000), "step_ms": ms / a.new_tokens,
        }), flush=True)


if __name__ == "__main__":
    main()
