/**
 * Resharding without a GPU, on checkpoints written by the real saveCheckpoint() for gpt2-tiny:
 * the round trip 1 → 2 → 4 → 1 gives back the same bytes, the copies in between hold the
 * weights and AdamW moments cut for their tp, a TP=2 checkpoint serves generation merged to
 * TP=1 in memory with exactly the same weights, refusals (existing destination, a tp that
 * cannot shard, no checkpoint) leave nothing behind, and `POST /checkpoints/reshard` and
 * `deno task reshard` answer as documented.
 */

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { type ModelConfig, paramLayout, presetConfig } from "../../model/config.ts";
import type { ControlState } from "../../engine/kernels/adamw.ts";
import { splitParams, tensorParallelConfig } from "../../engine/parallel/mod.ts";
import {
  type CheckpointState,
  loadCheckpoint,
  readManifest,
  saveCheckpoint,
} from "../../checkpoint/checkpoint.ts";
import { JobRunner, JobStore, type TrainConfig } from "../../server/jobs/mod.ts";
import { listModelSources, loadWeights, resolveModelSource } from "../../checkpoint/model_source.ts";
import { reshardByName, reshardCheckpoint, ReshardError } from "../../checkpoint/reshard.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";

/** Deterministic floats in [-1, 1) from `seed` (a 32-bit LCG; no GPU helper needed here). */
function randomFloats(n: number, seed: number): Float32Array {
  const out = new Float32Array(n);
  let x = seed >>> 0;
  for (let i = 0; i < n; i++) {
    x = (Math.imul(x, 1664525) + 1013904223) >>> 0;
    out[i] = x / 2 ** 31 - 1;
  }
  return out;
}

const train: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 100,
  batch_size: 4,
  seq_len: 32,
  lr: 6e-4,
  min_lr: 6e-5,
  lr_decay_style: "cosine",
  warmup: 0.01,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0.1,
  hidden_dropout: 0.1,
  seed: 7,
  log_interval: 10,
  eval_interval: 50,
  eval_iters: 2,
  save_interval: 10,
  keep_checkpoints: 2,
};

const control: ControlState = {
  optimizerStep: 37,
  skippedSteps: 3,
  consecutiveSkipped: 0,
  foundInf: false,
  lossScale: 65536,
  growthTracker: 12,
  hysteresisLeft: 2,
  lr: 5.5e-4,
};

/** A flat buffer as the engine keeps one: values in every tensor, zero in alignment gaps and padded wte rows. */
function engineFlat(model: ModelConfig, seed: number): Float32Array {
  const layout = paramLayout(model), out = new Float32Array(layout.totalSize);
  for (const t of layout.tensors) {
    const real = t.name === "wte.weight" ? model.vocab_size * model.n_embd : t.size;
    out.set(randomFloats(real, seed + t.offset), t.offset);
  }
  return out;
}

function engineState(model: ModelConfig, step: number): CheckpointState {
  const v = engineFlat(model, 3).map(Math.abs); // second moments are non-negative
  return { step, params: engineFlat(model, 1), m: engineFlat(model, 2), v, control };
}

function firstDiff(a: Float32Array, b: Float32Array): number {
  if (a.length !== b.length) return Math.min(a.length, b.length);
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) return i;
  return -1;
}

const sha = async (path: string) => createHash("sha256").update(await Deno.readFile(path)).digest("hex");

async function saved(root: string, job = "job_a", step = 40) {
  const model = presetConfig("gpt2-tiny");
  const state = engineState(model, step);
  const meta = {
    job_id: job,
    model,
    train,
    sampler: { epoch: 2, position: 96 },
    metrics: { loss: 4.5, val_loss: 4.75 },
  };
  const ck = await saveCheckpoint(`${root}/checkpoints/${job}`, meta, state, 2);
  return { model, state, ...ck };
}

Deno.test("reshardCheckpoint() round trip 1 → 2 → 4 → 1 gives back the same files, and every copy holds the weights and moments cut for its tp", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_reshard_" });
  try {
    const { model, state, path } = await saved(root);
    const r2 = await reshardCheckpoint(path, `${root}/out/tp2`, 2);
    const r4 = await reshardCheckpoint(r2.path, `${root}/out/tp4`, 4);
    const r1 = await reshardCheckpoint(r4.path, `${root}/out/tp1`, 1);
    assert.deepEqual([r2.from_tensor_parallel, r4.from_tensor_parallel, r1.from_tensor_parallel], [1, 2, 4]);
    assert.deepEqual(r2.files, [
      "config.json",
      "manifest.json",
      "model-tp00-of-02.safetensors",
      "model-tp01-of-02.safetensors",
      "optimizer-tp00-of-02.safetensors",
      "optimizer-tp01-of-02.safetensors",
    ]);
    assert.equal(r4.files.filter((f) => f.startsWith("model-tp")).length, 4);
    assert.deepEqual(r1.files, [
      "config.json",
      "manifest.json",
      "model.safetensors",
      "optimizer.safetensors",
    ]);
    for (const f of ["model.safetensors", "optimizer.safetensors", "config.json"]) {
      assert.equal(await sha(`${r1.path}/${f}`), await sha(`${path}/${f}`), f);
    }

    // The merged copy resumes exactly as the original does.
    const back = await loadCheckpoint(r1.path, model);
    for (const k of ["params", "m", "v"] as const) assert.equal(firstDiff(back.state[k], state[k]), -1, k);
    assert.deepEqual(back.state.control, control);
    assert.equal(back.state.step, 40);
    const original = await readManifest(path);
    for (
      const k of ["iteration", "job_id", "name", "train", "rng", "sampler", "metrics", "control"] as const
    ) {
      assert.deepEqual(back.manifest[k], original[k], k);
    }
    assert.deepEqual(back.manifest.model, model);
    assert.deepEqual(back.manifest.resharded_from, {
      checkpoint: r4.path,
      tensor_parallel: 4,
      created_at: r4.manifest.created_at,
    });

    // Each copy in between: the vocabulary padded for its tp, and rank r's state is rank r's cut.
    for (const [r, tp, padded] of [[r2, 2, 50432], [r4, 4, 50688]] as const) {
      const m = await readManifest(r.path);
      assert.deepEqual(m.parallel, { tensor_parallel: tp, data_parallel: 1 });
      assert.equal(m.model.padded_vocab_size, padded);
      assert.deepEqual(m.vocab, {
        vocab_size: 50257,
        padded_vocab_size: 50304,
        tensor_parallel_vocab_size: padded,
        rank_vocab_size: padded / tp,
        tensor_parallel: tp,
      });
      const cfg = tensorParallelConfig(model, tp);
      // The whole state at this padding (padded rows zero, as in the original) cut per rank.
      const widen = (flat: Float32Array) => {
        const from = paramLayout(model), to = paramLayout(cfg), out = new Float32Array(to.totalSize);
        for (const t of from.tensors) {
          out.set(flat.subarray(t.offset, t.offset + t.size), to.byName.get(t.name)!.offset);
        }
        return out;
      };
      const want = {
        params: splitParams(cfg, tp, widen(state.params)),
        m: splitParams(cfg, tp, widen(state.m)),
        v: splitParams(cfg, tp, widen(state.v)),
      };
      for (let rank = 0; rank < tp; rank++) {
        const { state: got } = await loadCheckpoint(r.path, cfg, { tensorParallel: tp, rank });
        for (const k of ["params", "m", "v"] as const) {
          assert.equal(firstDiff(got[k], want[k][rank]), -1, `${k} of rank ${rank} at tp ${tp}`);
        }
        assert.deepEqual(got.control, control);
      }
    }
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("reshardCheckpoint() refuses an existing destination, a tp that cannot shard and a folder that is no checkpoint, leaving no temporary", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_reshard_" });
  try {
    const { path } = await saved(root);
    await Deno.mkdir(`${root}/out/taken`, { recursive: true });
    const refused = async (p: Promise<unknown>, status: number, field: string, message: string | RegExp) => {
      await assert.rejects(p, (e: unknown) => {
        assert.ok(e instanceof ReshardError, String(e));
        assert.equal(e.status, status);
        assert.equal(e.field, field);
        if (typeof message === "string") assert.equal(e.message, message);
        else assert.match(e.message, message);
        return true;
      });
    };
    await refused(
      reshardCheckpoint(path, `${root}/out/taken`, 2),
      409,
      "destination",
      `Cannot reshard to "${root}/out/taken": it already exists`,
    );
    await refused(
      reshardCheckpoint(path, `${root}/out/tp3`, 3),
      400,
      "tensor_parallel",
      `Cannot reshard "${path}" to tensor_parallel 3: 3 does not divide n_head 4: each rank must hold whole attention heads`,
    );
    await refused(
      reshardCheckpoint(`${root}/out`, `${root}/out/x`, 2),
      404,
      "checkpoint",
      `Checkpoint "${root}/out" not found: no manifest.json in "${root}/out"`,
    );
    // A shard file gone missing is named.
    const r2 = await reshardCheckpoint(path, `${root}/out/tp2`, 2);
    await Deno.remove(`${r2.path}/model-tp01-of-02.safetensors`);
    await refused(
      reshardCheckpoint(r2.path, `${root}/out/tp1`, 1),
      400,
      "checkpoint",
      /model-tp01-of-02\.safetensors/,
    );
    assert.deepEqual([...Deno.readDirSync(`${root}/out`)].map((e) => e.name).sort(), ["taken", "tp2"]);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("A TP=2 checkpoint serves generation on one GPU: resolved with the tp 1 vocabulary, its shards merged to exactly the same weights", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_reshard_" });
  try {
    const { model } = await saved(root);
    const r = await reshardByName((id) => `${root}/checkpoints/${id}`, () => false, {
      checkpoint: "job_a",
      tensor_parallel: 2,
    });
    assert.equal(r.id, "job_a-tp2/iter_0000040");
    assert.equal((await readManifest(r.path)).model.padded_vocab_size, 50432);
    const sharded = await resolveModelSource(root, "job_a-tp2");
    assert.equal(sharded.kind, "checkpoint");
    assert.equal(sharded.id, "job_a-tp2/iter_0000040");
    assert.deepEqual(sharded.config, model); // served at tp 1: 50304 rows
    const whole = await resolveModelSource(root, "job_a");
    const [a, b] = [await loadWeights(sharded), await loadWeights(whole)];
    assert.equal(a.length, paramLayout(model).totalSize);
    assert.equal(firstDiff(a, b), -1);
    const listed = (await listModelSources(root)).filter((m) => m.id.startsWith("job_a-tp2"));
    assert.deepEqual(listed.map((m) => m.id), ["job_a-tp2", "job_a-tp2/iter_0000040"]);
    assert.ok(listed.every((m) => m.config.padded_vocab_size === 50304));
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

async function routeSetup() {
  const root = await Deno.makeTempDir({ prefix: "gpt2_reshard_routes_" });
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({ runner, token: null });
  const post = (body: unknown) =>
    app.request("/checkpoints/reshard", {
      method: "POST",
      body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" },
    });
  const cleanup = async () => {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, root, post, cleanup };
}

Deno.test("POST /checkpoints/reshard writes checkpoints/<name>/iter_N at the asked tp, found by generation and the model list", async () => {
  const t = await routeSetup();
  try {
    await saved(t.root, "job_a", 20);
    await saved(t.root, "job_a", 40);
    const res = await t.post({ checkpoint: "job_a/iter_0000020", tensor_parallel: 4, name: "small-tp4" });
    const body = await res.json();
    assert.equal(res.status, 201, JSON.stringify(body));
    assert.deepEqual(
      { ...body, bytes: typeof body.bytes },
      {
        id: "small-tp4/iter_0000020",
        name: "small-tp4",
        checkpoint: "job_a/iter_0000020",
        from_tensor_parallel: 1,
        tensor_parallel: 4,
        iteration: 20,
        path: "checkpoints/small-tp4/iter_0000020",
        files: [
          "config.json",
          "manifest.json",
          ...[0, 1, 2, 3].map((r) => `model-tp0${r}-of-04.safetensors`),
          ...[0, 1, 2, 3].map((r) => `optimizer-tp0${r}-of-04.safetensors`),
        ],
        bytes: "number",
        vocab: {
          vocab_size: 50257,
          padded_vocab_size: 50304,
          tensor_parallel_vocab_size: 50688,
          rank_vocab_size: 12672,
          tensor_parallel: 4,
        },
      },
    );
    assert.ok(body.bytes > 4 * 12672 * 64 * 4);
    // Default name "<job id>-tp<N>", newest checkpoint; the merged TP=1 copy is the HF folder.
    const merged = await t.post({ checkpoint: "job_a", tensor_parallel: 1 });
    const mb = await merged.json();
    assert.equal(merged.status, 201, JSON.stringify(mb));
    assert.equal(mb.id, "job_a-tp1/iter_0000040");
    assert.deepEqual(mb.files, [
      "config.json",
      "manifest.json",
      "model.safetensors",
      "optimizer.safetensors",
    ]);
    assert.equal(
      await sha(`${t.root}/checkpoints/job_a-tp1/iter_0000040/model.safetensors`),
      await sha(`${t.root}/checkpoints/job_a/iter_0000040/model.safetensors`),
    );
    const ids = (await listModelSources(t.root)).map((m) => m.id);
    for (const id of ["small-tp4", "small-tp4/iter_0000020", "job_a-tp1"]) assert.ok(ids.includes(id), id);
    const source = await resolveModelSource(t.root, "small-tp4");
    assert.equal(source.config.padded_vocab_size, 50304);
    // The same name again is a conflict, and the first copy stays.
    await apiError(
      await t.post({ checkpoint: "job_a/iter_0000020", tensor_parallel: 2, name: "small-tp4" }),
      409,
      {
        message: 'Checkpoint "small-tp4/iter_0000020" already exists: choose another name',
        param: "name",
        code: "conflict",
      },
    );
    // Another run's checkpoint under a name holding this run's copies would mix two runs under one name.
    await saved(t.root, "job_c", 30);
    await apiError(await t.post({ checkpoint: "job_c", tensor_parallel: 2, name: "small-tp4" }), 409, {
      message:
        'Name "small-tp4" holds copies of another run (job "job_a"): choose another name for this one\'s',
      param: "name",
    });
  } finally {
    await t.cleanup();
  }
});

Deno.test("POST /checkpoints/reshard refuses bad bodies, unknown checkpoints, a tp that cannot shard and a job's id as name, naming the field", async () => {
  const t = await routeSetup();
  try {
    await saved(t.root);
    await apiError(await t.post({ checkpoint: "job_a" }), 400, {
      param: "tensor_parallel",
      message: /^Invalid reshard request: tensor_parallel: /,
    });
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 0 }), 400, {
      param: "tensor_parallel",
    });
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 1.5 }), 400, {
      param: "tensor_parallel",
    });
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 2, shards: 2 }), 400, {
      param: "shards",
    });
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 2, name: "../etc" }), 400, {
      param: "name",
      message: /Use 1-64 letters, digits, '-' or '_'/,
    });
    await apiError(await t.post({ checkpoint: "../job_a", tensor_parallel: 2 }), 400, {
      param: "checkpoint",
      message:
        'Invalid checkpoint "../job_a": expected "<job id>" or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)',
    });
    await apiError(await t.post({ checkpoint: "job_b", tensor_parallel: 2 }), 404, {
      param: "checkpoint",
      code: "checkpoint_not_found",
      message:
        'Checkpoint "job_b" not found: expected a job id with saved checkpoints or "<job id>/iter_0001000" (a checkpoint as GET /jobs/:id/checkpoints names it)',
    });
    await apiError(await t.post({ checkpoint: "job_a/iter_0000999", tensor_parallel: 2 }), 404, {
      param: "checkpoint",
    });
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 3 }), 400, {
      param: "tensor_parallel",
      code: "invalid_value",
      message:
        'Cannot reshard "job_a/iter_0000040" to tensor_parallel 3: 3 does not divide n_head 4: each rank must hold whole attention heads',
    });
    const job = await t.app.request("/train", {
      method: "POST",
      body: JSON.stringify({ model: "gpt2-tiny", train_iters: 5 }),
      headers: { "Content-Type": "application/json" },
    });
    const { id } = await job.json();
    await apiError(await t.post({ checkpoint: "job_a", tensor_parallel: 2, name: id }), 409, {
      param: "name",
      message: `Name "${id}" is a training job's id: choose another name for the resharded copy`,
    });
    assert.deepEqual([...Deno.readDirSync(`${t.root}/checkpoints`)].map((e) => e.name), ["job_a"]);
  } finally {
    await t.cleanup();
  }
});

Deno.test("deno task reshard writes the copy, and exits 2 on bad arguments and 1 on a refusal", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_reshard_cli_" });
  try {
    const { path } = await saved(root);
    const run = async (...args: string[]) => {
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["run", "--allow-read", "--allow-write", "scripts/reshard.ts", ...args],
        cwd: new URL("../..", import.meta.url).pathname,
        stdout: "piped",
        stderr: "piped",
      }).output();
      const text = (b: Uint8Array) => new TextDecoder().decode(b).trim();
      return { code: out.code, stdout: text(out.stdout), stderr: text(out.stderr) };
    };
    const ok = await run(path, "--tensor-parallel", "2", "--out", `${root}/tp2`);
    assert.equal(ok.code, 0, ok.stderr);
    assert.match(
      ok.stdout,
      new RegExp(
        `^Resharded "${path}" \\(tensor_parallel 1\\) to "${root}/tp2" \\(tensor_parallel 2\\): config\\.json, manifest\\.json, model-tp00-of-02\\.safetensors`,
      ),
    );
    assert.equal((await readManifest(`${root}/tp2`)).parallel.tensor_parallel, 2);
    const again = await run(path, "--tensor-parallel", "2", "--out", `${root}/tp2`);
    assert.deepEqual([again.code, again.stderr], [1, `Cannot reshard to "${root}/tp2": it already exists`]);
    const bad = await run(path, "--tensor-parallel", "two", "--out", `${root}/x`);
    assert.equal(bad.code, 2);
    assert.match(
      bad.stderr,
      /^Invalid --tensor-parallel "two": expected a positive integer\nUsage: deno task reshard SRC --tensor-parallel N --out DST$/,
    );
    const noOut = await run(path, "--tensor-parallel", "2");
    assert.deepEqual([noOut.code, noOut.stderr.split("\n")[0]], [2, "Missing --out DST"]);
    const three = await run(path, "--tensor-parallel", "3", "--out", `${root}/x`);
    assert.equal(three.code, 1);
    assert.match(three.stderr, /tensor_parallel 3: 3 does not divide n_head 4/);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});
