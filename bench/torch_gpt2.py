"""PyTorch peer of the WebGPU GPT-2 benchmark (bench/): same architecture, timed the same way.

Why: gives the WebGPU engine's tokens/s a reference point on the same GPU. The model is defined here
in plain PyTorch (nanoGPT style, no downloads): tied LM head over the padded vocabulary 50304, GELU
(tanh), bias=True, LayerNorm eps 1e-5, dropout 0, fp32 eager. Training mode times full AdamW steps
(forward, backward, clip_grad_norm_(1.0), step, zero_grad); --generate times greedy decoding with a
KV cache (batch 1, reading each token back with .item()) and the time to first token. Prints one
JSON line.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {"gpt2-124M": (12, 12, 768), "gpt2-345M": (24, 16, 1024)}  # n_layer, n_head, n_embd
VOCAB, PADDED_VOCAB, N_POSITIONS = 50257, 50304, 1024


class Block(nn.Module):
    def __init__(self, n_head, C):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.c_fc = nn.Linear(C, 4 * C)
        self.mlp_proj = nn.Linear(4 * C, C)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # cache: [k, v] of the previous positions, or [None, None]
            if cache[0] is not None:
                k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            cache[0], cache[1] = k, v
        # causal within the new positions; a single new query attends to every cached position
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, C):
        super().__init__()
        self.wte = nn.Embedding(PADDED_VOCAB, C)
        self.wpe = nn.Embedding(N_POSITIONS, C)
        self.h = nn.ModuleList(Block(n_head, C) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(C, eps=1e-5)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        with torch.no_grad():
            self.wte.weight[VOCAB:].zero_()

    def forward(self, idx, targets=None, caches=None, pos0=0):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(pos0, pos0 + T, device=idx.device))
        for i, block in enumerate(self.h):
            x = block(x, None if caches is None else caches[i])
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head over the padded vocabulary
        if targets is None:
            return logits
        # the softmax runs over the real vocabulary only, as in the WebGPU engine
        return F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), targets.reshape(-1))


def sync():
    torch.cuda.synchronize()


def train(args, model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    x = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device="cuda")
    inp, tgt = x[:, :-1], x[:, 1:]

    def step():
        loss = model(inp, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        loss = step()
    end.record()
    sync()
    ms = start.elapsed_time(end) / args.steps
    return {"ms_per_step": ms, "tokens_per_s": args.batch * args.seq / (ms / 1000), "loss": loss.item()}


@torch.no_grad()
def generate(args, model):
    model.eval()

    def decode(prompt_len, new_tokens):
        caches = [[None, None] for _ in model.h]
        idx = torch.randint(0, VOCAB, (1, prompt_len), device="cuda")
        sync()
        t0 = time.perf_counter()
        logits = model(idx, caches=caches)
        tok = int(logits[0, -1, :VOCAB].argmax().item())
        ttft = time.perf_counter() - t0
        pos = prompt_len
        t1 = time.perf_counter()
        for _ in range(new_tokens - 1):
            logits = model(torch.tensor([[tok]], device="cuda"), caches=caches, pos0=pos)
            tok = int(logits[0, -1, :VOCAB].argmax().item())
            pos += 1
        return ttft, time.perf_counter() - t1

    for _ in range(args.warmup):
        decode(32, 16)
    ttft_32, rest = decode(32, args.new_tokens)
    ttft_512, _ = decode(512, 1)
    return {
        "tokens_per_s": (args.new_tokens - 1) / rest,
        "ms_per_token": rest * 1000 / (args.new_tokens - 1),
        "ttft_ms_prompt32": ttft_32 * 1000,
        "ttft_ms_prompt512": ttft_512 * 1000,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpt2-124M")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (default: strict fp32)")
    ap.add_argument("--generate", action="store_true", help="time greedy KV-cache decoding instead")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA is not available")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.manual_seed(0)
    model = GPT(*PRESETS[args.model]).cuda()
    result = generate(args, model) if args.generate else train(args, model)
    mode = "generate" if args.generate else "train"
    print(json.dumps({"model": args.model, "mode": mode, "tf32": args.tf32, **result}))


if __name__ == "__main__":
    main()
