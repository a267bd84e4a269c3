/**
 * Issue 28's figures on the GPU machine, through the server (main.ts as a subprocess): fine-tune
 * gpt2-124M from a checkpoint on a second dataset with validation loss before and after; the
 * perplexity of a transformers-saved GPT-2 on sotu's test split at seq_len 1024 / stride 512 beside
 * what transformers computes by its documented sliding-window recipe in the same call
 * (bench/torch_perplexity.py, on the same token ids); and evaluation tokens/s.
 *
 *   source .device/env.sh
 *   deno run -A bench/finetune_eval_bench.ts --phase all            # or one phase per call:
 *   deno run -A bench/finetune_eval_bench.ts --phase base           # ~2 min: gpt2-124M on sotu
 *   deno run -A bench/finetune_eval_bench.ts --phase finetune       # before, init_from on moby-dick, after
 *   deno run -A bench/finetune_eval_bench.ts --phase compare        # HF export, transformers, POST /evaluate
 *
 * Phases keep their state in `<home>/finetune_eval_bench.json` (home: --home, default
 * ./.gpt2-ft-bench), so each can be its own device call. Prints a JSON summary and a RESULTS.md
 * paragraph. transformers' max_length L equals our seq_len L − 1 with the same stride (a window is
 * seq_len + 1 tokens); both are reported: ours at 1023 against the recipe, ours at 1024 against the
 * same definition computed from transformers' logits.
 */

import { parseArgs } from "node:util";
import { loadSplit, prepareDataset } from "../data/mod.ts";

const { values } = parseArgs({
  args: Deno.args,
  options: {
    phase: { type: "string", default: "all" },
    home: { type: "string", default: "./.gpt2-ft-bench" },
    "base-iters": { type: "string", default: "300" },
    "ft-iters": { type: "string", default: "200" },
    python: { type: "string", default: "python3" },
    // Smaller runs (e.g. a smoke test on a CPU adapter: --model gpt2-tiny --seq-len 64 --python none).
    model: { type: "string", default: "gpt2-124M" },
    "seq-len": { type: "string", default: "1024" },
    batch: { type: "string", default: "8" },
    "speed-tokens": { type: "string" },
  },
});
await Deno.mkdir(values.home!, { recursive: true });
const home = await Deno.realPath(values.home!);
const stateFile = `${home}/finetune_eval_bench.json`;
// deno-lint-ignore no-explicit-any
type Json = any;
type State = Record<string, Json>;
const state: State = await Deno.readTextFile(stateFile).then(JSON.parse).catch(() => ({}));
const save = () => Deno.writeTextFile(stateFile, JSON.stringify(state, null, 2));
const repo = new URL("..", import.meta.url).pathname;

/** Starts main.ts on a free port with GPT2_HOME = home. */
async function startServer(): Promise<{ url: string; child: Deno.ChildProcess }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts"],
    cwd: repo,
    env: { PORT: "0", HOST: "127.0.0.1", GPT2_HOME: home, DENO_WEBGPU_BACKEND: "vulkan" },
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error(`Server exited before listening: ${buf}`);
    buf += value;
    const m = buf.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
    if (m) {
      (async () => {
        for (;;) {
          const r = await reader.read().catch(() => ({ done: true, value: "" }));
          if (r.done) return;
          for (const line of r.value!.split("\n")) if (line.trim()) console.error(`  server: ${line}`);
        }
      })();
      return { url: m[1], child };
    }
  }
}

async function post(url: string, path: string, body: unknown): Promise<Json> {
  const res = await fetch(`${url}${path}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const json = await res.json();
  if (res.status !== 202) throw new Error(`${path} answered ${res.status}: ${JSON.stringify(json)}`);
  return json;
}

/** Waits for a job to finish; returns it. Fails on anything but "succeeded". */
async function wait(url: string, id: string): Promise<Json> {
  let last = "";
  for (;;) {
    const job = await (await fetch(`${url}/jobs/${id}`)).json();
    const line = `${id}: ${job.status} iteration ${job.iteration} loss ${job.metrics?.loss ?? "–"}`;
    if (line !== last) console.error(line);
    last = line;
    if (["succeeded", "failed", "cancelled"].includes(job.status)) {
      if (job.status !== "succeeded") throw new Error(`${id} ${job.status}: ${job.error}`);
      return job;
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

const SEQ = Number(values["seq-len"]), BATCH = Number(values.batch), STRIDE = SEQ / 2;
const train = {
  model: values.model,
  batch_size: BATCH,
  seq_len: SEQ,
  attention_dropout: 0,
  hidden_dropout: 0,
  eval_interval: 0,
  eval_iters: 20,
  save_interval: 0,
  log_interval: 10,
  keep_checkpoints: 1,
};

const phases = values.phase === "all" ? ["base", "finetune", "compare"] : [values.phase!];
const server = await startServer();
try {
  for (const phase of phases) {
    const t0 = performance.now();
    if (phase === "base") {
      const { id } = await post(server.url, "/train", {
        ...train,
        dataset: "sotu",
        train_iters: Number(values["base-iters"]),
        lr: 6e-4,
        min_lr: 6e-5,
        warmup: 0.05,
      });
      const job = await wait(server.url, id as string);
      state.base = { id, val_loss: job.metrics.val_loss, tokens_per_s: job.metrics.tokens_per_s };
    } else if (phase === "finetune") {
      const base = state.base?.id as string | undefined;
      if (!base) throw new Error("Run --phase base first");
      const valid = { dataset: "moby-dick", split: "valid", seq_len: SEQ, stride: SEQ, batch_size: BATCH };
      const before = await wait(
        server.url,
        (await post(server.url, "/evaluate", { model: base, ...valid })).id as string,
      );
      const { id } = await post(server.url, "/train", {
        ...train,
        model: undefined,
        init_from: base,
        dataset: "moby-dick",
        train_iters: Number(values["ft-iters"]),
        lr: 1e-4,
        min_lr: 1e-5,
        warmup: 0.05,
      });
      const ft = await wait(server.url, id as string);
      const after = await wait(
        server.url,
        (await post(server.url, "/evaluate", { model: id, ...valid })).id as string,
      );
      state.finetune = {
        base,
        id,
        valid_loss_before: before.metrics.evaluation.loss,
        valid_loss_after: after.metrics.evaluation.loss,
        valid_tokens: after.metrics.evaluation.tokens,
        job_val_loss: ft.metrics.val_loss,
        train_tokens_per_s: ft.metrics.tokens_per_s,
        eval_tokens_per_s: after.metrics.evaluation.tokens_per_s,
      };
    } else if (phase === "compare") {
      const base = state.base?.id as string | undefined;
      if (!base) throw new Error("Run --phase base first");
      // Our checkpoint as a Hugging Face folder, then loaded and saved back by transformers.
      const ckpts = [...Deno.readDirSync(`${home}/checkpoints/${base}`)].map((e) => e.name).sort();
      const hf = `${home}/bench_hf_export`;
      await Deno.remove(hf, { recursive: true }).catch(() => {});
      const reshard = await new Deno.Command(Deno.execPath(), {
        args: [
          "run",
          "-A",
          "scripts/reshard.ts",
          `${home}/checkpoints/${base}/${ckpts.at(-1)}`,
          "--tensor-parallel",
          "1",
          "--out",
          hf,
        ],
        cwd: repo,
      }).output();
      if (!reshard.success) throw new Error(new TextDecoder().decode(reshard.stderr));
      const tf = `${home}/models/gpt2_tf`;
      await Deno.mkdir(`${home}/models`, { recursive: true });
      await Deno.remove(tf, { recursive: true }).catch(() => {});
      const sotu = (await prepareDataset(home, { builtin: "sotu" })).id;
      const tokensFile = `${home}/sotu_test.u16`;
      const test = await loadSplit(home, sotu, "test");
      await Deno.writeFile(tokensFile, new Uint8Array(test.buffer, test.byteOffset, test.byteLength));
      const noPython = { recipe: {}, exact: {}, ours_seq_len: {} };
      const py = values.python === "none" ? null : await new Deno.Command(values.python!, {
        args: [
          `${repo}bench/torch_perplexity.py`,
          "--model",
          hf,
          "--resave",
          tf,
          "--tokens",
          tokensFile,
          "--max-length",
          String(SEQ),
          "--stride",
          String(STRIDE),
        ],
      }).output();
      if (py && !py.success) throw new Error(new TextDecoder().decode(py.stderr));
      if (!py) await Deno.rename(hf, tf); // no transformers: evaluate our own export
      const torch = py
        ? JSON.parse(new TextDecoder().decode(py.stdout).trim().split("\n").at(-1)!)
        : noPython;
      const ev = async (seq_len: number, stride: number, split = "test", max_tokens?: number) =>
        (await wait(
          server.url,
          (await post(server.url, "/evaluate", {
            model: "gpt2_tf",
            dataset: "sotu",
            split,
            seq_len,
            stride,
            batch_size: BATCH,
            ...(max_tokens ? { max_tokens } : {}),
          })).id as string,
        )).metrics.evaluation;
      const ours1023 = await ev(SEQ - 1, STRIDE), ours1024 = await ev(SEQ, STRIDE);
      const rel = (a: number, b: number) => Math.abs(a - b) / Math.abs(b);
      // Throughput on a larger text: sotu's validation split.
      const cap = values["speed-tokens"] ? Number(values["speed-tokens"]) : undefined;
      const speed512 = await ev(SEQ, STRIDE, "valid", cap), speed1024 = await ev(SEQ, SEQ, "valid", cap);
      state.compare = {
        test_tokens: test.length,
        transformers: torch,
        ours_seq_len_1023_stride_512: ours1023,
        ours_seq_len_1024_stride_512: ours1024,
        rel_ppl_1023_vs_recipe: rel(ours1023.perplexity, torch.recipe.perplexity),
        rel_ppl_1023_vs_exact: rel(ours1023.perplexity, torch.exact.perplexity),
        rel_ppl_1024_vs_same_definition: rel(ours1024.perplexity, torch.ours_seq_len.perplexity),
        within_1e3: rel(ours1023.perplexity, torch.recipe.perplexity) <= 1e-3,
        eval_tokens_per_s_valid_stride_512: speed512.tokens_per_s,
        eval_tokens_per_s_valid_stride_1024: speed1024.tokens_per_s,
        valid_tokens_scored: speed1024.tokens,
      };
    } else {
      throw new Error(`Unknown phase "${phase}": expected base, finetune, compare or all`);
    }
    console.error(`phase ${phase}: ${((performance.now() - t0) / 1000).toFixed(0)} s`);
    await save();
  }
} finally {
  server.child.kill("SIGTERM");
  await server.child.status;
}

console.log(JSON.stringify(state, null, 2));
const f = state.finetune, c = state.compare;
const n = (x: unknown, d = 4) => typeof x === "number" ? x.toFixed(d) : "n/a";
if (f) {
  console.log(
    `Fine-tuning ${values.model} (${values["base-iters"]} steps on sotu) on moby-dick for ${
      values["ft-iters"]
    } ` +
      `steps: validation loss ${n(f.valid_loss_before)} before, ${n(f.valid_loss_after)} after ` +
      `(${f.valid_tokens} tokens, non-overlapping windows of ${SEQ}).`,
  );
}
if (c) {
  const t = c.transformers;
  console.log(
    `Perplexity on sotu's test split (${c.test_tokens} tokens), stride ${STRIDE}: ours ` +
      `${n(c.ours_seq_len_1023_stride_512.perplexity)} at seq_len ${SEQ - 1} against transformers' recipe ` +
      `${n(t.recipe.perplexity)} at max_length ${SEQ} (relative difference ${
        n(c.rel_ppl_1023_vs_recipe, 7)
      }; ` +
      `each token weighted once: ${n(t.exact.perplexity)}); ours ${
        n(c.ours_seq_len_1024_stride_512.perplexity)
      } ` +
      `at seq_len ${SEQ} against ${n(t.ours_seq_len.perplexity)} from transformers' logits. Evaluation: ` +
      `${n(c.eval_tokens_per_s_valid_stride_1024, 0)} tokens/s at stride ${SEQ}, ` +
      `${n(c.eval_tokens_per_s_valid_stride_512, 0)} at ${STRIDE} (batch ${BATCH}).`,
  );
}
