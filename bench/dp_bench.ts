/**
 * `deno task bench dp [--model gpt2-345M] [--batch 8] [--seq 1024] [--iters 6] [--global 16,64]`:
 * data-parallel training through the real server with `GPT2_GPUS=2`. On one GPU the two
 * Workers share it, so no speed-up is possible: what this measures is the cost of the
 * communication. For each global batch it runs DP=1 (accumulating global / batch micro-batches)
 * and DP=2 (half as many per rank), plain and with the distributed optimizer (and bf16 on the
 * wire), and reports step time, tokens/s, each rank's allreduce time and rate, and GPU memory per
 * rank. From those it estimates the DP=2 speed-up on two GPUs (each rank computing its half in
 * parallel, plus the measured exchange time the backward pass did not hide) and the global batch
 * at which it passes 1.8×. The exchange overlaps the backward pass unless the variant says "no
 * overlap" (`overlap_grad_reduce: false`); the share hidden is 1 − exposed / allreduce time.
 *
 * Variants (`--variants`, comma-separated): dp (DP=1, DP=2, DP=2 no overlap, bf16 wire,
 * distributed optimizer), overlap (DP=1, DP=2 and bf16 wire each with and without overlap), tp (TP=2).
 */

import { follow, startServer, submit } from "../tests/_server.ts";

const args = new Map<string, string>();
for (let i = 0; i < Deno.args.length; i += 2) args.set(Deno.args[i].replace(/^--/, ""), Deno.args[i + 1]);
const model = args.get("model") ?? "gpt2-345M";
const batch = Number(args.get("batch") ?? "8");
const seq = Number(args.get("seq") ?? "1024");
const iters = Number(args.get("iters") ?? "6");
const globals = (args.get("global") ?? "16").split(",").map(Number);
/** Which variants to run (see above). */
const kinds = (args.get("variants") ?? "dp").split(",");

interface Row {
  label: string;
  global: number;
  dp: number;
  step_ms: number;
  tokens_per_s: number;
  allreduce_ms: number;
  /** Mean over ranks of the exposed part of the allreduce (no backward work left under it). */
  exposed_ms: number;
  gbps: string;
  memory_gib: number;
}

const home = await Deno.makeTempDir({ prefix: "gpt2_dp_bench_" });
const server = await startServer(home, { GPT2_GPUS: "2" });
const rows: Row[] = [];
try {
  for (const global of globals) {
    const variants: [string, Record<string, unknown>][] = [["DP=1", { data_parallel: 1 }]];
    if (kinds.includes("dp")) {
      variants.push(
        ["DP=2", { data_parallel: 2 }],
        ["DP=2 no overlap", { data_parallel: 2, overlap_grad_reduce: false }],
        ["DP=2 bf16 wire", { data_parallel: 2, allreduce_dtype: "bf16" }],
        ["DP=2 distributed optimizer", { data_parallel: 2, distributed_optimizer: true }],
      );
    }
    if (kinds.includes("overlap")) {
      variants.push(
        ["DP=2", { data_parallel: 2 }],
        ["DP=2 no overlap", { data_parallel: 2, overlap_grad_reduce: false }],
        ["DP=2 bf16 wire", { data_parallel: 2, allreduce_dtype: "bf16" }],
        ["DP=2 bf16 wire no overlap", {
          data_parallel: 2,
          allreduce_dtype: "bf16",
          overlap_grad_reduce: false,
        }],
      );
    }
    if (kinds.includes("tp")) variants.push(["TP=2", { data_parallel: 1, tensor_parallel: 2 }]);
    for (const [label, extra] of variants) {
      const id = await submit(server.url, {
        model,
        dataset: "sotu",
        train_iters: iters,
        batch_size: batch,
        seq_len: seq,
        global_batch_size: global,
        log_interval: Math.max(1, Math.floor(iters / 2)),
        eval_interval: 0,
        eval_iters: 1,
        save_interval: 0,
        keep_checkpoints: 1,
        attention_dropout: 0,
        hidden_dropout: 0,
        ...extra,
      });
      let last: Record<string, unknown> | null = null;
      await follow(`${server.url}/jobs/${id}/events`, 0, (e) => {
        if (e.event === "progress" && e.data.kind === "train") last = e.data;
        if (e.event === "done") {
          if (e.data.status !== "succeeded") throw new Error(`${label}: ${JSON.stringify(e.data)}`);
          return true;
        }
      });
      const p = last as unknown as {
        tokens_per_s: number;
        timings: { step_ms: number; allreduce_ms: number };
        gpu_memory_bytes: number;
        ranks?: {
          allreduce_gb_per_s: number | null;
          allreduce_exposed_ms?: number;
          tp_exchange_ms?: number;
          tp_allreduces?: number;
        }[];
      };
      if (extra.tensor_parallel) {
        const r = p.ranks?.[0];
        console.log(
          `${label}: ${r?.tp_allreduces?.toFixed(0)} activation allreduces per step, ${
            r?.tp_exchange_ms?.toFixed(0)
          } ms ` +
            `of exchanges per step (${
              ((r?.tp_exchange_ms ?? 0) / Math.max(1, r?.tp_allreduces ?? 1)).toFixed(1)
            } ms each)`,
        );
      }
      const row: Row = {
        label,
        global,
        dp: Number(extra.data_parallel),
        step_ms: p.timings.step_ms,
        tokens_per_s: p.tokens_per_s,
        allreduce_ms: p.timings.allreduce_ms,
        exposed_ms: p.ranks?.length
          ? p.ranks.reduce((a, r) => a + (r.allreduce_exposed_ms ?? 0), 0) / p.ranks.length
          : 0,
        gbps: p.ranks?.map((r) => r.allreduce_gb_per_s?.toFixed(2) ?? "-").join("/") ?? "-",
        memory_gib: p.gpu_memory_bytes / 2 ** 30,
      };
      rows.push(row);
      console.log(JSON.stringify(row));
    }
  }
} finally {
  server.child.kill("SIGTERM");
  await server.child.status;
  await Deno.remove(home, { recursive: true }).catch(() => {});
}

console.log(
  `\nData parallel through the server, ${model}, micro-batch ${batch} × ${seq}, GPT2_GPUS=2 on one GPU`,
);
console.log(
  "global  variant                        step ms   tokens/s  allreduce ms  exposed ms  hidden  GB/s per rank  GiB/rank",
);
const hidden = (r: Row) =>
  r.allreduce_ms > 0 ? Math.min(1, Math.max(0, 1 - r.exposed_ms / r.allreduce_ms)) : 0;
for (const r of rows) {
  console.log(
    `${String(r.global).padStart(6)}  ${r.label.padEnd(29)} ${r.step_ms.toFixed(0).padStart(8)} ${
      r.tokens_per_s.toFixed(0).padStart(10)
    } ${r.allreduce_ms.toFixed(0).padStart(13)} ${r.exposed_ms.toFixed(0).padStart(11)} ${
      r.dp > 1 ? `${(hidden(r) * 100).toFixed(0)}%`.padStart(7) : "      -"
    }  ${r.gbps.padStart(13)} ${r.memory_gib.toFixed(2).padStart(9)}`,
  );
}
for (const global of globals) {
  const one = rows.find((r) => r.global === global && r.label === "DP=1");
  if (!one) continue;
  const micro = one.step_ms / (global / batch);
  for (const r of rows.filter((x) => x.global === global && x.dp === 2)) {
    const perRank = global / batch / 2;
    // On two GPUs the last backward pass runs about twice as fast as on a shared one, so it hides
    // at most its own length (about 2/3 of a micro-batch) of the exchange.
    const exposed = Math.max(r.exposed_ms, r.allreduce_ms - (2 / 3) * micro);
    const est = (2 * perRank * micro) / (perRank * micro + exposed);
    const need = Math.ceil((9 * exposed) / micro) * 2 * batch;
    console.log(
      `global ${global}, ${r.label}: micro-batch ${micro.toFixed(0)} ms, exchange ${
        r.allreduce_ms.toFixed(0)
      } ms, exposed ${r.exposed_ms.toFixed(0)} ms here, ${exposed.toFixed(0)} on two GPUs -> ` +
        `estimated 2-GPU speed-up ${est.toFixed(2)}× (passes 1.8× from a global batch of ${need})`,
    );
  }
}
