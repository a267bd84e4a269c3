/**
 * Generation benchmark, three scenarios (fresh random weights; 32-token prompts; 128 new tokens
 * per stream; sampling at temperature 0.8, top-k 40, end-of-text ignored):
 *
 *   engine  the Generator alone, B streams decoded together (continuous-batching steps of a
 *           16-token chunk, --chunk; the next chunk queued ahead of each readback unless
 *           --ahead 0), read back as the server reads them (a lone stream's chunks through the
 *           canvas path, engine/readback.ts; --readback mapasync for mapAsync only), and the chunk
 *           left to run ahead queued once the tokens are out, as the server does (runAhead).
 *           Per batch: the batch's time to first token (the prefill and its readback), the
 *           aggregate tokens/s from admission to the last token (`tokens_per_s`), and the decode
 *           rate alone, the tokens after each stream's first over the time after the first step
 *           (`decode_tokens_per_s`): what bench/torch_decode.py's CUDA-graph peer times (decode
 *           steps from a filled cache, no prefill), so --torch's ratios are of that rate. --repeat
 *           N times N runs after the warm-up and reports their median (and min, max). --torch adds
 *           the peers (fp32 and bf16) in the same run.
 *   http    what users meet: for each stream count S a fresh `deno task serve` subprocess (the serve
 *           task's flags, PORT=0, a new GPT2_HOME holding the model under models/<name>, every
 *           limit at its default), one client (127.0.0.1) sending S concurrent streaming
 *           `POST /v1/completions`. First a 1-token request loads the model (`load_ms`, and its
 *           first token `first_ever_ttft_ms`); then a cold round (the first at S on that server,
 *           after this client ran its own code for S streams against a stub server, warmClient)
 *           and a warm one (the same again). Per round: aggregate tokens/s (from the requests to
 *           the last token), time to first token p50 and max, the decode rate once every stream
 *           has begun, and the 429 answers (exits 1 if any); --torch adds the PyTorch CUDA-graph
 *           peer at batches S in the same call, after the servers, and ours/peer ratios; a table
 *           ends it. --log relays the servers' output. --repeat N starts N fresh servers per
 *           count (one after another) and the table gives the median of each figure over them
 *           (run-to-run spread on an H200 is large: one server's cold/warm ratio is one sample).
 *           --gap MS idles the server that long before each round, cold and warm alike.
 *           --auth none,user: each count's servers once without any token configured and once
 *           with a user's token in the store (scope generate, stream quota S; every request carries
 *           it, so every request is checked), in turns, and the table has a row per mode (issue 40).
 *           --chat: after the warm round, 3 more rounds of each of `/v1/completions` and
 *           `/v1/chat/completions` in turns on the same server, the same prompt text (the chat
 *           template's rendering of one user message, sent to /v1/completions as text), and the
 *           ratio of their medians (issue 42's figure); the model gets the chat template.
 *   train   16 concurrent streams over HTTP, first alone, then (rounds for 20 s) while a gpt2-345M
 *           job (batch 8 × 1024) trains on the same GPU: aggregate tokens/s of both, and training tokens/s alone
 *           and beside generation.
 *
 *   deno task bench generate engine [--models gpt2-124M,gpt2-345M] [--batches 1,16,64] [--torch] [--profile]
 *                                   [--chunk 16] [--ahead 1] [--every 4 (steps per submission)]
 *                                   [--readback canvas|mapasync] [--repeat 3] [--residual-rows 0 (decode
 *                                   steps of up to N rows reduce their residuals in the next gemv,
 *                                   GeneratorOptions.kernels.residualRows)] [--written-sampler (the
 *                                   sampler's pass rests written out, kernels.writtenSampler)]
 *                                   [--calls (each step call's time)] [--lm-head f32|f16 (wte's copy the
 *                                   decode LM head reads up to 16 streams, GeneratorOptions.lmHead)]
 *                                   [--variants "default;--residual-rows 1;--chunk 32" [--rounds 2]] (each
 *                                   variant's flags before the others, one Generator per variant and round,
 *                                   every round each variant once in an order turned by one each round;
 *                                   then each variant's median decode rate over all its runs against the
 *                                   first's, bench/variants.ts; --torch compares the first with the peers)
 *   deno task bench generate http [--model gpt2-124M] [--streams 1,4,16,64] [--torch] [--log] [--repeat 1] [--gap 0]
 *                                 [--auth none|user|none,user] [--chat]
 *   deno task bench generate train [--model gpt2-124M] [--train-model gpt2-345M] [--streams 16] [--cold-load]
 *                                  [--train-batch 8] [--train-seq 1024]
 *                                  [--gpus 2 --roles train,generate]
 * Common: [--new 128]. Each prints one JSON line per measurement and a readable line.
 */

import { spawnGpuWorker } from "../host/local_port.ts";
import { presetConfig } from "../model/config.ts";
import { describeDevice, openDevice } from "../engine/device.ts";
import { Generator, isCpuAdapter } from "../engine/generator.ts";
import { profileDecode } from "./generator_profile.ts";
import { createReadback } from "../engine/readback.ts";
import { initParams } from "../model/init.ts";
import { exportTensors, hfConfig } from "../checkpoint/checkpoint.ts";
import { writeSafetensors } from "../checkpoint/safetensors.ts";
import { GenerationManager } from "../server/generate/mod.ts";
import { JobRunner, JobStore, type TrainRequest } from "../server/jobs/mod.ts";
import { isBuiltinName } from "../data/mod.ts";
import { createApp } from "../server/routes/mod.ts";
import { LIMIT_SETTINGS } from "../server/settings.ts";
import { parseGpuRoles, trainingGpus } from "../server/gpus/roles.ts";
import { parseScopes, TokenAuth } from "../server/auth/mod.ts";
import { CHAT_TEMPLATE, type ChatMessage, renderChat } from "../data/chat.ts";
import { tokenizerConfig } from "../checkpoint/checkpoint.ts";
import { planVariants, roundOrder, type Sample, summarize, summaryLines } from "./variants.ts";

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

/** How one variant of the engine scenario decodes (its flags first, then the command's). */
export interface EngineOptions {
  chunk: number;
  /** Steps queued ahead of each readback (0: none). */
  ahead: number;
  every: number;
  lmHead: "f32" | "f16";
  readback: "canvas" | "mapasync";
  residualRows: number;
  writtenSampler: boolean;
}

/** The engine scenario's decode options from flags (a variant's first; bad values name the flag). */
export function engineOptions(a: readonly string[]): EngineOptions {
  const get = (name: string, def: string) => {
    const i = a.indexOf(`--${name}`);
    return i >= 0 && i + 1 < a.length ? a[i + 1] : def;
  };
  const chunk = +get("chunk", "16");
  if (!Number.isInteger(chunk) || chunk < 1) {
    throw new RangeError(`--chunk "${get("chunk", "")}" must be ≥ 1`);
  }
  const lmHead = get("lm-head", "f32");
  if (lmHead !== "f32" && lmHead !== "f16") throw new RangeError(`--lm-head "${lmHead}" must be f32 or f16`);
  const readback = get("readback", "canvas");
  if (readback !== "canvas" && readback !== "mapasync") {
    throw new RangeError(`--readback "${readback}" must be canvas or mapasync`);
  }
  const residualRows = +get("residual-rows", "0");
  if (!Number.isInteger(residualRows) || residualRows < 0) {
    throw new RangeError(`--residual-rows "${get("residual-rows", "")}" must be a whole number ≥ 0`);
  }
  return {
    chunk,
    ahead: get("ahead", "1") === "1" ? chunk : 0,
    every: +get("every", "4"),
    lmHead,
    readback,
    residualRows,
    writtenSampler: a.includes("--written-sampler"),
  };
}

async function engine(): Promise<void> {
  const ctx = await openDevice();
  console.log(describeDevice(ctx));
  const cpu = isCpuAdapter(ctx);
  const models = list(arg("models", cpu ? "gpt2-tiny" : "gpt2-124M,gpt2-345M"));
  const batches = list(arg("batches", cpu ? "1,4" : "1,16,64")).map(Number);
  const newTokens = +arg("new", cpu ? "32" : "128");
  const repeat = Math.max(1, Math.floor(+arg("repeat", "1")));
  const { variants, rounds } = planVariants(Deno.args, engineOptions), several = variants.length > 1;
  const readbacks = new Map<EngineOptions["readback"], Awaited<ReturnType<typeof createReadback>>>();
  for (const model of models) {
    const config = presetConfig(model);
    const params = initParams(config, 1);
    const samples: Sample[] = [];
    for (let round = 0; round < rounds; round++) {
      for (const v of roundOrder(variants, round)) {
        const o = v.options, tag = several ? ` [${v.name}]` : "";
        if (several) console.log(`variant ${v.name}, round ${round + 1} of ${rounds}:`);
        // As the server makes it (worker/serving.ts): the canvas path where its round trip is exact.
        // One per way of reading back, made once and shared by the variants that read that way.
        const readback = readbacks.get(o.readback) ??
          readbacks.set(o.readback, await createReadback(ctx, { canvas: o.readback === "canvas" })).get(
            o.readback,
          )!;
        if (round === 0) {
          console.log(
            `readback${tag}: ${readback.canvas ? "canvas path for a lone stream's chunks" : "mapAsync"}` +
              (o.readback === "canvas" && !readback.canvas
                ? ` (canvas off: ${readback.fallbackReason})`
                : ""),
          );
          if (cpu && o.lmHead === "f16") {
            console.log("A CPU adapter's LM head kernels read wte: --lm-head f16 changes nothing");
          }
        }
        const gen = await Generator.create(ctx, config, params, {
          maxStreams: Math.max(...batches),
          chunk: o.chunk,
          submitEvery: o.every,
          lmHead: o.lmHead,
          readback,
          kernels: { residualRows: o.residualRows, writtenSampler: o.writtenSampler },
        });
        if (!cpu) {
          console.log(
            `${model}${tag}: every batch bucket's decode kernels compiled in ${
              (await gen.warm()).toFixed(0)
            } ms`,
          );
        }
        const run = async (B: number, n: number, profiled = false) => {
          const hs = [];
          for (let i = 0; i < B; i++) hs.push(await gen.admit(promptOf(32, i), { ...sampling, seed: i }, n));
          const t0 = performance.now();
          let first = 0;
          // The prefill's first tokens (the first chunk then runs ahead).
          for (const out of (await gen.step(0, o.ahead)).values()) first += out.tokens.length;
          const ttft = performance.now() - t0;
          await gen.runAhead();
          const calls: string[] = [];
          let got = first;
          while (got < B * n) {
            const c0 = performance.now();
            for (const out of (await gen.step(o.chunk, o.ahead)).values()) got += out.tokens.length;
            const t = gen.timing;
            calls.push(
              `${(performance.now() - c0).toFixed(1)} (${t.steps} steps, map ${t.mapMs.toFixed(1)})`,
            );
            // The server hands the tokens out here, then queues the chunk left to run ahead.
            await gen.runAhead();
          }
          if (Deno.args.includes("--calls")) {
            console.log(`  batch ${B}, ${n} tokens, each call in ms: ${calls.join(", ")}`);
          }
          const ms = performance.now() - t0;
          // Kernel by kernel after the timed run, the streams still at its end (one step replayed).
          const profile = profiled && Deno.args.includes("--profile") && ctx.hasTimestamps
            ? await profileDecode(gen)
            : null;
          for (const h of hs) gen.release(h);
          return { tokens: got, ms, ttft, decode: (got - first) / ((ms - ttft) / 1000), profile };
        };
        for (const B of batches) {
          await run(B, newTokens); // warm-up: compiles this batch's plans (and lets the GPU's clocks rise)
          const runs: Awaited<ReturnType<typeof run>>[] = [];
          for (let i = 0; i < repeat; i++) {
            runs.push(await run(B, newTokens, i === repeat - 1 && round === rounds - 1));
          }
          for (const r of runs) samples.push({ variant: v.name, key: `batch ${B}`, value: r.decode });
          printEngineBatch(model, B, o, v.name, several, runs);
        }
        gen.destroy();
      }
    }
    if (several) {
      console.log("");
      const rows = summarize(samples, variants.map((v) => v.name), true);
      for (const line of summaryLines(rows, `${model} decode tokens/s`, true)) console.log(line);
    }
    if (Deno.args.includes("--torch")) {
      // The first variant's decode rate (the median over all its runs) against each peer.
      const ours = new Map(batches.map((B) => {
        const xs = samples.filter((s) => s.variant === variants[0].name && s.key === `batch ${B}`);
        return [B, median(xs.map((s) => s.value))];
      }));
      for (const dtype of ["fp32", "bf16"] as const) {
        const peer = await torchPeer(model, batches, newTokens, dtype);
        if (typeof peer === "string") {
          console.log(`  PyTorch CUDA graph ${dtype}: ${peer}`);
          continue;
        }
        for (const p of peer.values()) {
          const mine = ours.get(p.batch);
          console.log(`  PyTorch CUDA graph ${dtype}: ${JSON.stringify(p)}`);
          if (!mine) continue;
          // Both decode rates: the peer replays decode steps from a filled cache, no prefill.
          const ratio = mine / p.tokens_per_s;
          console.log(
            `  ${model} batch ${p.batch}: ours${several ? ` (${variants[0].name})` : ""} ${
              mine.toFixed(0)
            } tokens/s decoding, ${dtype} CUDA-graph peer ${p.tokens_per_s.toFixed(0)}: ${ratio.toFixed(2)}×`,
          );
          if (dtype === "bf16" && model === "gpt2-124M" && p.batch === 1) {
            console.log(`ratio vs bf16 CUDA-graph peer (1 stream decode): ${ratio.toFixed(2)}`);
          }
        }
      }
    }
  }
  for (const r of readbacks.values()) r.destroy();
  ctx.device.destroy();
}

/** One batch's runs of one variant: a JSON line, a readable line, and the profile if it was taken. */
function printEngineBatch(
  model: string,
  B: number,
  o: EngineOptions,
  variant: string,
  several: boolean,
  runs: {
    tokens: number;
    ms: number;
    ttft: number;
    decode: number;
    profile: { label: string; ms: number }[] | null;
  }[],
): void {
  const pick = (f: (r: (typeof runs)[number]) => number) => {
    const xs = runs.map(f).sort((a, b) => a - b);
    return { median: median(xs), min: xs[0], max: xs[xs.length - 1] };
  };
  const total = pick((r) => r.tokens / (r.ms / 1000)), decode = pick((r) => r.decode);
  const ttft = pick((r) => r.ttft);
  const profile = runs[runs.length - 1].profile;
  const res = {
    scenario: "engine",
    model,
    batch: B,
    ...(several ? { variant } : {}),
    lm_head: o.lmHead,
    readback: o.readback,
    runs: runs.length,
    tokens_per_s: total.median,
    decode_tokens_per_s: decode.median,
    decode_tokens_per_s_min: decode.min,
    decode_tokens_per_s_max: decode.max,
    ttft_ms: ttft.median,
  };
  console.log(JSON.stringify(res));
  const spread = runs.length > 1
    ? ` (${runs.length} runs, ${decode.min.toFixed(0)}-${decode.max.toFixed(0)})`
    : "";
  console.log(
    `${model}${several ? ` [${variant}]` : ""} batch ${B} (LM head ${o.lmHead}): decoding ${
      res.decode_tokens_per_s.toFixed(0)
    } tokens/s${spread}; ${
      res.tokens_per_s.toFixed(0)
    } tokens/s from admission (the prefill of ${B} × 32 tokens included), ` +
      `time to first token ${res.ttft_ms.toFixed(1)} ms`,
  );
  if (!profile) return;
  // Kernel families: the label without its layer, e.g. "dec.l3.fc.gemv" -> "fc.gemv".
  const fam = new Map<string, { n: number; ms: number }>();
  for (const k of profile) {
    const key = k.label.replace(/^dec\.(l\d+\.)?/, "");
    const f = fam.get(key) ?? { n: 0, ms: 0 };
    f.n++;
    f.ms += k.ms;
    fam.set(key, f);
  }
  const sum = profile.reduce((a, k) => a + k.ms, 0);
  console.log(
    `  one decode step, kernel by kernel: ${profile.length} kernels, ${sum.toFixed(3)} ms of GPU time, ` +
      `each kernel in a pass of its own (the timed runs: ${
        (1000 / (res.decode_tokens_per_s / B)).toFixed(3)
      } ms a decode step)`,
  );
  for (const [k, f] of [...fam].sort((a, b) => b[1].ms - a[1].ms)) {
    console.log(
      `    ${k.padEnd(16)} ${String(f.n).padStart(3)} × ${(f.ms / f.n * 1000).toFixed(1).padStart(7)} µs = ${
        f.ms.toFixed(3)
      } ms`,
    );
  }
}

/** What bench/torch_decode.py prints per batch. */
interface PeerResult {
  model: string;
  dtype: "fp32" | "bf16";
  batch: number;
  new_tokens: number;
  tokens_per_s: number;
  step_ms: number;
}

/**
 * The PyTorch CUDA-graph peer (bench/torch_decode.py, decode steps only) at each batch, keyed by
 * batch; a string saying why when it could not run (no python3, no torch, no CUDA, a model it
 * does not know). Its stderr passes through.
 */
async function torchPeer(
  model: string,
  batches: number[],
  n: number,
  dtype: "fp32" | "bf16" = "fp32",
): Promise<Map<number, PeerResult> | string> {
  let out: Deno.CommandOutput;
  try {
    out = await new Deno.Command("python3", {
      args: [
        "bench/torch_decode.py",
        "--model",
        model,
        "--batches",
        batches.join(","),
        "--new-tokens",
        `${n}`,
        "--dtype",
        dtype,
      ],
      cwd: new URL("..", import.meta.url).pathname,
      stderr: "inherit",
    }).output();
  } catch (e) {
    return `cannot run python3: ${(e as Error).message}`;
  }
  const results = new Map<number, PeerResult>();
  for (const line of new TextDecoder().decode(out.stdout).split("\n")) {
    if (!line.startsWith("{")) continue;
    const r = JSON.parse(line) as PeerResult;
    results.set(r.batch, r);
  }
  if (!out.success && results.size === 0) return `bench/torch_decode.py exited with status ${out.code}`;
  return results;
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
  const manager = new GenerationManager(runner.pool, root, { maxWaiting: 4096, roles });
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

/**
 * How the http scenario's requests are made: the bearer token every request carries (none: no
 * header), and which endpoint with which prompt ("ids": /v1/completions with `promptLength` token
 * ids; "text": /v1/completions with the chat template's rendering of `chatMessages(seed)`;
 * "chat": /v1/chat/completions with those messages).
 */
interface RequestStyle {
  token?: string;
  prompt: "ids" | "text" | "chat";
}

/** One user message of about 30 tokens, different per seed. */
const chatMessages = (seed: number): ChatMessage[] => [{
  role: "user",
  content: `Request ${seed}: summarise in a few sentences what a language model learns when it reads ` +
    `a great deal of text, and what it cannot learn that way.`,
}];

/**
 * One streaming completion of a `promptLength`-token prompt: its status (a 429 is counted, not
 * thrown; any other refusal throws), time to first token and tokens received.
 */
async function stream(
  url: string,
  model: string,
  n: number,
  seed: number,
  promptLength = 32,
  style: RequestStyle = { prompt: "ids" },
) {
  const t0 = performance.now();
  const common = { model, max_tokens: n, ...sampling, seed, ignore_eos: true, stream: true };
  const body = style.prompt === "chat"
    ? { ...common, messages: chatMessages(seed), stream_options: { include_usage: true } }
    : {
      ...common,
      prompt: style.prompt === "text" ? renderChat(chatMessages(seed), true) : promptOf(promptLength, seed),
      stream_options: { include_usage: true },
    };
  const res = await fetch(`${url}/v1/${style.prompt === "chat" ? "chat/completions" : "completions"}`, {
    method: "POST",
    headers: {
      "Content-Type": "application/json",
      ...(style.token ? { Authorization: `Bearer ${style.token}` } : {}),
    },
    body: JSON.stringify(body),
  });
  // The answer's headers: the server has taken the request in, handed it to the GPU host and begun
  // its stream (what lies before the first token but the GPU's part and the way back).
  const headers = performance.now() - t0;
  if (res.status === 429) {
    return { status: 429, error: await res.text(), ttft: NaN, headers, tokens: 0, times: [] as number[] };
  }
  if (!res.ok) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  let tokens = 0, buf = "";
  /** When each text chunk arrived; `first`: the first chunk with text or an end (a token's text may be held back). */
  const times: number[] = [];
  let first = NaN;
  const dec = new TextDecoder();
  for await (const chunk of res.body!) {
    buf += dec.decode(chunk, { stream: true });
    for (let i = buf.indexOf("\n\n"); i >= 0; i = buf.indexOf("\n\n")) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
      const d = JSON.parse(ev.slice(6));
      const c = d.choices?.[0];
      const text = c?.text || c?.delta?.content;
      if (text) times.push(performance.now());
      if ((text || c?.finish_reason) && Number.isNaN(first)) first = performance.now();
      if (d.usage) tokens = d.usage.completion_tokens;
    }
  }
  return { status: res.status, error: "", ttft: first - t0, headers, tokens, times };
}

/**
 * S concurrent streams (seeds `seed0`…): aggregate tokens/s from the requests to the last token,
 * time to first token p50 and max, the decode rate once every stream has begun, and 429s.
 */
async function concurrent(
  url: string,
  model: string,
  S: number,
  n: number,
  seed0 = 0,
  style: RequestStyle = { prompt: "ids" },
) {
  const t0 = performance.now();
  const all = await Promise.all(
    Array.from({ length: S }, (_, i) => stream(url, model, n, seed0 + i, 32, style)),
  );
  const ms = performance.now() - t0;
  const rs = all.filter((r) => r.status === 200);
  const tokens = rs.reduce((a, r) => a + r.tokens, 0);
  const ttfts = rs.map((r) => r.ttft);
  // Decoding alone: the chunks that arrived once every stream had its first, over that time.
  const begun = Math.max(...rs.map((r) => r.times[0] ?? Infinity));
  const after = rs.reduce((a, r) => a + r.times.filter((t) => t > begun).length, 0);
  return {
    tokens_per_s: tokens / (ms / 1000),
    decode_tokens_per_s: after / ((t0 + ms - begun) / 1000),
    ttft_p50_ms: median(ttfts),
    ttft_max_ms: Math.max(...ttfts),
    headers_p50_ms: median(rs.map((r) => r.headers)),
    tokens,
    refused_429: all.length - rs.length,
  };
}

// ---------------------------------------------------------------------------------------------
// http: fresh servers, as users start them.

/** The permission flags of deno.json's `serve` task, so the server runs as `deno task serve` runs it. */
async function serveFlags(): Promise<string[]> {
  const json = JSON.parse(await Deno.readTextFile(new URL("../deno.json", import.meta.url)));
  const task = json.tasks?.serve;
  const line: string = typeof task === "string" ? task : task?.command ?? "";
  const words = line.trim().split(/\s+/);
  const run = words.indexOf("run"), main = words.findIndex((w) => w.endsWith("main.ts"));
  if (run < 0 || main < run) throw new Error(`Cannot read the serve task of deno.json: "${line}"`);
  return words.slice(run + 1, main);
}

/**
 * Settings a caller may have exported that would make the server differ from the default one a
 * user starts: every limit, auth, trusted proxies. They are left out of the server's environment.
 */
const NOT_DEFAULT = [
  ...Object.values(LIMIT_SETTINGS),
  "GPT2_API_TOKEN",
  "GPT2_API_TOKEN_FILE",
  "GPT2_TRUSTED_PROXIES",
  "GPT2_HOME",
  "GPT2_SOURCES",
  "PORT",
  "HOST",
];

/** A `deno task serve` subprocess on a loopback port of its own, over data directory `home`. */
interface ServeProcess {
  url: string;
  child: Deno.ChildProcess;
  /** Spawn to the "listening on" line, ms. */
  startMs: number;
  /** The server's last 200 lines of output (stdout and stderr), for errors. */
  log: string[];
  close(): Promise<void>;
}

/** Starts main.ts with the serve task's flags, `env`, PORT=0 and GPT2_HOME=`home`. */
async function serve(home: string, env: Record<string, string>, relay: boolean): Promise<ServeProcess> {
  const t0 = performance.now();
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", ...await serveFlags(), "main.ts"],
    cwd: new URL("..", import.meta.url).pathname,
    env: { ...env, PORT: "0", HOST: "127.0.0.1", GPT2_HOME: home },
    clearEnv: true,
    stdin: "null",
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const log: string[] = [];
  let listening: (url: string) => void;
  const url = new Promise<string>((r) => listening = r);
  const read = async (body: ReadableStream<Uint8Array<ArrayBuffer>>) => {
    let buf = "";
    for await (const text of body.pipeThrough(new TextDecoderStream())) {
      buf += text;
      for (let i = buf.indexOf("\n"); i >= 0; i = buf.indexOf("\n")) {
        const line = buf.slice(0, i);
        buf = buf.slice(i + 1);
        log.push(line);
        if (log.length > 200) log.shift();
        if (relay) console.log(`  server: ${line}`);
        const m = line.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
        if (m) listening(m[1]);
      }
    }
  };
  const reading = Promise.all([read(child.stdout), read(child.stderr)]).catch(() => {});
  const started = await Promise.race([
    url,
    child.status.then((s) => ({ exited: s.code })),
    new Promise<null>((r) => setTimeout(() => r(null), 60_000)),
  ]);
  if (typeof started !== "string") {
    child.kill("SIGKILL");
    await child.status;
    throw new Error(
      `Server did not start: ${
        started ? `exited with status ${started.exited}` : "no listening line within 60 s"
      }` +
        `:\n${log.join("\n")}`,
    );
  }
  const close = async () => {
    try {
      child.kill("SIGTERM");
    } catch { /* already gone */ }
    // The graceful stop takes at most GPT2_SHUTDOWN_S (30 s); past that, SIGKILL.
    const timer = setTimeout(() => {
      try {
        child.kill("SIGKILL");
      } catch { /* gone */ }
    }, 40_000);
    await child.status;
    clearTimeout(timer);
    await reading;
  };
  return { url: started, child, startMs: performance.now() - t0, log, close };
}

/** Writes `model` with fresh random weights as a Hugging Face directory `dir` (config.json, model.safetensors). */
async function writeModel(dir: string, model: string, chat = false): Promise<void> {
  const config = presetConfig(model);
  await Deno.mkdir(dir, { recursive: true });
  await writeSafetensors(`${dir}/model.safetensors`, exportTensors(config, initParams(config, 1)));
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(config, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  if (chat) {
    await Deno.writeTextFile(
      `${dir}/tokenizer_config.json`,
      JSON.stringify(tokenizerConfig(config, CHAT_TEMPLATE)),
    );
  }
}

/**
 * A user's token (scope generate) made in `home`'s job store, as `deno task tokens create` makes
 * it, the user's stream quota set to `streams` as an admin would (`PUT /admin/users/:name/quotas`):
 * the figure is the token check's cost, not the quota's (16 streams a user by default).
 */
function makeUserToken(home: string, streams: number): string {
  const store = new JobStore(`${home}/jobs.sqlite`);
  try {
    const auth = new TokenAuth(store);
    const { token } = auth.create({ user: "bench", name: "bench", scopes: parseScopes("generate") });
    if (!store.setQuotas("bench", { streams })) {
      throw new Error("Could not set the bench user's stream quota");
    }
    return token;
  } finally {
    store.close();
  }
}

/** A fresh data directory under `tmp` holding the model of `src` (hard links, else copies) under models/<model>. */
async function freshHome(tmp: string, src: string, model: string, tag: string): Promise<string> {
  const home = `${tmp}/home_${tag}`;
  await Deno.mkdir(`${home}/models/${model}`, { recursive: true });
  for (const f of ["config.json", "model.safetensors", "tokenizer_config.json"]) {
    if (f === "tokenizer_config.json" && !await Deno.stat(`${src}/${f}`).catch(() => null)) continue;
    await Deno.link(`${src}/${f}`, `${home}/models/${model}/${f}`)
      .catch(() => Deno.copyFile(`${src}/${f}`, `${home}/models/${model}/${f}`));
  }
  return home;
}

/** One round's figures, as printed, with the server's mean stage times (ms) to each first token. */
type Round = Awaited<ReturnType<typeof concurrent>> & { stages_ms?: Record<string, number> };

/** The server's `gpt2_generation_stage_seconds` sums and counts, by stage (empty when /metrics lacks them). */
async function stageTotals(url: string): Promise<Map<string, { sum: number; count: number }>> {
  const out = new Map<string, { sum: number; count: number }>();
  const res = await fetch(`${url}/metrics`).catch(() => null);
  if (!res?.ok) {
    await res?.body?.cancel();
    return out;
  }
  for (const line of (await res.text()).split("\n")) {
    const m = /^gpt2_generation_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$/.exec(line);
    if (!m) continue;
    const t = out.get(m[2]) ?? { sum: 0, count: 0 };
    t[m[1] as "sum" | "count"] = Number(m[3]);
    out.set(m[2], t);
  }
  return out;
}

/** A round at `url` with the mean ms of each stage to its streams' first tokens, from /metrics around it. */
async function measuredRound(
  url: string,
  model: string,
  S: number,
  n: number,
  seed0: number,
  style: RequestStyle = { prompt: "ids" },
): Promise<Round> {
  const before = await stageTotals(url);
  const r = await concurrent(url, model, S, n, seed0, style);
  const after = await stageTotals(url);
  const stages_ms: Record<string, number> = {};
  for (const [stage, a] of after) {
    const b = before.get(stage) ?? { sum: 0, count: 0 };
    if (a.count > b.count) stages_ms[stage] = ((a.sum - b.sum) / (a.count - b.count)) * 1000;
  }
  return { ...r, stages_ms };
}

/** Waits `ms` with nothing sent: the server idles before a round as it would between users' bursts. */
const idle = (ms: number) => ms > 0 ? new Promise((r) => setTimeout(r, ms)) : Promise.resolve();

/** "http 0.4, to_host 0.1, …" (mean ms per stage), or "" without stages. */
const stageLine = (r: Round) =>
  Object.entries(r.stages_ms ?? {}).map(([k, v]) => `${k} ${v.toFixed(2)}`).join(", ");

const fmt = (x: number | null | undefined, digits = 0) =>
  x === null || x === undefined || !Number.isFinite(x) ? "-" : x.toFixed(digits);

function roundLine(model: string, S: number, round: string, r: Round): string {
  return `${model} over HTTP, ${S} streams, ${round}: ${fmt(r.tokens_per_s)} tokens/s aggregate, ` +
    `TTFT p50 ${fmt(r.ttft_p50_ms)} ms, max ${fmt(r.ttft_max_ms)} ms (headers p50 ${
      fmt(r.headers_p50_ms, 1)
    } ms); ` +
    `${fmt(r.decode_tokens_per_s)} tokens/s once every stream had its first token; ` +
    `${r.refused_429} answered 429`;
}

/**
 * Runs this client's own code (fetch, the event-stream parsing of `stream`) for S concurrent
 * streams of n chunks against a stub server in this process, so that the cold round measures a
 * cold server, not a cold client: a user's client is its own process, not this one's first loop.
 * The server under test sees none of it (no connection to it is opened or reused).
 */
async function warmClient(S: number, n: number): Promise<void> {
  const enc = new TextEncoder();
  const chunk = (d: unknown) => enc.encode(`data: ${JSON.stringify(d)}\n\n`);
  const stub = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, () => {
    const body = new ReadableStream<Uint8Array>({
      async start(c) {
        for (let i = 0; i < n; i++) {
          c.enqueue(chunk({ choices: [{ index: 0, text: "x", finish_reason: null }] }));
          if (i % 16 === 15) await new Promise((r) => setTimeout(r, 0));
        }
        c.enqueue(chunk({ choices: [{ index: 0, text: "", finish_reason: "length" }] }));
        c.enqueue(chunk({ choices: [], usage: { completion_tokens: n } }));
        c.enqueue(enc.encode("data: [DONE]\n\n"));
        c.close();
      },
    });
    return new Response(body, { headers: { "content-type": "text/event-stream" } });
  });
  try {
    const url = `http://127.0.0.1:${stub.addr.port}`;
    for (let i = 0; i < 3; i++) await concurrent(url, "stub", S, n, 0);
  } finally {
    await stub.shutdown();
  }
}

/** One fresh server's figures at S streams: the model's load, a cold and a warm round, and with --chat the chat pairs. */
interface ServerSample {
  S: number;
  auth: string;
  cold: Round;
  warm: Round;
  chat?: { completions: Round[]; chat: Round[] };
}

/** A fresh `deno task serve` at S streams: loads the model, then measures a cold and a warm round (and --chat's rounds). */
async function oneServer(
  o: { tmp: string; src: string; model: string; env: Record<string, string>; relay: boolean },
  S: number,
  n: number,
  auth: string,
  tag: string,
): Promise<ServerSample> {
  const { model } = o, gap = +arg("gap", "0");
  // A fresh server per count: its own data directory, GPU host, Workers and compiled kernels.
  const home = await freshHome(o.tmp, o.src, model, tag);
  const token = auth === "user" ? makeUserToken(home, S) : undefined;
  const ids: RequestStyle = { token, prompt: "ids" };
  const s = await serve(home, o.env, o.relay);
  try {
    // The model loads on first use: a 1-token prompt, 1 new token (the smallest shapes there are).
    const t0 = performance.now();
    const first = await stream(s.url, model, 1, 999_999, 1, ids);
    const loadMs = performance.now() - t0;
    if (first.status !== 200) {
      throw new Error(`The first request answered ${first.status}: ${first.error}\n${s.log.join("\n")}`);
    }
    const load = {
      scenario: "http",
      round: "load",
      model,
      streams: S,
      auth,
      start_ms: s.startMs,
      load_ms: loadMs,
    };
    console.log(JSON.stringify({ ...load, first_ever_ttft_ms: first.ttft }));
    console.log(
      `${model} over HTTP, fresh server for ${S} streams (auth: ${auth}): listening after ${
        fmt(s.startMs)
      } ms; ` +
        `the first request (1 token, loading the model) took ${fmt(loadMs)} ms, ` +
        `its first token ${fmt(first.ttft)} ms`,
    );
    await warmClient(S, n);
    await idle(gap);
    const cold = await measuredRound(s.url, model, S, n, 0, ids);
    await idle(gap);
    const warm = await measuredRound(s.url, model, S, n, S, ids);
    for (const [round, r] of [["cold", cold], ["warm", warm]] as const) {
      console.log(JSON.stringify({ scenario: "http", round, model, streams: S, auth, new_tokens: n, ...r }));
      console.log(roundLine(model, S, round, r));
      if (r.stages_ms) console.log(`  server's mean ms to the first token, by stage: ${stageLine(r)}`);
    }
    if (!Deno.args.includes("--chat")) return { S, auth, cold, warm };
    // The same prompt text through both endpoints, in turns, on this warm server.
    const chat = { completions: [] as Round[], chat: [] as Round[] };
    for (let i = 0; i < 3; i++) {
      for (const prompt of ["text", "chat"] as const) {
        const r = await measuredRound(s.url, model, S, n, (2 + i) * S, { token, prompt });
        chat[prompt === "text" ? "completions" : "chat"].push(r);
        console.log(JSON.stringify({ scenario: "http", round: `warm_${prompt}`, model, streams: S, ...r }));
        console.log(
          roundLine(model, S, prompt === "text" ? "warm, /v1/completions" : "warm, /v1/chat/completions", r),
        );
      }
    }
    return { S, auth, cold, warm, chat };
  } finally {
    await s.close();
  }
}

/** --chat's comparison at S: chat's first token and tokens/s against /v1/completions', medians of the rounds. */
function chatLine(model: string, x: ServerSample): string {
  const m = (rs: Round[], pick: (r: Round) => number) => median(rs.map(pick));
  const { completions, chat } = x.chat!;
  const t = (r: Round) => r.ttft_p50_ms, tps = (r: Round) => r.tokens_per_s;
  const res = {
    scenario: "http",
    round: "chat_vs_completions",
    model,
    streams: x.S,
    completions_ttft_p50_ms: m(completions, t),
    chat_ttft_p50_ms: m(chat, t),
    ttft_ratio: m(chat, t) / m(completions, t),
    completions_tokens_per_s: m(completions, tps),
    chat_tokens_per_s: m(chat, tps),
  };
  console.log(JSON.stringify(res));
  return `${model}, ${x.S} streams, same prompt text, medians of 3 rounds each: first token p50 ` +
    `/v1/chat/completions ${fmt(res.chat_ttft_p50_ms, 1)} ms against /v1/completions ` +
    `${fmt(res.completions_ttft_p50_ms, 1)} ms (${fmt(res.ttft_ratio, 3)}×); ` +
    `${fmt(res.chat_tokens_per_s)} against ${fmt(res.completions_tokens_per_s)} tokens/s`;
}

async function http(): Promise<void> {
  const model = arg("model", "gpt2-124M"), n = +arg("new", "128");
  const streams = list(arg("streams", "1,4,16,64")).map(Number);
  const auths = list(arg("auth", "none"));
  for (const a of auths) if (a !== "none" && a !== "user") throw new Error(`Unknown --auth "${a}"`);
  const env = Deno.env.toObject();
  const dropped = NOT_DEFAULT.filter((k) => k in env);
  for (const k of dropped) delete env[k];
  if (dropped.length) console.log(`Left out of the servers' environment: ${dropped.join(", ")}`);
  const tmp = await Deno.makeTempDir({ prefix: "gpt2_genbench_" });
  const rows: { S: number; auth: string; cold: Round; warm: Round; ratio: number }[] = [];
  const repeat = Math.max(1, +arg("repeat", "1"));
  const samples: ServerSample[] = [];
  try {
    const src = `${tmp}/model`;
    await writeModel(src, model, Deno.args.includes("--chat"));
    const o = { tmp, src, model, env, relay: Deno.args.includes("--log") };
    // Each count's servers one after another, the auth modes in turns (none, user, none, user, …).
    for (const S of streams) {
      for (let i = 0; i < repeat; i++) {
        for (const auth of auths) samples.push(await oneServer(o, S, n, auth, `${S}_${samples.length}`));
      }
    }
  } finally {
    await Deno.remove(tmp, { recursive: true });
  }
  for (const x of samples) if (x.chat) console.log(chatLine(model, x));
  // One row per count and auth mode: each figure's median over the servers (the sample itself when one).
  for (const S of streams) {
    for (const auth of auths) {
      const of = samples.filter((x) => x.S === S && x.auth === auth);
      const mid = (pick: (x: ServerSample) => Round) => {
        const m = (f: (r: Round) => number) => median(of.map((x) => f(pick(x))));
        return {
          ...pick(of[0]),
          tokens_per_s: m((r) => r.tokens_per_s),
          ttft_p50_ms: m((r) => r.ttft_p50_ms),
          ttft_max_ms: m((r) => r.ttft_max_ms),
          headers_p50_ms: m((r) => r.headers_p50_ms),
          refused_429: of.reduce((a, x) => a + pick(x).refused_429, 0),
        };
      };
      const ratio = median(of.map((x) => x.cold.ttft_p50_ms / x.warm.ttft_p50_ms));
      rows.push({ S, auth, cold: mid((x) => x.cold), warm: mid((x) => x.warm), ratio });
      if (repeat > 1) {
        const ratios = of.map((x) => (x.cold.ttft_p50_ms / x.warm.ttft_p50_ms).toFixed(2)).join(", ");
        const tps = of.map((x) => x.warm.tokens_per_s.toFixed(0)).join(", ");
        console.log(
          `${model}, ${S} streams (auth: ${auth}) over ${of.length} fresh servers: cold/warm TTFT p50 ${ratios}; ` +
            `warm tokens/s ${tps}`,
        );
      }
    }
    if (auths.length > 1) {
      const [a, b] = auths.map((auth) => rows.find((r) => r.S === S && r.auth === auth)!);
      console.log(
        `${model}, ${S} streams: warm tokens/s ${b.auth} / ${a.auth} ${
          fmt(b.warm.tokens_per_s / a.warm.tokens_per_s, 3)
        }, ` +
          `cold ${fmt(b.cold.tokens_per_s / a.cold.tokens_per_s, 3)} (medians over ${repeat} servers each)`,
      );
    }
  }

  // The peer runs once every server has exited, so it has the GPU to itself.
  const peer = Deno.args.includes("--torch") ? await torchPeer(model, streams, n) : null;
  if (typeof peer === "string") console.log(`PyTorch CUDA-graph peer: ${peer}`);
  const peerOf = (S: number) => (peer instanceof Map ? peer.get(S) : undefined);
  if (peer instanceof Map) {
    for (const { S, cold, warm } of rows) {
      const p = peerOf(S);
      if (!p) continue;
      const res = {
        scenario: "http",
        round: "peer",
        model,
        streams: S,
        peer_tokens_per_s: p.tokens_per_s,
        peer_step_ms: p.step_ms,
        cold_ratio: cold.tokens_per_s / p.tokens_per_s,
        warm_ratio: warm.tokens_per_s / p.tokens_per_s,
      };
      console.log(JSON.stringify(res));
      console.log(
        `${model}, ${S} streams: PyTorch CUDA graph fp32 ${
          fmt(p.tokens_per_s)
        } tokens/s (decode steps only); ` +
          `ours over HTTP ${fmt(res.cold_ratio, 2)}× cold, ${fmt(res.warm_ratio, 2)}× warm`,
      );
    }
  }

  const head = [
    "S",
    "auth",
    "cold tok/s",
    "cold TTFT p50",
    "warm tok/s",
    "warm TTFT p50",
    "cold/warm TTFT",
    "peer tok/s",
    "ratio",
    "429s",
  ];
  const table = rows.map(({ S, auth, cold, warm, ratio }) => {
    const p = peerOf(S);
    return [
      String(S),
      auth,
      fmt(cold.tokens_per_s),
      `${fmt(cold.ttft_p50_ms)} ms`,
      fmt(warm.tokens_per_s),
      `${fmt(warm.ttft_p50_ms)} ms`,
      `${fmt(ratio, 2)}×`,
      fmt(p?.tokens_per_s),
      p ? `${fmt(warm.tokens_per_s / p.tokens_per_s, 2)}×` : "-",
      String(cold.refused_429 + warm.refused_429),
    ];
  });
  const widths = head.map((h, i) => Math.max(h.length, ...table.map((r) => r[i].length)));
  console.log(
    `\n${model} over HTTP, one client at default limits, ${n} new tokens per stream (ratio: warm / peer)` +
      (repeat > 1 ? `; medians over ${repeat} fresh servers per count` : ""),
  );
  for (const r of [head, widths.map((w) => "-".repeat(w)), ...table]) {
    console.log(`| ${r.map((c, i) => c.padStart(widths[i])).join(" | ")} |`);
  }
  const refused = rows.reduce((a, r) => a + r.cold.refused_429 + r.warm.refused_429, 0);
  if (refused > 0) {
    console.error(`${refused} requests answered 429 at the default limits: one client should fill the batch`);
    Deno.exit(1);
  }
}

/** The training job the train scenario runs beside generation (batch 8 × 1024, as Megatron's 345M). */
function trainingRequest(trainModel: string): TrainRequest {
  return {
    model: trainModel,
    dataset: "sotu",
    split: "949,50,1",
    train_iters: 1_000_000,
    batch_size: +arg("train-batch", "8"),
    seq_len: +arg("train-seq", "1024"),
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
}

/**
 * `train --cold-load`: a model's first request while a job trains on the same GPU (the model not
 * loaded yet: its load, compile and warm-up happen beside training), then lone requests once it is
 * loaded, still beside training, and the same lone requests with the GPU idle: first-token times.
 */
async function coldLoad(
  s: Awaited<ReturnType<typeof server>>,
  model: string,
  trainModel: string,
  n: number,
): Promise<void> {
  const job = await s.runner.submit(trainingRequest(trainModel));
  let progress = 0;
  s.runner.subscribe(job.id, (e) => {
    if (e.type === "progress") progress++;
  });
  const t0 = performance.now();
  while (progress < 3) {
    if (performance.now() - t0 > 240_000) {
      throw new Error("Training did not report progress within 4 minutes");
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  const first = await stream(s.url, model, n, 1);
  const beside: number[] = [];
  for (let i = 0; i < 5; i++) beside.push((await stream(s.url, model, n, 10 + i)).ttft);
  s.runner.cancel(job.id);
  while (s.runner.gpus().some((g) => g.job !== null)) await new Promise((r) => setTimeout(r, 100));
  const idle: number[] = [];
  for (let i = 0; i < 5; i++) idle.push((await stream(s.url, model, n, 20 + i)).ttft);
  const res = {
    scenario: "train-cold-load",
    model,
    train_model: trainModel,
    first_token_cold_load_beside_training_ms: first.ttft,
    ttft_loaded_beside_training_p50_ms: median(beside),
    ttft_idle_p50_ms: median(idle),
    loaded_beside_over_idle: median(beside) / median(idle),
  };
  console.log(JSON.stringify(res));
  console.log(
    `${model}'s first request beside ${trainModel} training (model not loaded): first token in ${
      (first.ttft / 1000).toFixed(2)
    } s; loaded, beside training: ${median(beside).toFixed(1)} ms p50; idle GPU: ${
      median(idle).toFixed(1)
    } ms ` +
      `p50 (${res.loaded_beside_over_idle.toFixed(2)}×)`,
  );
}

async function train(): Promise<void> {
  const model = arg("model", "gpt2-124M"), trainModel = arg("train-model", "gpt2-345M");
  const n = +arg("new", "128"), S = +arg("streams", "16");
  const s = await server(model);
  if (Deno.args.includes("--cold-load")) {
    return await coldLoad(s, model, trainModel, n).finally(() => s.close());
  }
  try {
    await stream(s.url, model, 8, 999);
    await concurrent(s.url, model, S, 20);
    const alone = await concurrent(s.url, model, S, n);
    const job = await s.runner.submit(trainingRequest(trainModel));
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

if (import.meta.main) {
  if (scenario === "engine") await engine();
  else if (scenario === "http") await http();
  else await train();
  Deno.exit(0);
}
