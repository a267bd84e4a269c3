/**
 * Issue 41's targets, in-process on the first WebGPU adapter: multiple-choice scoring throughput
 * (10,000 synthetic four-ending examples shaped like HellaSwag's — contexts of 40–90 tokens,
 * endings of 10–30 — on gpt2-124M with random weights; target ≥ 20,000 endings/s on the H200),
 * and what evaluations during training cost (the same training job with and without a
 * 1,000-example eval task at eval_interval 250; target ≤ 5% of its training time).
 *
 *   deno run -A bench/choice_bench.ts                       # both parts, gpt2-124M
 *   deno run -A bench/choice_bench.ts --part score --batch 64
 *   deno run -A bench/choice_bench.ts --model gpt2-tiny --seq-len 64 --examples 200 --iters 20 \
 *     --interval 10 --task-examples 50                       # a smoke run on a CPU adapter
 *
 * Prints one JSON line per part.
 */

import { parseArgs } from "node:util";
import { describeDevice, openDevice } from "../engine/device.ts";
import { presetConfig } from "../model/config.ts";
import { initParams } from "../model/init.ts";
import type { ChoiceExample, ChoiceTokens } from "../model/multiple_choice.ts";
import type { TrainConfig } from "../job/job.ts";
import { prepareDataset } from "../data/mod.ts";
import { choiceWindow, EvalModel, multipleChoice } from "../worker/evaluation.ts";
import { runTraining } from "../worker/train_loop.ts";
import type { FromWorker } from "../protocol.ts";

const { values } = parseArgs({
  args: Deno.args,
  options: {
    part: { type: "string", default: "all" },
    model: { type: "string", default: "gpt2-124M" },
    "seq-len": { type: "string", default: "1024" },
    batch: { type: "string", default: "8" },
    examples: { type: "string", default: "10000" },
    iters: { type: "string", default: "500" },
    interval: { type: "string", default: "250" },
    "train-batch": { type: "string", default: "8" },
    "task-examples": { type: "string", default: "1000" },
    home: { type: "string", default: "./.gpt2/choice-bench" },
  },
});
const num = (k: string) => Number(values[k as keyof typeof values]);

/** A deterministic generator of integers below `n`. */
function lcg(seed: number): (n: number) => number {
  let x = seed >>> 0;
  return (n) => {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    return x % n;
  };
}

const ctx = await openDevice();
console.error(`Device: ${describeDevice(ctx)}`);
const config = presetConfig(values.model!);

if (values.part === "all" || values.part === "score") {
  const r = lcg(1);
  const examples: ChoiceTokens[] = Array.from({ length: num("examples") }, () => {
    const endings = Array.from({ length: 4 }, () => Array.from({ length: 10 + r(21) }, () => r(50000)));
    return {
      context: Array.from({ length: 40 + r(51) }, () => r(50000)),
      endings,
      bytes: endings.map((e) => 5 * e.length),
      label: r(4),
    };
  });
  const seqLen = num("seq-len"), batch = num("batch");
  const window = choiceWindow(examples, seqLen);
  const rows = Math.max(batch, Math.floor(batch * seqLen / window));
  const model = await EvalModel.create(ctx, config, initParams(config, 1), rows, window);
  await multipleChoice(model, examples.slice(0, rows), "sum"); // compiles the kernels
  const res = await multipleChoice(model, examples, "sum");
  model.destroy();
  console.log(JSON.stringify({
    part: "score",
    model: values.model,
    examples: res.examples,
    endings: res.endings,
    window,
    rows,
    elapsed_s: res.elapsed_s,
    endings_per_s: res.endings_per_s,
    tokens_per_s: res.tokens_per_s,
    target_endings_per_s: 20000,
  }));
}

if (values.part === "all" || values.part === "train") {
  await Deno.mkdir(values.home!, { recursive: true });
  const root = await Deno.realPath(values.home!);
  await prepareDataset(root, { builtin: "sotu" });
  const words = ["the", "man", "walks", "to", "a", "red", "house", "and", "opens", "door", "slowly", "dog"];
  const r = lcg(2);
  const sentence = (n: number) => Array.from({ length: n }, () => words[r(words.length)]).join(" ");
  const taskExamples: ChoiceExample[] = Array.from({ length: num("task-examples") }, () => ({
    context: sentence(40 + r(30)),
    endings: Array.from({ length: 4 }, () => sentence(8 + r(12))),
    label: r(4),
  }));
  const base: TrainConfig = {
    model: values.model!,
    dataset: "sotu",
    split: "949,50,1",
    train_iters: num("iters"),
    batch_size: num("train-batch"),
    seq_len: num("seq-len"),
    lr: 6e-4,
    min_lr: 6e-5,
    lr_decay_style: "cosine",
    warmup: 0.01,
    weight_decay: 0.1,
    clip_grad: 1,
    attention_dropout: 0,
    hidden_dropout: 0,
    seed: 1,
    log_interval: 50,
    eval_interval: num("interval"),
    eval_iters: 10,
    save_interval: 0,
    keep_checkpoints: 1,
  };
  const run = async (id: string, c: TrainConfig) => {
    const messages: FromWorker[] = [];
    const t0 = performance.now();
    const done = await runTraining(ctx, {
      id,
      config: c,
      root,
      checkpoint_dir: `${root}/checkpoints/${id}`,
      resume_path: null,
    }, { post: (m) => messages.push(m), cancelled: () => false });
    if (done.status !== "succeeded") throw new Error(`${id}: ${done.status} ${done.error}`);
    return { wall_s: (performance.now() - t0) / 1000, messages };
  };
  const plain = await run("bench_plain", base);
  const withTasks = await run("bench_tasks", {
    ...base,
    eval_tasks: [{
      name: "mc",
      task: "multiple_choice",
      examples: taskExamples,
      strict: false,
      scoring: "sum",
    }],
  });
  const evals = withTasks.messages.filter((m) => m.type === "eval_task" && (m.result || m.error));
  const failed = evals.filter((m) => m.type === "eval_task" && m.error);
  const scoring = evals.reduce((a, m) => a + (m.type === "eval_task" ? m.result?.elapsed_s ?? 0 : 0), 0);
  console.log(JSON.stringify({
    part: "train",
    model: values.model,
    train_iters: base.train_iters,
    eval_interval: base.eval_interval,
    task_examples: taskExamples.length,
    evaluations: evals.length,
    failed: failed.length,
    wall_s_without: plain.wall_s,
    wall_s_with: withTasks.wall_s,
    scoring_s: scoring,
    overhead: (withTasks.wall_s - plain.wall_s) / plain.wall_s,
    target_overhead: 0.05,
  }));
}
ctx.device.destroy();
