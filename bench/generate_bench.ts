/**
 * Generation benchmark, three scenarios (fresh random weights; 32-token prompts; 128 new tokens
 * per stream; sampling at temperature 0.8, top-k 40, end-of-text ignored):
 *
 *   engine  the Generator alone, B streams decoded together (continuous-batching steps of a
 *           16-token chunk, --chunk; the next chunk queued ahead of each readback unless
 *           --ahead 0), aggregate tokens/s and the batch's time to first token; --torch adds
 *           the PyTorch CUDA-graph peer (bench/torch_decode.py) in the same run.
 *   http    the whole server (Hono on Deno.serve, a GPU Worker) with S concurrent streaming
 *           `POST /v1/completions`: aggregate tokens/s (from the requests to the last token),
 *           time to first token p50 and max, and the decode rate once every stream has begun.
 *   train   16 concurrent streams over HTTP, first alone, then (rounds for 20 s) while a gpt2-345M
 *           job (batch 8 × 1024) trains on the same GPU: aggregate tokens/s of both, and training tokens/s alone
 *           and beside generation.
 *
 *   deno task bench generate engine [--models gpt2-124M,gpt2-345M] [--batches 1,16,64] [--torch] [--profile]
 *                                   [--chunk 16] [--ahead 1] [--every 4 (steps per submission)]
 *                                   [--calls (each step call's time)]
 *   deno task bench generate http [--model gpt2-124M] [--streams 1,16,64]
 *   deno task bench generate train [--model gpt2-124M] [--train-model gpt2-345M] [--streams 16]
 *                                  [--gpus 2 --roles train,generate]
 * Common: [--new 128]. Each prints one JSON line per measurement and a readable line.
 */

import { presetConfig } from "../gpu/config.ts";
import { describeDevice, openDevice } from "../gpu/device.ts";
import { Generator, isCpuAdapter } from "../gpu/generator.ts";
import { initParams } from "../gpu/init.ts";
import { exportTensors, hfConfig } from "../jobs/checkpoint.ts";
import { writeSafetensors } from "../jobs/safetensors.ts";
import { GenerationManager, JobRunner, JobStore, spawnGpuWorker, type TrainRequest } from "../jobs/mod.ts";
import { isBuiltinName } from "../data/mod.ts";
import { createApp } from "../routes/mod.ts";
import { parseGpuRoles, trainingGpus } from "../jobs/roles.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}
const list = (s: string) => s.split(",").map((x) => x.trim()).filter(Boolean);
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)] ?? NaN;
const scenario = Deno.args.find((a) => !a.startsWith("--") && ["engine", "http", "train"].includes(a)) ??
  "engine";
const promptOf = (n: number, salt: number) =>
  Array.from({ length: n }, (_, i) => (i * 7919 + salt * 104729) % 50000);
const sampling = { temperature: 0.8, top_k: 40, top_p: 1 };

async function engine(): Promise<void> {
  const ctx = await openDevice();
  console.log(describeDevice(ctx));
  const cpu = isCpuAdapter(ctx);
  const models = list(arg("models", cpu ? "gpt2-tiny" : "gpt2-124M,gpt2-345M"));
  const batches = list(arg("batches", cpu ? "1,4" : "1,16,64")).map(Number);
  const newTokens = +arg("new", cpu ? "32" : "128");
  const chunk = +arg("chunk", "16"), ahead = arg("ahead", "1") === "1" ? chunk : 0;
  for (const model of models) {
    const config = presetConfig(model);
    const gen = await Generator.create(ctx, config, initParams(config, 1), {
      maxStreams: Math.max(...batches),
      chunk,
      submitEvery: +arg("every", "4"),
    });
    if (!cpu) {
      console.log(
        `${model}: every batch bucket's decode kernels compiled in ${(await gen.warm()).toFixed(0)} ms`,
      );
    }
    const run = async (B: number, n: number) => {
      const hs = [];
      for (let i = 0; i < B; i++) hs.push(await gen.admit(promptOf(32, i), { ...sampling, seed: i }, n));
      const t0 = performance.now();
      let got = 0;
      // The prefill's first tokens (the first chunk then runs ahead).
      for (const o of (await gen.step(0, ahead)).values()) got += o.tokens.length;
      const ttft = performance.now() - t0;
      const calls: string[] = [];
      while (got < B * n) {
        const c0 = performance.now();
        for (const o of (await gen.step(chunk, ahead)).values()) got += o.tokens.length;
        const t = gen.timing;
        calls.push(`${(performance.now() - c0).toFixed(1)} (${t.steps} steps, map ${t.mapMs.toFixed(1)})`);
      }
      if (Deno.args.includes("--calls")) {
        console.log(`  batch ${B}, ${n} tokens, each call in ms: ${calls.join(", ")}`);
      }
      const ms = performance.now() - t0;
      const profile = Deno.args.includes("--profile") && ctx.hasTimestamps ? await gen.profileDecode() : null;
      for (const h of hs) gen.release(h);
      return { tokens: got, ms, ttft, profile };
    };
    for (const B of batches) {
      await run(B, newTokens); // warm-up: compiles this batch's plans (and lets the GPU's clocks rise)
      const r = await run(B, newTokens);
      const res = {
        scenario: "engine",
        model,
        batch: B,
        tokens_per_s: r.tokens / (r.ms / 1000),
        ttft_ms: r.ttft,
      };
      console.log(JSON.stringify(res));
      console.log(
        `${model} batch ${B}: ${res.tokens_per_s.toFixed(0)} tokens/s aggregate, ` +
          `time to first token (batched prefill of ${B} × 32 tokens) ${r.ttft.toFixed(1)} ms`,
      );
      if (r.profile) {
        // Kernel families: the label without its layer, e.g. "dec.l3.fc.gemv" -> "fc.gemv".
        const fam = new Map<string, { n: number; ms: number }>();
        for (const k of r.profile) {
          const key = k.label.replace(/^dec\.(l\d+\.)?/, "");
          const f = fam.get(key) ?? { n: 0, ms: 0 };
          f.n++;
          f.ms += k.ms;
          fam.set(key, f);
        }
        const total = r.profile.reduce((a, k) => a + k.ms, 0);
        console.log(
          `  one decode step, kernel by kernel: ${r.profile.length} kernels, ${
            total.toFixed(3)
          } ms of GPU time ` +
            `(the timed run: ${(r.ms / (r.tokens / B)).toFixed(3)} ms per token per stream)`,
        );
        for (const [k, f] of [...fam].sort((a, b) => b[1].ms - a[1].ms)) {
          console.log(
            `    ${k.padEnd(16)} ${String(f.n).padStart(3)} × ${
              (f.ms / f.n * 1000).toFixed(1).padStart(7)
            } µs = ${f.ms.toFixed(3)} ms`,
          );
        }
      }
    }
    gen.destroy();
    if (Deno.args.includes("--torch")) {
      const out = await new Deno.Command("python3", {
        args: [
          "bench/torch_decode.py",
          "--model",
          model,
          "--batches",
          batches.join(","),
          "--new-tokens",
          `${newTokens}`,
        ],
        stderr: "inherit",
      }).output();
      for (const line of new TextDecoder().decode(out.stdout).trim().split("\n")) {
        console.log(`  PyTorch CUDA graph fp32: ${line}`);
      }
    }
  }
  ctx.device.destroy();
}

/** A server over a temporary data directory holding `model` as a Hugging Face directory. */
async function server(model: string) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_genbench_" });
  const config = presetConfig(model);
  await Deno.mkdir(`${root}/models/${model}`, { recursive: true });
  await writeSafetensors(
    `${root}/models/${model}/model.safetensors`,
    exportTensors(config, initParams(config, 1)),
  );
  await Deno.writeTextFile(
    `${root}/models/${model}/config.json`,
    JSON.stringify(hfConfig(config, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  const store = new JobStore(":memory:");
  // --gpus 2 --roles train,generate: two Workers (on one GPU they share it, each with its own
  // device and queue), one training and one generating.
  const gpus = +arg("gpus", "1"), roleSpec = arg("roles", "");
  const roles = roleSpec ? parseGpuRoles(roleSpec, gpus) : undefined;
  const runner = new JobRunner(store, {
    root,
    gpus,
    spawn: spawnGpuWorker,
    trainGpus: roles ? trainingGpus(roles) : undefined,
    datasetExists: (id) => Promise.resolve(isBuiltinName(id)),
  });
  runner.start();
  const manager = new GenerationManager(runner, root, { maxWaiting: 4096, roles });
  // One client stands in for many users here: lift the per-client stream cap.
  const app = createApp({
    runner,
    generation: manager,
    token: null,
    limits: { maxStreamsPerClient: 1024, maxStreams: 4096 },
  });
  const srv = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, app.fetch);
  const url = `http://127.0.0.1:${srv.addr.port}`;
  const close = async () => {
    await srv.shutdown();
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { url, runner, close };
}

/** One streaming completion: time to first token and tokens received. */
async function stream(url: string, model: string, n: number, seed: number) {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      model,
      prompt: promptOf(32, seed),
      max_tokens: n,
      ...sampling,
      seed,
      ignore_eos: true,
      stream: true,
      stream_options: { include_usage: true },
    }),
  });
  if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let tokens = 0, buf = "";
  /** When each text chunk arrived. */
  const times: number[] = [];
  const dec = new TextDecoder();
  for await (const chunk of res.body!) {
    buf += dec.decode(chunk, { stream: true });
    for (let i = buf.indexOf("\n\n"); i >= 0; i = buf.indexOf("\n\n")) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
      const d = JSON.parse(ev.slice(6));
      if (d.choices?.[0]?.text) times.push(performance.now());
      if (d.usage) tokens = d.usage.completion_tokens;
    }
  }
  return { ttft: times.length ? times[0] - t0 : NaN, tokens, times };
}

async function concurrent(url: string, model: string, S: number, n: number) {
  const t0 = performance.now();
  const rs = await Promise.all(Array.from({ length: S }, (_, i) => stream(url, model, n, i)));
  const ms = performance.now() - t0;
  const tokens = rs.reduce((a, r) => a + r.tokens, 0);
  const ttfts = rs.map((r) => r.ttft);
  // Decoding alone: the chunks that arrived once every stream had its first, over that time.
  const all = Math.max(...rs.map((r) => r.times[0] ?? Infinity));
  const after = rs.reduce((a, r) => a + r.times.filter((t) => t > all).length, 0);
  return {
    tokens_per_s: tokens / (ms / 1000),
    decode_tokens_per_s: after / ((t0 + ms - all) / 1000),
    ttft_p50_ms: median(ttfts),
    ttft_max_ms: Math.max(...ttfts),
    tokens,
  };
}

async function http(): Promise<void> {
  const model = arg("model", "gpt2-124M"), n = +arg("new", "128");
  const streams = list(arg("streams", "1,16,64")).map(Number);
  const s = await server(model);
  try {
    // Warm-up: loads the model, compiles every batch bucket and prefill shape used below.
    await stream(s.url, model, 8, 999);
    // Every count once: each batch bucket's first use compiles its kernels (about half a second).
    for (const S of streams) await concurrent(s.url, model, S, 20);
    for (const S of streams) {
      const r = await concurrent(s.url, model, S, n);
      console.log(JSON.stringify({ scenario: "http", model, streams: S, new_tokens: n, ...r }));
      console.log(
        `${model} over HTTP, ${S} streams: ${r.tokens_per_s.toFixed(0)} tokens/s aggregate, ` +
          `TTFT p50 ${r.ttft_p50_ms.toFixed(0)} ms, max ${r.ttft_max_ms.toFixed(0)} ms; ` +
          `${r.decode_tokens_per_s.toFixed(0)} tokens/s once every stream had its first token`,
      );
    }
  } finally {
    await s.close();
  }
}

async function train(): Promise<void> {
  const model = arg("model", "gpt2-124M"), trainModel = arg("train-model", "gpt2-345M");
  const n = +arg("new", "128"), S = +arg("streams", "16");
  const s = await server(model);
  try {
    await stream(s.url, model, 8, 999);
    await concurrent(s.url, model, S, 20);
    const alone = await concurrent(s.url, model, S, n);
    const req: TrainRequest = {
      model: trainModel,
      dataset: "sotu",
      split: "949,50,1",
      train_iters: 1_000_000,
      batch_size: 8,
      seq_len: 1024,
      lr: 1.5e-4,
      min_lr: 1e-5,
      lr_decay_style: "cosine",
      warmup: 0.01,
      weight_decay: 0.01,
      clip_grad: 1,
      attention_dropout: 0,
      hidden_dropout: 0,
      seed: 1,
      log_interval: 2,
      eval_interval: 0,
      eval_iters: 1,
      save_interval: 0,
      keep_checkpoints: 1,
    };
    const job = await s.runner.submit(req);
    const rates: { at: number; tps: number }[] = [];
    s.runner.subscribe(job.id, (e) => {
      if (e.type === "progress" && typeof e.data.tokens_per_s === "number") {
        rates.push({ at: performance.now(), tps: e.data.tokens_per_s });
      }
    });
    const t0 = performance.now();
    while (rates.length < 6) {
      if (performance.now() - t0 > 240_000) {
        throw new Error("Training did not report progress within 4 minutes");
      }
      await new Promise((r) => setTimeout(r, 200));
    }
    const trainAlone = median(rates.slice(2).map((r) => r.tps));
    // Rounds of S streams for at least 20 s, so several training log windows fall inside.
    const g0 = performance.now();
    let tokens = 0;
    const ttfts: number[] = [];
    while (performance.now() - g0 < 20_000) {
      const r = await concurrent(s.url, model, S, n);
      tokens += r.tokens;
      ttfts.push(r.ttft_p50_ms);
    }
    const g1 = performance.now();
    const beside = { tokens_per_s: tokens / ((g1 - g0) / 1000), ttft_p50_ms: median(ttfts) };
    // Windows that ended during generation (the first one may straddle its start).
    const during = rates.filter((r) => r.at > g0 && r.at <= g1).slice(1).map((r) => r.tps);
    s.runner.cancel(job.id);
    const res = {
      scenario: "train",
      model,
      train_model: trainModel,
      streams: S,
      gen_alone_tokens_per_s: alone.tokens_per_s,
      gen_beside_training_tokens_per_s: beside.tokens_per_s,
      gen_kept: beside.tokens_per_s / alone.tokens_per_s,
      ttft_p50_beside_ms: beside.ttft_p50_ms,
      train_alone_tokens_per_s: trainAlone,
      train_beside_generation_tokens_per_s: during.length ? median(during) : null,
      train_kept: during.length ? median(during) / trainAlone : null,
    };
    console.log(JSON.stringify(res));
    console.log(
      `${S} streams of ${model}: ${alone.tokens_per_s.toFixed(0)} tokens/s alone, ` +
        `${beside.tokens_per_s.toFixed(0)} beside ${trainModel} training (${
          (res.gen_kept * 100).toFixed(0)
        }%); ` +
        `training ${trainAlone.toFixed(0)} tokens/s alone, ${
          res.train_beside_generation_tokens_per_s?.toFixed(0) ?? "?"
        } beside (${res.train_kept === null ? "?" : (res.train_kept * 100).toFixed(0)}%)`,
    );
  } finally {
    await s.close();
  }
}

if (scenario === "engine") await engine();
else if (scenario === "http") await http();
else await train();
Deno.exit(0);
