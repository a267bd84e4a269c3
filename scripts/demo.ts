/**
 * `deno task demo`: a newcomer's first command. It prepares the built-in `sotu` dataset, starts
 * the server, trains a small model for a few minutes on whatever WebGPU adapter it finds (a tiny
 * one on a CPU adapter such as lavapipe), prints progress from the event stream, streams a text
 * sample from the trained checkpoint (GET /generate), and stops the server. It prints the
 * dashboard's URL (GET /), where the same job shows as curves; `--keep` leaves the server running
 * after the demo (until Ctrl-C) so the newcomer can open it.
 *
 * Environment: GPT2_HOME (default ./.gpt2), PORT (default: any free port), DEMO_ITERS.
 */

import { prepareDataset } from "../data/mod.ts";

const home = Deno.env.get("GPT2_HOME") || "./.gpt2";
const keep = Deno.args.includes("--keep");
for (const arg of Deno.args) {
  if (arg !== "--keep") {
    console.error(`Unknown argument "${arg}": expected --keep`);
    Deno.exit(2);
  }
}
const cpuPattern = /llvmpipe|lavapipe|swiftshader|software|cpu/i;

function fmt(x: unknown, digits = 3): string {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "-";
}

async function startServer(): Promise<{ url: string; child: Deno.ChildProcess }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", new URL("../main.ts", import.meta.url).pathname],
    env: { PORT: Deno.env.get("PORT") ?? "0", GPT2_HOME: home, HOST: "127.0.0.1" },
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let seen = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error(`Server exited before listening: ${seen}`);
    seen += value;
    const m = seen.match(/listening on (http:\/\/[^/\s]+)\//);
    if (m) {
      (async () => {
        while (!(await reader.read()).done) { /* drain */ }
      })();
      return { url: m[1], child };
    }
  }
}

/** Reads server-sent events from `res`, calling `on(event, data)` for each; stops when it returns true. */
async function readEvents(res: Response, on: (event: string, data: string) => boolean): Promise<void> {
  const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const type = block.match(/^event: (.*)$/m)?.[1];
      const raw = block.match(/^data: (.*)$/m)?.[1];
      if (type && raw && on(type, raw)) {
        await reader.cancel();
        return;
      }
    }
  }
}

/** Streams a sample from the job's newest checkpoint to the terminal. */
async function streamSample(url: string, jobId: string, maxTokens: number): Promise<boolean> {
  const prompt = "Fellow citizens, the state of our Union is";
  const q = new URLSearchParams({
    model: jobId,
    prompt,
    max_tokens: String(maxTokens),
    temperature: "0.8",
    top_k: "40",
  });
  const res = await fetch(`${url}/generate?${q}`);
  if (res.status !== 200) {
    console.error(`Generation was refused (HTTP ${res.status}): ${await res.text()}`);
    return false;
  }
  const out = (s: string) => Deno.stdout.writeSync(new TextEncoder().encode(s));
  out(`   ${prompt}`);
  let ok = false;
  await readEvents(res, (type, raw) => {
    const d = JSON.parse(raw);
    if (type === "token") out(d.text.replaceAll("\n", "\n   "));
    if (type !== "done") return false;
    ok = d.finish_reason !== "error";
    const t = d.timings;
    console.log(
      `\n   [${d.finish_reason}${d.error ? `: ${d.error}` : ""}] ${d.completion_tokens} tokens, first after ${
        fmt(t.ttft_ms, 0)
      } ms, ${fmt(t.tokens_per_s, 1)} tokens/s`,
    );
    return true;
  });
  return ok;
}

async function main(): Promise<number> {
  console.log(`1. Preparing the "sotu" dataset in ${home} (cached after the first run)`);
  let lastStage = "";
  const info = await prepareDataset(home, { builtin: "sotu" }, {}, (p) => {
    if (p.stage !== lastStage) console.log(`   ${p.stage}...`);
    lastStage = p.stage;
  });
  console.log(
    `   ${info.documents} speeches, ${info.tokens} tokens (train ${info.splits.train}, valid ${info.splits.valid}, test ${info.splits.test})`,
  );

  console.log("2. Starting the server");
  const { url, child } = await startServer();
  let kept = false; // the demo is over and the server kept running (--keep)
  const stop = async () => {
    try {
      child.kill("SIGTERM");
    } catch { /* gone */ }
    await child.status;
  };
  Deno.addSignalListener("SIGINT", async () => {
    console.log(
      kept
        ? "\nStopping the server"
        : "\nStopping (the job resumes from its last checkpoint next time the server starts)",
    );
    await stop();
    Deno.exit(130);
  });
  try {
    console.log(`   ${url}  (dashboard: ${url}/${keep ? "" : ", open while the demo runs, or use --keep"})`);
    let gpu: { state: string; adapter: string | null; error: string | null } | undefined;
    for (let i = 0; i < 600; i++) {
      gpu = (await (await fetch(`${url}/health`)).json()).gpus[0];
      if (gpu?.state !== "starting") break;
      await new Promise((r) => setTimeout(r, 100));
    }
    if (!gpu || gpu.state === "unavailable") {
      console.error(`No GPU to train on: ${gpu?.error ?? "the worker did not start"}`);
      return 1;
    }
    const onCpu = cpuPattern.test(gpu.adapter ?? "");
    console.log(`   adapter: ${gpu.adapter}`);
    // On a CPU adapter gpt2-tiny's loss falls from 10.5 to about 7 within 60 iterations and stays
    // there (lavapipe, 2026-12-01: 7.01 at 160, 7.05 at 240), so 160 keep the demo within 3 minutes.
    const iters = Number(Deno.env.get("DEMO_ITERS") ?? (onCpu ? 160 : 2000));
    const config = onCpu
      ? { model: "gpt2-tiny", batch_size: 4, seq_len: 32, lr: 3e-3, min_lr: 3e-4 }
      : { model: "gpt2-small-test", batch_size: 16, seq_len: 128, lr: 1e-3, min_lr: 1e-4 };
    const body = {
      ...config,
      dataset: "sotu",
      train_iters: iters,
      warmup: 0.05,
      log_interval: Math.max(1, Math.round(iters / 30)),
      eval_interval: Math.max(1, Math.round(iters / 4)),
      eval_iters: 8,
      save_interval: Math.max(1, Math.round(iters / 4)),
    };
    console.log(
      `3. Training ${config.model} for ${iters} iterations (batch ${config.batch_size} x ${config.seq_len} tokens)`,
    );
    const res = await fetch(`${url}/train`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const job = await res.json();
    if (res.status !== 202) {
      console.error(`Training was refused (HTTP ${res.status}): ${JSON.stringify(job)}`);
      return 1;
    }
    console.log(
      `   job ${job.id}: watch its curves at ${url}/#/jobs/${job.id} or run scripts/follow.sh ${job.id}`,
    );

    let outcome = null as Record<string, unknown> | null; // assigned in the callback
    await readEvents(await fetch(`${url}/jobs/${job.id}/events`), (type, raw) => {
      const d = JSON.parse(raw);
      if (type === "progress" && d.kind === "train") {
        const t = d.timings;
        const phases = t.forward_ms === null
          ? ""
          : `  (forward ${fmt(t.forward_ms, 1)}, backward ${fmt(t.backward_ms, 1)}, optimizer ${
            fmt(t.optimizer_ms, 1)
          } ms)`;
        console.log(
          `   iter ${String(d.iteration).padStart(5)}/${iters}  loss ${fmt(d.loss)}  lr ${
            d.lr.toExponential(2)
          }  ` +
            `${Math.round(d.tokens_per_s)} tok/s  step ${fmt(t.step_ms, 0)} ms${phases}`,
        );
      } else if (type === "progress" && d.kind === "eval") {
        console.log(`   ${d.split} loss ${fmt(d.loss)}  perplexity ${fmt(d.perplexity, 1)}`);
      } else if (type === "checkpoint") {
        console.log(`   checkpoint ${d.path}`);
      } else if (type === "log" && d.level === "warn") {
        console.log(`   ${d.message}`);
      } else if (type === "done") {
        outcome = d;
      }
      return outcome !== null;
    });
    if (!outcome || outcome.status !== "succeeded") {
      console.error(`Training did not succeed: ${JSON.stringify(outcome)}`);
      return 1;
    }
    console.log(
      `4. Done: loss ${fmt(outcome.loss)}, validation ${fmt(outcome.val_loss)}, test ${
        fmt(outcome.test_loss)
      }.`,
    );
    console.log(`   Checkpoints (Hugging Face safetensors + config.json): ${home}/checkpoints/${job.id}/`);
    console.log(`5. A sample from the model (scripts/generate.sh ${job.id} "your prompt" for more)`);
    return (await streamSample(url, job.id, onCpu ? 40 : 120)) ? 0 : 1;
  } finally {
    if (keep) {
      kept = true;
      console.log(`\nThe server keeps running: open the dashboard at ${url}/ (Ctrl-C stops it)`);
      await child.status;
    }
    await stop();
  }
}

Deno.exit(await main());
