/**
 * Kernel compilation is reported as it goes: a gpt2-tiny job through the runner and a real GPU
 * Worker, with Mesa's shader cache disabled, sends `compile` events whose count of pipelines
 * reaches the total it announced, before its first step; and the reporter's throttle and its
 * per-adapter marker of first runs (no GPU needed).
 */

import assert from "node:assert/strict";
import type { JobEvent, TrainRequest } from "../../server/jobs/mod.ts";
import type { CompileReport } from "../../protocol.ts";
import { compileReporter, driverCacheDisabled } from "../../worker/compile_report.ts";
import { noGpu } from "../_helpers.ts";
import { withWorkerRunner } from "../_runner.ts";

const job: TrainRequest = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 2,
  batch_size: 2,
  seq_len: 32,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0,
  hidden_dropout: 0,
  seed: 3,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  keep_checkpoints: 1,
};

Deno.test({
  name:
    "a job's compile events count its pipelines up to the total announced, with the shader cache disabled",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    // Read by Mesa when the Worker opens its device, and by the Worker for its reports.
    const saved = Deno.env.get("MESA_SHADER_CACHE_DISABLE");
    Deno.env.set("MESA_SHADER_CACHE_DISABLE", "true");
    try {
      await withWorkerRunner("gpt2_compile_", 1, async (runner, root) => {
        const submitted = await runner.submit(job);
        const seen: JobEvent[] = [];
        const done = await new Promise<JobEvent>((resolve) => {
          const off = runner.subscribe(submitted.id, (e) => {
            seen.push(e);
            if (e.type === "done") {
              off();
              resolve(e);
            }
          });
        });
        assert.equal(done.data.status, "succeeded", JSON.stringify(done.data));
        const compiles = seen.filter((e) => e.type === "compile").map((e) =>
          e.data as unknown as CompileReport
        );
        assert.ok(compiles.length > 0, "no compile events");
        const total = compiles[0].total;
        assert.ok(total > 0);
        for (const c of compiles) {
          assert.equal(c.total, total, "the total changed during one build");
          assert.equal(c.cache_disabled, true);
          assert.equal(c.first_run, true);
          assert.ok(c.adapter.length > 0);
          assert.ok(c.ms >= 0);
        }
        assert.equal(compiles[0].done, 1);
        assert.equal(compiles.at(-1)!.done, total, "the last report does not reach the total");
        for (let i = 1; i < compiles.length; i++) assert.ok(compiles[i].done > compiles[i - 1].done);
        // All of them before the first step, and stored for replay.
        const firstProgress = seen.findIndex((e) => e.type === "progress");
        const lastCompile = seen.findLastIndex((e) => e.type === "compile");
        assert.ok(lastCompile < firstProgress, "compilation reported after training started");
        const stored = runner.store.eventsAfter(submitted.id).filter((e) => e.type === "compile");
        assert.deepEqual(stored.map((e) => e.data), compiles);
        // A disabled cache records no first run: the next run compiles in full again.
        assert.deepEqual(
          [...await Array.fromAsync(Deno.readDir(root))].map((e) => e.name).includes("kernel-cache"),
          false,
        );
      });
    } finally {
      if (saved === undefined) Deno.env.delete("MESA_SHADER_CACHE_DISABLE");
      else Deno.env.set("MESA_SHADER_CACHE_DISABLE", saved);
    }
  },
});

Deno.test("compileReporter() sends the first and last reports and at most one per interval between, and marks a completed build", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_kernels_" });
  try {
    const make = async (sent: CompileReport[], build = "b") =>
      await compileReporter({
        root,
        adapter: "llvmpipe (LLVM 15.0.6, 256 bits)",
        description: "llvmpipe [shader-f16] storage binding 2 GiB",
        build,
        cacheDisabled: false,
        send: (r) => sent.push(r),
        intervalMs: 60_000,
      });
    const sent: CompileReport[] = [];
    const listen = await make(sent);
    for (let done = 1; done <= 5; done++) listen({ done, total: 5, label: `k${done}`, ms: 10 });
    assert.deepEqual(sent.map((r) => [r.done, r.total, r.ms, r.first_run]), [[1, 5, 10, true], [
      5,
      5,
      50,
      true,
    ]]);
    // The marker is written after the last report: a new reporter of the same build is not a first run.
    const dir = `${root}/kernel-cache`;
    for (let i = 0; i < 100; i++) {
      const files = await Array.fromAsync(Deno.readDir(dir)).catch(() => []);
      if (files.length > 0) break;
      await new Promise((r) => setTimeout(r, 10));
    }
    const files = await Array.fromAsync(Deno.readDir(dir));
    assert.equal(files.length, 1);
    assert.match(files[0].name, /^llvmpipe_LLVM_15.0.6_256_bits-[0-9a-f]{8}\.json$/);
    const again: CompileReport[] = [];
    (await make(again))({ done: 1, total: 2, label: "k1", ms: 1 });
    assert.equal(again[0].first_run, false);
    const other: CompileReport[] = [];
    (await make(other, "another build"))({ done: 1, total: 2, label: "k1", ms: 1 });
    assert.equal(other[0].first_run, true);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("driverCacheDisabled() reads Mesa's boolean spellings", () => {
  const env = (v?: string) => ({ get: () => v });
  for (const v of ["true", "1", "yes", "TRUE", "y"]) assert.equal(driverCacheDisabled(env(v)), true, v);
  for (const v of [undefined, "", "0", "false", "no"]) assert.equal(driverCacheDisabled(env(v)), false, v);
});
