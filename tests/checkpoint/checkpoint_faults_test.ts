/**
 * Ordinary faults around checkpoints (issue 37). A full disk while a checkpoint is written: the
 * save fails naming ENOSPC and the checkpoint's path, leaves no temporary folder, and every
 * checkpoint saved before stays loadable (pruning never runs first); ENOSPC is injected at the
 * write layer (SaveOptions.openFile) and, where this machine lets a test mount one, hit for real
 * on a small tmpfs. A truncated or corrupted file is refused on loading by the size and SHA-256
 * its manifest records (checkpoints without them still load); a job resuming passes over its
 * unusable newest checkpoint for the next older one, with a warning, and fails naming them all
 * when none is usable. The runner hands a Worker the job's checkpoints newest first; the GPU
 * test (lavapipe on CI) resumes a real job past a truncated, then a byte-flipped, newest one.
 */

import assert from "node:assert/strict";
import { makeConfig, type ModelConfig, paramLayout } from "../../model/config.ts";
import {
  CheckpointWriteError,
  listCheckpoints,
  loadCheckpoint,
  loadCheckpointWeights,
  loadUsableCheckpoint,
  readManifest,
  saveCheckpoint,
} from "../../checkpoint/checkpoint.ts";
import { type FromWorker } from "../../protocol.ts";
import { JobRunner, JobStore, type TrainConfig } from "../../server/jobs/mod.ts";
import { type OpenForWrite } from "../../checkpoint/safetensors.ts";
import { prepareDataset } from "../../data/mod.ts";
import { trainingModel } from "../../job/job_config.ts";
import { runTraining } from "../../worker/train_loop.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import { noGpu, testContext } from "../_helpers.ts";
import { until } from "../_wait.ts";

/** A small model: its checkpoints are about 0.6 MB, so a 1 MB tmpfs holds one and not two. */
const small: ModelConfig = makeConfig({
  n_layer: 2,
  n_head: 2,
  n_embd: 32,
  n_positions: 64,
  vocab_size: 500,
});

const train: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "sotu",
  split: "949,50,1",
  train_iters: 4,
  batch_size: 2,
  seq_len: 32,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "cosine",
  warmup: 0.25,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0.1,
  hidden_dropout: 0.1,
  seed: 5,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 2,
  keep_checkpoints: 5,
};

const meta = (model: ModelConfig, step: number) => ({
  job_id: "job_a",
  model,
  train,
  sampler: { epoch: 0, position: step * 2 },
  metrics: { loss: 5 - step / 100, val_loss: null },
});

function pattern(n: number, k: number): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = (((i * k) % 65521) - 32760) / 4096;
  return a;
}

function stateAt(model: ModelConfig, step: number) {
  const n = paramLayout(model).totalSize;
  const params = pattern(n, 7919 + step);
  // Padded wte rows are zero in the engine (they are not stored).
  const wte = paramLayout(model).byName.get("wte.weight")!;
  params.fill(0, wte.offset + model.vocab_size * model.n_embd, wte.offset + wte.size);
  return { step, params, m: pattern(n, 104729 + step), v: pattern(n, 1299709 + step) };
}

/** Whether two float arrays hold the same bits, element by element. */
function sameBits(a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) return false;
  return true;
}

/** Asserts the checkpoint at `path` loads back as `want` exactly (parameters, both moments, sampler). */
async function assertLoadsAs(path: string, model: ModelConfig, want: ReturnType<typeof stateAt>) {
  const { manifest, state } = await loadCheckpoint(path, model);
  assert.equal(state.step, want.step);
  assert.deepEqual(manifest.sampler, { epoch: 0, position: want.step * 2 });
  for (const t of paramLayout(model).tensors) {
    const slice = (a: Float32Array) => a.subarray(t.offset, t.offset + t.size);
    assert.ok(sameBits(slice(state.params), slice(want.params)), `params ${t.name}`);
  }
  assert.ok(sameBits(state.m, want.m), "m");
  assert.ok(sameBits(state.v, want.v), "v");
}

const names = (dir: string) => [...Deno.readDirSync(dir)].map((e) => e.name).sort();

/** The error Deno raises when a write finds the disk full (seen on a full tmpfs: plain Error, code ENOSPC). */
const enospc = () => Object.assign(new Error("No space left on device (os error 28)"), { code: "ENOSPC" });

/**
 * Files on a disk with `room` bytes left for all of them together: writes go through to the
 * real file until it is full, then fail with ENOSPC; `syncFails` makes fsync fail so instead.
 */
function fullDisk(room: number, syncFails = false): OpenForWrite {
  let used = 0;
  return async (path) => {
    const file = await Deno.open(path, { write: true, create: true, truncate: true });
    return {
      async write(bytes: Uint8Array) {
        const left = room - used;
        if (left <= 0) throw enospc();
        const n = await file.write(bytes.subarray(0, Math.min(left, bytes.length)));
        used += n;
        return n;
      },
      sync: () => syncFails ? Promise.reject(enospc()) : file.sync(),
      [Symbol.dispose]: () => file.close(),
    };
  };
}

Deno.test("saveCheckpoint() on a full disk (ENOSPC injected at the write layer) names ENOSPC, the checkpoint's path and the file, removes its temporary folder and keeps what was saved", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckfault_" });
  try {
    const job = `${dir}/job_a`;
    const first = stateAt(small, 10);
    await saveCheckpoint(job, meta(small, 10), first, 1);
    const sizes = (await readManifest(`${job}/iter_0000010`)).checksums!;
    const model = sizes["model.safetensors"].bytes, opt = sizes["optimizer.safetensors"].bytes;
    const hf = sizes["config.json"].bytes;
    // Where the disk fills: inside each file in the order they are written, and at the fsync.
    const cases: Array<[() => OpenForWrite, string]> = [
      [() => fullDisk(0), "model.safetensors"],
      [() => fullDisk(1000), "model.safetensors"],
      [() => fullDisk(model + 1000), "optimizer.safetensors"],
      [() => fullDisk(model + opt + 10), "config.json"],
      [() => fullDisk(model + opt + hf + 10), "manifest.json"],
      [() => fullDisk(Infinity, true), "model.safetensors"],
    ];
    // keep 1: pruning would remove iter_0000010 if it ran before the new checkpoint was committed.
    for (const step of [20, 10]) {
      for (const [disk, file] of cases) {
        const err = await saveCheckpoint(job, meta(small, step), stateAt(small, step), 1, {
          openFile: disk(),
        })
          .then(() => null, (e) => e);
        assert.ok(err instanceof CheckpointWriteError, String(err));
        const name = `iter_00000${step}`;
        assert.equal(
          err.message,
          `Cannot write checkpoint "${name}" to "${job}/${name}" (${file}): no space left on device (ENOSPC)`,
        );
        assert.equal(err.code, "ENOSPC");
        assert.deepEqual(names(job), ["iter_0000010"], `${name}, full in ${file}: no .tmp-* left`);
        assert.deepEqual((await listCheckpoints(job)).map((c) => c.name), ["iter_0000010"]);
      }
    }
    await assertLoadsAs(`${job}/iter_0000010`, small, first);
    // Room again: the next save goes through and prunes as usual.
    const next = stateAt(small, 20);
    await saveCheckpoint(job, meta(small, 20), next, 1);
    assert.deepEqual(names(job), ["iter_0000020"]);
    await assertLoadsAs(`${job}/iter_0000020`, small, next);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

/** Null when this machine lets a test mount a tmpfs (root on Linux), else why not. */
async function tmpfsUnavailable(): Promise<string | null> {
  if (Deno.build.os !== "linux") return "tmpfs is Linux only";
  const dir = await Deno.makeTempDir({ prefix: "gpt2_tmpfs_probe_" });
  try {
    const out = await new Deno.Command("mount", {
      args: ["-t", "tmpfs", "-o", "size=64k", "tmpfs", dir],
      stdout: "null",
      stderr: "piped",
    }).output();
    if (!out.success) {
      return `mount -t tmpfs is not permitted here (${new TextDecoder().decode(out.stderr).trim()})`;
    }
    await new Deno.Command("umount", { args: [dir] }).output();
    return null;
  } catch (e) {
    return `cannot run mount (${(e as Error).message})`;
  } finally {
    await Deno.remove(dir).catch(() => {});
  }
}

const noTmpfs = await tmpfsUnavailable();
if (noTmpfs) console.warn(`checkpoint_faults_test: the real full-disk test is skipped: ${noTmpfs}`);

Deno.test({
  name:
    "saveCheckpoint() on a real full disk (a 1 MB tmpfs) fails naming ENOSPC and the path, and the checkpoint before it stays loadable",
  ignore: noTmpfs !== null,
  fn: async () => {
    const mnt = await Deno.makeTempDir({ prefix: "gpt2_tmpfs_" });
    const mount = await new Deno.Command("mount", { args: ["-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt] })
      .output();
    assert.ok(mount.success, "mount");
    try {
      const job = `${mnt}/job_a`;
      const first = stateAt(small, 10);
      await saveCheckpoint(job, meta(small, 10), first, 1);
      const bytes = (await listCheckpoints(job))[0].bytes;
      assert.ok(bytes > 512 * 1024 && bytes < 1024 * 1024, `one checkpoint, ${bytes} bytes, fits once`);
      const err = await saveCheckpoint(job, meta(small, 20), stateAt(small, 20), 1).then(
        () => null,
        (e) => e,
      );
      assert.ok(err instanceof CheckpointWriteError, String(err));
      assert.match(err.message, /^Cannot write checkpoint "iter_0000020" to "[^"]+\/job_a\/iter_0000020" \(/);
      assert.ok(err.message.includes(`"${job}/iter_0000020"`), err.message);
      assert.ok(err.message.endsWith(": no space left on device (ENOSPC)"), err.message);
      assert.deepEqual(names(job), ["iter_0000010"]);
      await assertLoadsAs(`${job}/iter_0000010`, small, first);
    } finally {
      await new Deno.Command("umount", { args: [mnt] }).output();
      await Deno.remove(mnt, { recursive: true });
    }
  },
});

/** Flips every bit of `count` bytes in the middle of a file. */
async function flipMiddle(path: string, count = 16): Promise<void> {
  const bytes = await Deno.readFile(path);
  const at = bytes.length >> 1;
  for (let i = at; i < at + count; i++) bytes[i] ^= 0xff;
  await Deno.writeFile(path, bytes);
}

async function truncateHalf(path: string): Promise<void> {
  await Deno.truncate(path, (await Deno.stat(path)).size >> 1);
}

Deno.test("loadCheckpoint() refuses a truncated or byte-flipped file by the size and SHA-256 its manifest records; one without them still loads", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckfault_" });
  try {
    const want = stateAt(small, 6);
    const { path } = await saveCheckpoint(`${dir}/job_a`, meta(small, 6), want, 1);
    const copy = async (to: string) => {
      await Deno.mkdir(to);
      for (const f of names(path)) await Deno.copyFile(`${path}/${f}`, `${to}/${f}`);
      return to;
    };
    const truncated = await copy(`${dir}/truncated`), flipped = await copy(`${dir}/flipped`);
    const { bytes } = (await readManifest(path)).checksums!["model.safetensors"];
    await truncateHalf(`${truncated}/model.safetensors`);
    await assert.rejects(loadCheckpoint(truncated, small), {
      message: `Cannot load checkpoint "${truncated}": "model.safetensors" has ${
        bytes >> 1
      } bytes, its manifest records ${bytes} (truncated or overwritten)`,
    });
    await flipMiddle(`${flipped}/optimizer.safetensors`);
    await assert.rejects(
      loadCheckpoint(flipped, small),
      new RegExp(
        `^Error: Cannot load checkpoint "${flipped}": "optimizer\\.safetensors" is corrupted: its SHA-256`,
      ),
    );
    // Generation reads the weights alone, verified too.
    await flipMiddle(`${flipped}/model.safetensors`);
    await assert.rejects(loadCheckpointWeights(flipped, small), /"model\.safetensors" is corrupted/);

    // A checkpoint from before checksums loads as before; a truncated file is still refused by its header.
    const old = await copy(`${dir}/old`);
    const manifest = JSON.parse(await Deno.readTextFile(`${old}/manifest.json`));
    delete manifest.checksums;
    await Deno.writeTextFile(`${old}/manifest.json`, JSON.stringify(manifest));
    await assertLoadsAs(old, small, want);
    await truncateHalf(`${old}/model.safetensors`);
    await assert.rejects(
      loadCheckpoint(old, small),
      new RegExp(`Cannot load checkpoint "${old}": cannot read "model\\.safetensors": .*bad byte range`),
    );
    await assertLoadsAs(path, small, want);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("loadUsableCheckpoint() passes over unusable newer checkpoints, saying why, and fails naming every one when none is usable", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckfault_" });
  try {
    const job = `${dir}/job_a`;
    for (const step of [10, 20, 30]) await saveCheckpoint(job, meta(small, step), stateAt(small, step), 3);
    const paths = (await listCheckpoints(job)).reverse().map((c) => c.path);
    await flipMiddle(`${paths[0]}/model.safetensors`);
    await truncateHalf(`${paths[1]}/optimizer.safetensors`);
    const got = await loadUsableCheckpoint(paths, small);
    assert.equal(got.path, paths[2]);
    assert.equal(got.state.step, 10);
    assert.deepEqual(got.skipped.map((s) => s.path), paths.slice(0, 2));
    assert.match(
      got.skipped[0].reason,
      /^Cannot load checkpoint "[^"]+iter_0000030": "model\.safetensors" is corrupted/,
    );
    assert.match(got.skipped[1].reason, /iter_0000020": "optimizer\.safetensors" has \d+ bytes/);
    // A manifest cut short is unusable too.
    const text = await Deno.readTextFile(`${paths[2]}/manifest.json`);
    await Deno.writeTextFile(`${paths[2]}/manifest.json`, text.slice(0, 100));
    const err = await loadUsableCheckpoint(paths, small).then(() => null, (e) => e as Error);
    assert.ok(err);
    assert.match(err.message, /^Cannot resume: none of its 3 checkpoints is usable: /);
    for (const p of paths) assert.ok(err.message.includes(`Cannot load checkpoint "${p}"`), p);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("JobRunner hands a resumed job its checkpoints newest first as resume_candidates", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_ckfault_runner_" });
  const store = new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: (id) => Promise.resolve(id === "sotu"),
  });
  runner.start();
  try {
    await runner.submit({ ...train, train_iters: 20 });
    await until(() => workers[0]?.jobs.length === 1, "the job on the worker");
    const handed = workers[0].jobs[0];
    assert.equal(handed.resume_path, null);
    assert.equal(handed.resume_candidates, undefined);
    const model = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });
    for (const step of [2, 4]) {
      const n = paramLayout(model).totalSize, zeros = new Float32Array(n);
      await saveCheckpoint(handed.checkpoint_dir, { ...meta(model, step), job_id: handed.id }, {
        step,
        params: zeros,
        m: zeros,
        v: zeros,
      }, 5);
    }
    workers[0].onerror!(new ErrorEvent("error", { message: "boom", cancelable: true }));
    await until(() => workers[1]?.jobs.length === 1, "the job again on a fresh worker");
    const again = workers[1].jobs[0];
    const dir = handed.checkpoint_dir;
    assert.equal(again.resume_path, `${dir}/iter_0000004`);
    assert.deepEqual(again.resume_candidates, [`${dir}/iter_0000004`, `${dir}/iter_0000002`]);
  } finally {
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test({
  name:
    "runTraining() resumes from the older checkpoint when the newest is truncated or corrupted, warning which and why, and fails naming them when none is usable",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_ckfault_gpu_" });
    const ctx = (await testContext())!;
    const checkpoint_dir = `${root}/checkpoints/job_a`;
    const run = async (candidates: string[] | null) => {
      const messages: FromWorker[] = [];
      const done = await runTraining(ctx, {
        id: "job_a",
        config: train,
        root,
        checkpoint_dir,
        resume_path: candidates?.[0] ?? null,
        ...(candidates ? { resume_candidates: candidates } : {}),
      }, { post: (m) => messages.push(m), cancelled: () => false });
      const losses = new Map<number, number>();
      for (const m of messages) if (m.type === "progress" && m.loss !== null) losses.set(m.iteration, m.loss);
      const started = messages.find((m) => m.type === "started");
      const warnings = messages.flatMap((m) => m.type === "log" && m.level === "warn" ? [m.message] : []);
      return { done, losses, started, warnings };
    };
    try {
      await prepareDataset(root, { builtin: "sotu" });
      const full = await run(null);
      assert.equal(full.done.status, "succeeded", full.done.error ?? "");
      const [older, newest] = (await listCheckpoints(checkpoint_dir)).map((c) => c.path);
      assert.deepEqual([older, newest], [`${checkpoint_dir}/iter_0000002`, `${checkpoint_dir}/iter_0000004`]);

      for (
        const [damage, why] of [[truncateHalf, /has \d+ bytes, its manifest records \d+ \(truncated/], [
          flipMiddle,
          /is corrupted: its SHA-256/,
        ]] as const
      ) {
        await damage(`${newest}/model.safetensors`);
        const resumed = await run([newest, older]);
        assert.equal(resumed.done.status, "succeeded", resumed.done.error ?? "");
        assert.equal(resumed.done.iteration, 4);
        assert.ok(resumed.started?.type === "started");
        assert.deepEqual([resumed.started.iteration, resumed.started.resumed_from], [2, older]);
        assert.equal(resumed.warnings.length, 1, resumed.warnings.join("\n"));
        assert.ok(
          resumed.warnings[0].startsWith(
            `Checkpoint "${newest}" is unusable, resuming from the older "${older}" instead: ` +
              `Cannot load checkpoint "${newest}": "model.safetensors" `,
          ),
          resumed.warnings[0],
        );
        assert.match(resumed.warnings[0], why);
        // The same steps again, bit for bit, and iteration 4 saved anew over the damaged one.
        assert.deepEqual([...resumed.losses.keys()], [3, 4]);
        for (const [it, loss] of resumed.losses) {
          assert.ok(Object.is(loss, full.losses.get(it)), `iteration ${it}`);
        }
        assert.equal((await loadCheckpoint(newest, trainingModel(train))).state.step, 4);
      }

      // Nothing usable: the job fails naming both, it does not start over.
      await flipMiddle(`${newest}/optimizer.safetensors`);
      await truncateHalf(`${older}/model.safetensors`);
      const none = await run([newest, older]);
      assert.equal(none.done.status, "failed");
      assert.equal(none.started, undefined);
      assert.match(none.done.error ?? "", /^Cannot resume: none of its 2 checkpoints is usable: /);
      for (const p of [newest, older]) {
        assert.ok(none.done.error!.includes(`Cannot load checkpoint "${p}"`), p);
      }
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});
