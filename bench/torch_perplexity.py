"""transformers' peer of the sliding-window perplexity (issue 28): the same token ids, the same model.

Why: `POST /evaluate` / `deno task eval` must give the perplexity transformers gives by its documented
recipe ("Perplexity of fixed-length models", https://huggingface.co/docs/transformers/perplexity),
within 1e-3 relative. This script runs that recipe verbatim (windows of `max_length` tokens advancing by
`stride`, labels -100 before the last trg_len, each window's mean loss weighted by its
valid labels minus the batch size) on token ids read from a raw little-endian uint16 file (our dataset
split, so both sides see identical ids; no tokenizer download is needed). It also computes
- `exact`: the same windows, each scored token counted once (the recipe's weighting counts one token
  fewer per window; this is the definition our engine implements with seq_len = max_length - 1), and
- `ours_seq_len`: our definition at seq_len = max_length, windows of max_length + 1 tokens (the last is a
  target only), computed from the logits, to compare with `deno task eval --seq-len max_length`.
`--resave DIR` first loads `--model` with transformers and writes it back with save_pretrained (a
transformers-saved GPT-2). fp32, TF32 off. Prints one JSON line.
"""
import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face GPT-2 folder")
    ap.add_argument("--tokens", required=True, help="raw uint16 token ids")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--resave", help="write the model back with save_pretrained to this folder first")
    args = ap.parse_args()

    from transformers import GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT2LMHeadModel.from_pretrained(args.model).float()
    if args.resave:
        model.save_pretrained(args.resave)  # safetensors, float32
    model = model.to(device).eval()
    ids = torch.from_numpy(np.fromfile(args.tokens, dtype=np.uint16).astype(np.int64)).unsqueeze(0).to(device)
    seq_len = ids.size(1)
    L, stride = args.max_length, args.stride

    # The documented recipe, verbatim.
    torch.cuda.synchronize() if device == "cuda" else None
    t0 = time.perf_counter()
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    exact_sum, exact_tokens = 0.0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + L, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            outputs = model(input_ids, labels=target_ids)
            neg_log_likelihood = outputs.loss
            # The same window, every scored token counted once (labels shifted inside the model).
            logits = outputs.logits[0, :-1].float()
            labels = target_ids[0, 1:]
            per = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
            valid = labels != -100
            exact_sum += per[valid].double().sum().item()
            exact_tokens += int(valid.sum().item())
        num_valid_tokens = (target_ids != -100).sum().item()
        batch_size = target_ids.size(0)
        num_loss_tokens = num_valid_tokens - batch_size
        nll_sum += neg_log_likelihood.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    torch.cuda.synchronize() if device == "cuda" else None
    recipe_s = time.perf_counter() - t0
    avg_nll = nll_sum / n_tokens

    # Our definition at seq_len = L: window w is tokens [w·stride, w·stride + L] (L inputs, L targets);
    # it scores the targets no earlier window scored.
    ours_sum, ours_tokens, scored, start = 0.0, 0, 0, 0
    while scored < seq_len - 1:
        end = min(L, seq_len - 1 - start)
        first = scored - start
        with torch.no_grad():
            logits = model(ids[:, start:start + end]).logits[0].float()
        per = F.cross_entropy(logits, ids[0, start + 1:start + end + 1], reduction="none")
        ours_sum += per[first:end].double().sum().item()
        ours_tokens += end - first
        scored = start + end
        start += stride

    print(json.dumps({
        "model": args.model,
        "tokens_in_stream": seq_len,
        "max_length": L,
        "stride": stride,
        "recipe": {"loss": avg_nll, "perplexity": math.exp(avg_nll), "n_tokens": n_tokens, "seconds": recipe_s,
                   "tokens_per_s": n_tokens / recipe_s},
        "exact": {"loss": exact_sum / exact_tokens, "perplexity": math.exp(exact_sum / exact_tokens),
                  "tokens": exact_tokens, "seq_len": L - 1},
        "ours_seq_len": {"loss": ours_sum / ours_tokens, "perplexity": math.exp(ours_sum / ours_tokens),
                         "tokens": ours_tokens, "seq_len": L},
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
