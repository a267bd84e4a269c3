"""transformers' side of the f16 LM-head decision (issue 38, bench/lmhead_f16_probe.ts --torch).

Issue 38 lets the decode LM head read wte rounded to f16 by default only if a trained 124M
checkpoint's greedy tokens agree with fp32 decode and with transformers, and asks how often (top-1
agreement per position). Greedy sequences diverge for good after one near-tie, so besides the first
divergence this script scores every position teacher-forced: the model reads prompt + a sequence our
engine decoded, and at each position we compare

- `hf_vs_ours_f32`: transformers' top-1 (fp32 head) with the token our fp32 decode chose there;
- `f16_vs_f32_head`: the top-1 of the same hidden state through wte rounded to f16 (what our f16 head
  computes: f16 weights, f32 sums) with the fp32 head's top-1;
- `hf16_vs_ours_f16`: that f16-head top-1 on the sequence our f16 decode produced with the token it chose.

Also transformers' own greedy decode (`generate`, do_sample False) and where it first departs from each
of ours. fp32, TF32 off. Input: a JSON file {prompts, f32, f16} of token-id lists. Prints one JSON line.
"""
import argparse
import json

import torch


def first_divergence(a, b):
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face GPT-2 folder")
    ap.add_argument("--input", required=True, help="JSON {prompts, f32, f16}: lists of token-id lists")
    args = ap.parse_args()

    from transformers import GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT2LMHeadModel.from_pretrained(args.model).float().to(device).eval()
    with open(args.input) as f:
        data = json.load(f)
    wte = model.transformer.wte.weight
    wte16 = wte.half().float()

    def heads(ids):
        x = torch.tensor([ids], device=device)
        h = model.transformer(x).last_hidden_state[0]  # after ln_f
        return (h @ wte.T).argmax(-1).tolist(), (h @ wte16.T).argmax(-1).tolist()

    rows = []
    totals = {"hf_vs_ours_f32": [0, 0], "f16_vs_f32_head": [0, 0], "hf16_vs_ours_f16": [0, 0]}
    with torch.no_grad():
        for prompt, ours32, ours16 in zip(data["prompts"], data["f32"], data["f16"]):
            p = len(prompt)
            top32, top16 = heads(prompt + ours32)
            # Position p - 1 + i predicts generated token i.
            n = len(ours32)
            a = sum(top32[p - 1 + i] == ours32[i] for i in range(n))
            b = sum(top16[p - 1 + i] == top32[p - 1 + i] for i in range(n))
            _, top16_own = heads(prompt + ours16)
            m = len(ours16)
            c = sum(top16_own[p - 1 + i] == ours16[i] for i in range(m))
            for key, (k, d) in zip(totals, [(a, n), (b, n), (c, m)]):
                totals[key][0] += k
                totals[key][1] += d
            out = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, p, dtype=torch.long, device=device),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=50256,
            )[0][p:].tolist()
            rows.append({
                "tokens": n,
                "hf_vs_ours_f32": a / max(n, 1),
                "f16_vs_f32_head": b / max(n, 1),
                "hf16_vs_ours_f16": c / max(m, 1),
                "hf_greedy_first_divergence_f32": first_divergence(out, ours32),
                "hf_greedy_first_divergence_f16": first_divergence(out[:m], ours16),
            })
    summary = {k: (v[0] / v[1] if v[1] else None) for k, v in totals.items()}
    print(json.dumps({"peer": "transformers_greedy", "device": device, **summary, "prompts": rows}))


if __name__ == "__main__":
    main()
