#!/usr/bin/env bash
# Issue 38's H200 measurements, one device call per part (each fits the 600 s limit). fills, attn and
# decode ran on 2026-12-05 and their winners are the defaults (bench/RESULTS.md, "Issue 38, a fifth
# session"); learn and final ran on an H100 in the sixth session, tiles and split345 (and the same for 124M)
# in the seventh, whose rules are merged; final, learn, n768, dx124, attnpeer and dims on H100s in the
# eighth; n768, dx768, wide12, mmpeer, attnpeer, learn and final on an H200 in the ninth (its wide12 rules
# are merged in part). Pending: the cold compile of the committed table on an H200 (`final`).
# Pack .device (../shared/device/pack.sh) after a first deno run has filled node_modules: the GPU
# machine cannot reach npm. The earlier parts stay for reruns.
# decode, fills and split345 compare their options inside one process (`--variants`, bench/variants.ts:
# every round runs each option once, in an order turned each round, and the summary gives each one's
# median against the default's of the same process), so one call measures what took one call per option.
# `deno run -A bench/issue38_compare.ts $OUT` then prints every summary of the parts' logs.
#
#   source .device/env.sh; bash bench/issue38_next.sh train     # the step with and without --attn-scores
#   source .device/env.sh; bash bench/issue38_next.sh variants  # one LM head chunk of 8192 rows; the attention kernels alone
#   source .device/env.sh; bash bench/issue38_next.sh decode    # decode rates: readbacks, residual reduces fused, peers
#   source .device/env.sh; bash bench/issue38_next.sh head      # a trained 124M; f16 head's agreement with fp32 and transformers
#   source .device/env.sh; bash bench/issue38_next.sh splits    # split-K counts chosen inside the step, then confirmed
#   source .device/env.sh; bash bench/issue38_next.sh compile   # the training job's pipelines on a cold driver cache
#   source .device/env.sh; bash bench/issue38_next.sh gemv      # the decode gemv's tunings, then decode with its profile
#   source .device/env.sh; bash bench/issue38_next.sh unroll    # the attention backward's loops 1, 2, 4 rows per trip
#   source .device/env.sh; bash bench/issue38_next.sh fills     # attention fills and scattered sums, LayerNorm rows, column sums' loads
#   source .device/env.sh; bash bench/issue38_next.sh attn      # the attention kernels alone: dQ and dK/dV tilings
#   source .device/env.sh; bash bench/issue38_next.sh tiles     # 345M's matmul tiles chosen inside the step, confirmed
#   source .device/env.sh; bash bench/issue38_next.sh split345  # 345M's LM head dx split counts, with the tile rules
#   source .device/env.sh; bash bench/issue38_next.sh tiles124  # the same for 124M
#   source .device/env.sh; bash bench/issue38_next.sh chunks    # the LM head's chunk of rows, 2048/4096/8192, matmuls by shape
#   source .device/env.sh; bash bench/issue38_next.sh dx124     # split-K of 124M's attn_proj.dx, confirmed in the step
#   source .device/env.sh; bash bench/issue38_next.sh n768      # 124M's attn_proj and dx on threads 12 wide, confirmed
#   source .device/env.sh; bash bench/issue38_next.sh attnpeer  # PyTorch's fp32 attention beside ours alone
#   source .device/env.sh; bash bench/issue38_next.sh dx768     # attn_proj.dx on 128 x 192, second generation
#   source .device/env.sh; bash bench/issue38_next.sh wide12    # threads 12 wide or tall on every shape they divide, confirmed
#   source .device/env.sh; bash bench/issue38_next.sh mmpeer    # cuBLAS fp32 on each training matmul shape
#   source .device/env.sh; bash bench/issue38_next.sh dims      # matmul sizes in a uniform: the step and the cold compile
#   source .device/env.sh; bash bench/issue38_next.sh learn     # 400 iterations of 124M on sotu through the server
#   source .device/env.sh; bash bench/issue38_next.sh final     # the step with its peer, then the cold compile
#
# Every command's output goes to $OUT/<part>.log (and to the terminal), each under its own timeout so
# that a slow one leaves the others' figures.
set -u
part=${1:?usage: bench/issue38_next.sh train|variants|decode|head|splits|compile|gemv|unroll|fills|attn|tiles|split345|tiles124|chunks|dx124|n768|dx768|wide12|mmpeer|attnpeer|dims|learn|final}
out=${OUT:-/tmp/issue38}
mkdir -p "$out"
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
mkdir -p "$XDG_RUNTIME_DIR"
log="$out/$part.log"
run() { # seconds, command...
  local t=$1
  shift
  echo "=== $(date -u +%FT%TZ) $*" | tee -a "$log"
  timeout "$t" "$@" 2>&1 | tee -a "$log"
  echo "=== exit ${PIPESTATUS[0]}" | tee -a "$log"
}
case $part in
  train)
    run 220 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --torch
    run 150 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --attn-scores
    run 150 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --no-profile
    ;;
  variants)
    # The plan cuts the logits into 512 MiB chunks (4 of 2048 rows at 8 x 1024); an H200 binds 2 GiB.
    run 150 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --no-profile \
      --head-chunk-rows 8192
    run 250 deno task bench attention --models gpt2-124M,gpt2-345M --quick
    ;;
  decode)
    # The decode rate (after each stream's first token, as the CUDA-graph peers time it) of every
    # option against the default, in one process: 3 rounds, each round every variant once (a fresh
    # Generator) with 5 timed runs per batch; the peers (fp32, bf16) in the same call, against the default.
    # --lm-head f16 met issue 38's agreement rule (100% of 4 x 256 greedy positions, third session) and
    # waits on a gain beyond the calls' spread, which the rounds here can show.
    run 480 deno task bench generate engine --models gpt2-124M --batches 1,2,16 --repeat 5 --rounds 3 --profile \
      --torch --variants "default;--readback mapasync;--residual-rows 1;--residual-rows 2;--written-sampler;--residual-rows 2 --written-sampler;--lm-head f16;--chunk 32"
    run 60 deno run -A bench/sample_probe.ts --streams 1,16 --variants all
    ;;
  head)
    home=./.gpt2-ft-bench
    run 330 deno run -A bench/finetune_eval_bench.ts --phase base --home "$home"
    id=$(deno eval "console.log(JSON.parse(Deno.readTextFileSync('$home/finetune_eval_bench.json')).base.id)")
    run 240 deno run -A bench/lmhead_f16_probe.ts --load "$id" --root "$home" --tokens 256 --torch
    ;;
  splits)
    run 420 deno run -A bench/split_sweep.ts --models gpt2-124M,gpt2-345M --splits 2,3,5,6,7,8,11,12 \
      --emit "$out/split_rules.json"
    [ -s "$out/split_rules.json" ] && run 150 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 \
      --seq 1024 --steps 10 --no-profile --tile-rules-json "$out/split_rules.json"
    ;;
  compile)
    cache=$(mktemp -d)
    run 300 env XDG_CACHE_HOME="$cache" __GL_SHADER_DISK_CACHE=0 deno run -A bench/compile_list.ts \
      --model gpt2-124M --batch 8 --seq 1024
    run 200 deno run -A bench/compile_list.ts --model gpt2-124M --batch 8 --seq 1024
    ;;
  gemv)
    run 200 deno run -A bench/gemv_sweep.ts --rows 1,16 --targets 132,264,528,1056,2112 --unrolls 4,8 \
      --group-rows 8,16
    run 280 deno task bench generate engine --models gpt2-124M --batches 1,16 --profile --torch
    ;;
  unroll)
    run 200 deno task bench attention --models gpt2-124M,gpt2-345M --quick
    for u in 1 2 4; do
      run 120 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --no-profile \
        --attn-unroll $u
    done
    run 200 deno run -A bench/split_sweep.ts --models gpt2-124M --splits 2,3,5,6,8 --emit "$out/split_rules_head.json"
    ;;
  final)
    run 220 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --torch --ops
    cache=$(mktemp -d)
    run 120 env XDG_CACHE_HOME="$cache" __GL_SHADER_DISK_CACHE=0 deno run -A bench/compile_list.ts \
      --model gpt2-124M --batch 8 --seq 1024
    ;;
  fills)
    # Each option in the step against the default, in one process (2 rounds, each with a profiled step:
    # the kernel families' times), the PyTorch peer once per model in the same call.
    run 540 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --rounds 2 --torch \
      --variants "default;--attn-fills;--attn-scatter;--ln-written;--colsum-unroll 32;--attn-fills --attn-scatter --ln-written --colsum-unroll 32"
    ;;
  attn)
    # The attention kernels alone: the pick, the stored-dS pair with every dQ tiling (8 queries a thread
    # among them), fills written out, the dK/dV sums reduce-scattered at seven tilings.
    run 540 deno task bench attention --models gpt2-124M,gpt2-345M --quick
    ;;
  tiles)
    # Every matmul tile of 345M's step chosen inside the step (one step per candidate); split345
    # confirms what it emits. Merge what holds with bench/merge_tile_rules.ts (no GPU) and commit.
    run 440 deno run -A bench/tile_sweep.ts --models gpt2-345M --emit "$out/tile_rules_345M.json"
    ;;
  split345)
    # 345M's LM head dx has no split-K count measured in the step yet (124M's: 4); then the step with
    # the tile rules, with both, and without, in one process (3 rounds).
    run 150 deno run -A bench/split_sweep.ts --models gpt2-345M --splits 2,3,4,6,8 --emit "$out/split_rules_345M.json"
    [ -s "$out/tile_rules_345M.json" ] || echo '[]' >"$out/tile_rules_345M.json"
    [ -s "$out/split_rules_345M.json" ] || echo '[]' >"$out/split_rules_345M.json"
    python3 -c 'import json,sys; print(json.dumps(sum((json.load(open(f)) for f in sys.argv[1:]), []), indent=2))' \
      "$out/split_rules_345M.json" "$out/tile_rules_345M.json" >"$out/both_345M.json" &&
      run 300 deno task bench train --models gpt2-345M --batch 8 --seq 1024 --steps 10 --no-profile --rounds 3 \
        --variants "default;--tile-rules-json $out/tile_rules_345M.json;--tile-rules-json $out/both_345M.json"
    ;;
  tiles124)
    run 300 deno run -A bench/tile_sweep.ts --models gpt2-124M --emit "$out/tile_rules_124M.json"
    [ -s "$out/tile_rules_124M.json" ] && run 120 deno task bench train --models gpt2-124M --batch 8 --seq 1024 \
      --steps 10 --no-profile --tile-rules-json "$out/tile_rules_124M.json"
    ;;
  chunks)
    # The LM head's chunk of rows (today 512 MiB of logits: 2048 rows at 50,304) against 4096 and
    # 8192, with the matmuls by shape: the LM head dx at 2048 rows is the slowest training matmul.
    run 240 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --ops --rounds 2 \
      --variants "default;--head-chunk-rows 4096;--head-chunk-rows 8192"
    ;;
  dx124)
    # 124M's attn_proj.dx (8192 x 768 x 768, 384 blocks of 128 x 128) is 0.3% under 36 TFLOP/s: K
    # split 2 or 3 fills the SMs' second wave; then the step with what it emits, against without.
    run 120 deno run -A bench/split_sweep.ts --models gpt2-124M --only '^attn_proj\.dx$' --splits 2,3 \
      --emit "$out/split_rules_dx124.json"
    [ -s "$out/split_rules_dx124.json" ] && [ "$(cat "$out/split_rules_dx124.json")" != "[]" ] &&
      run 120 deno task bench train --models gpt2-124M --batch 8 --seq 1024 --steps 10 --no-profile --rounds 2 \
        --variants "default;--tile-rules-json $out/split_rules_dx124.json"
    ;;
  n768)
    # 124M's attn_proj and its dx (8192 x 768 x 768) with threads 12 columns wide (tile_sweep's
    # candidates 19-24; 14-18, blocks 96 wide or tall at 8 x 8, ran in the eighth session) against the
    # pick inside the step, then the step with what it emits, against without.
    run 240 deno run -A bench/tile_sweep.ts --models gpt2-124M --only '^attn_proj(\.dx)?$' \
      --candidates 19,20,21,22,23,24 --emit "$out/tile_rules_n768.json"
    [ -s "$out/tile_rules_n768.json" ] && [ "$(cat "$out/tile_rules_n768.json")" != "[]" ] &&
      run 120 deno task bench train --models gpt2-124M --batch 8 --seq 1024 --steps 10 --no-profile --rounds 2 \
        --variants "default;--tile-rules-json $out/tile_rules_n768.json"
    ;;
  dx768)
    # (The ninth session merged n768's 22 for attn_proj.) attn_proj.dx's transposed B on 128 x 192 in the
    # second generation (candidates 25-27) against 22 and the pick, then the step with what it emits.
    run 200 deno run -A bench/tile_sweep.ts --models gpt2-124M --only '^attn_proj\.dx$' \
      --candidates 22,25,26,27 --emit "$out/tile_rules_dx768.json"
    [ -s "$out/tile_rules_dx768.json" ] && [ "$(cat "$out/tile_rules_dx768.json")" != "[]" ] &&
      run 120 deno task bench train --models gpt2-124M --batch 8 --seq 1024 --steps 10 --no-profile --rounds 2 \
        --variants "default;--tile-rules-json $out/tile_rules_dx768.json"
    ;;
  wide12)
    # Threads 12 wide or tall (tile_sweep's 19-30) on every shape they divide, both models, inside the
    # step; then each model's step with what it emits against without (2 rounds in one process).
    run 200 deno run -A bench/tile_sweep.ts --models gpt2-124M --candidates 19,21,22,24,25,27,28,29,30 \
      --emit "$out/tile_rules_w12_124.json"
    run 150 deno run -A bench/tile_sweep.ts --models gpt2-345M --only '^(qkv|lm_head|qkv\.dw|lm_head\.dw)$' \
      --candidates 22,25,27,28,29,30 --emit "$out/tile_rules_w12_345.json"
    for m in 124 345; do
      f="$out/tile_rules_w12_$m.json"
      [ -s "$f" ] && [ "$(cat "$f")" != "[]" ] &&
        run 150 deno task bench train --models "gpt2-${m}M" --batch 8 --seq 1024 --steps 10 --no-profile --rounds 2 \
          --variants "default;--tile-rules-json $f"
    done
    ;;
  mmpeer)
    # cuBLAS fp32 (TF32 off) on every training matmul shape of both models, in our layouts: what the
    # "every shape >= 36 TFLOP/s" target compares with. Ours by shape: the --ops table of `final`.
    deno task bench matmul --list-shapes >"$out/shapes.json"
    run 200 python3 bench/torch_matmul.py "$out/shapes.json"
    ;;
  attnpeer)
    # PyTorch's fp32 scaled-dot-product attention (memory-efficient, math, default; TF32 off and on)
    # beside ours alone, in one call: what the attention backward target of 30 TFLOP/s compares with.
    run 120 python3 bench/torch_attention.py
    run 400 deno task bench attention --models gpt2-124M,gpt2-345M --quick
    ;;
  dims)
    # The matmuls' sizes read from a uniform (GraphOptions.kernels.uniformDims), so shapes that share
    # a tile, layout and epilogue share a pipeline: the step against the default in one process
    # (2 rounds, matmuls by shape), then the training job's cold compile without and with.
    # The first run (all against none, 2026-12-05) slowed the forward matmuls and the input
    # gradients by up to 8%, so the default is now the weight gradients alone: confirmed here
    # against none, with the PyTorch peer once per model.
    run 300 deno task bench train --models gpt2-124M,gpt2-345M --batch 8 --seq 1024 --steps 10 --ops --rounds 2 \
      --torch --variants "--uniform-dims none;default"
    for which in none weight-gradients; do
      cache=$(mktemp -d)
      run 120 env XDG_CACHE_HOME="$cache" __GL_SHADER_DISK_CACHE=0 deno run -A bench/compile_list.ts \
        --model gpt2-124M --batch 8 --seq 1024 --quiet --uniform-dims $which
    done
    ;;
  learn)
    run 500 deno run -A bench/finetune_eval_bench.ts --phase base --base-iters 400 --home ./.ft400
    ;;
  *)
    echo "unknown part \"$part\": expected train, variants, decode, head, splits, compile, gemv, unroll, fills, attn, tiles, split345, tiles124, chunks, dx124, n768, dx768, wide12, mmpeer, attnpeer, dims, learn or final" >&2
    exit 2
    ;;
esac
