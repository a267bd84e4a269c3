/**
 * Checkpoint files without a GPU: safetensors round trips and header layout, Hugging Face tensor
 * names and shapes, the real-vocabulary wte export and zero-padded import, config.json, the
 * manifest, atomic save with pruning, replacing a same-named checkpoint, refusing non-finite
 * weights, removal of stale temporaries, and refusal of mismatched checkpoints. Tensor
 * parallelism: TP=1 files are the same bytes as before shards existed, version 1 manifests still
 * load, a checkpoint saved from TP=2 rank states is one shard pair per rank with every tensor's
 * slices recorded, and loading reshards it in memory to tp 1 or 4 (moments with their weights,
 * padded wte rows zero when the padding changes, real rows kept bit for bit).
 */

import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { ConfigError, makeConfig, paramLayout, presetConfig } from "../../model/config.ts";
import { mergeParams, shardLayout, splitParams, tensorParallelConfig } from "../../engine/parallel/mod.ts";
import {
  type CheckpointManifest,
  checkpointName,
  exportTensors,
  importTensors,
  listCheckpoints,
  loadCheckpoint,
  loadCheckpointWeights,
  readManifest,
  removeStaleCheckpointTemporaries,
  saveCheckpoint,
} from "../../checkpoint/checkpoint.ts";
import {
  decodeSafetensors,
  encodeSafetensors,
  readSafetensors,
  writeSafetensors,
} from "../../checkpoint/safetensors.ts";
import { type TrainConfig } from "../../server/jobs/mod.ts";

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

/** Index of the first difference between two float arrays, or -1 (node's deepEqual is slow on millions). */
function firstDiff(a: Float32Array, b: Float32Array): number {
  if (a.length !== b.length) return Math.min(a.length, b.length);
  for (let i = 0; i < a.length; i++) if (!Object.is(a[i], b[i])) return i;
  return -1;
}

function filled(n: number, f: (i: number) => number): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = f(i);
  return a;
}

Deno.test("encodeSafetensors() writes an 8-aligned JSON header and decodeSafetensors() reads it back exactly", () => {
  const a = filled(6, (i) => i * 0.5 - 1);
  const b = filled(3, (i) => Math.PI * i);
  const bytes = encodeSafetensors(
    [{ name: "a", shape: [2, 3], data: a }, { name: "b", shape: [3], data: b }],
    {
      format: "pt",
    },
  );
  const headerLen = Number(new DataView(bytes.buffer).getBigUint64(0, true));
  assert.equal(headerLen % 8, 0);
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLen)));
  assert.deepEqual(header.__metadata__, { format: "pt" });
  assert.deepEqual(header.a, { dtype: "F32", shape: [2, 3], data_offsets: [0, 24] });
  assert.deepEqual(header.b, { dtype: "F32", shape: [3], data_offsets: [24, 36] });
  assert.equal(bytes.length, 8 + headerLen + 36);
  const back = decodeSafetensors(bytes);
  assert.deepEqual([...back.tensors.get("a")!.data], [...a]);
  assert.deepEqual([...back.tensors.get("b")!.data], [...b]);
  assert.deepEqual(back.tensors.get("a")!.shape, [2, 3]);
  assert.throws(
    () => encodeSafetensors([{ name: "x", shape: [2, 2], data: a }]),
    /shape \[2,2\] holds 4 values/,
  );
});

Deno.test("decodeSafetensors() widens F16 and BF16 tensors to float32 and names an unknown dtype", () => {
  // Hand-built file: h (F16) = [1, -2, 0.5, 65504, 2^-24, -0]; b (BF16) = [1, -3.5, 2^100].
  const f16 = [0x3c00, 0xc000, 0x3800, 0x7bff, 0x0001, 0x8000];
  const bf16 = [0x3f80, 0xc060, 0x7180];
  const header = JSON.stringify({
    h: { dtype: "F16", shape: [2, 3], data_offsets: [0, 12] },
    b: { dtype: "BF16", shape: [3], data_offsets: [12, 18] },
  });
  const hb = new TextEncoder().encode(header);
  const bytes = new Uint8Array(8 + hb.length + 18);
  const view = new DataView(bytes.buffer);
  view.setBigUint64(0, BigInt(hb.length), true);
  bytes.set(hb, 8);
  [...f16, ...bf16].forEach((v, i) => view.setUint16(8 + hb.length + 2 * i, v, true));
  const back = decodeSafetensors(bytes, "half.safetensors");
  assert.deepEqual([...back.tensors.get("h")!.data], [1, -2, 0.5, 65504, 2 ** -24, -0]);
  assert.deepEqual(back.tensors.get("h")!.shape, [2, 3]);
  assert.deepEqual([...back.tensors.get("b")!.data], [1, -3.5, 2 ** 100]);
  const bad = new Uint8Array(bytes);
  bad.set(new TextEncoder().encode('"I8" '), 8 + header.indexOf('"F16"'));
  assert.throws(
    () => decodeSafetensors(bad, "bad.safetensors"),
    /tensor "h" has dtype "I8", expected F32, F16 or BF16/,
  );
});

Deno.test("exportTensors() uses Hugging Face names and [in, out] shapes, wte cut to 50257 rows; importTensors() pads back with zeros", () => {
  const config = presetConfig("gpt2-tiny");
  const layout = paramLayout(config);
  const params = filled(layout.totalSize, (i) => Math.sin(i));
  const tensors = exportTensors(config, params);
  const names = tensors.map((t) => t.name);
  assert.deepEqual(names.slice(0, 3), ["wte.weight", "wpe.weight", "h.0.ln_1.weight"]);
  assert.deepEqual(names.slice(-2), ["ln_f.weight", "ln_f.bias"]);
  assert.ok(!names.some((n) => n.startsWith("lm_head")));
  const byName = new Map(tensors.map((t) => [t.name, t]));
  assert.deepEqual(byName.get("wte.weight")!.shape, [50257, 64]);
  assert.deepEqual(byName.get("h.1.attn.c_attn.weight")!.shape, [64, 192]);
  assert.deepEqual(byName.get("h.1.mlp.c_proj.weight")!.shape, [256, 64]);
  assert.equal(tensors.length, 2 + 12 * config.n_layer + 2);

  const back = importTensors(config, new Map(tensors.map((t) => [t.name, t])));
  const wte = layout.byName.get("wte.weight")!;
  for (const t of layout.tensors) {
    const keep = t.name === "wte.weight" ? config.vocab_size * config.n_embd : t.size;
    assert.equal(
      firstDiff(back.subarray(t.offset, t.offset + keep), params.subarray(t.offset, t.offset + keep)),
      -1,
      t.name,
    );
  }
  const padRows = back.subarray(wte.offset + 50257 * 64, wte.offset + wte.size);
  assert.equal(padRows.length, (config.padded_vocab_size - 50257) * 64);
  assert.ok(padRows.every((x) => x === 0));

  // `transformer.`-prefixed names (as GPT2LMHeadModel saves them) load too.
  const prefixed = importTensors(config, new Map(tensors.map((t) => [`transformer.${t.name}`, t])));
  assert.equal(firstDiff(prefixed, back), -1);
  const other = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64, vocab_size: 50000 });
  assert.throws(
    () => importTensors(other, new Map(tensors.map((t) => [t.name, t])), "x"),
    { message: 'Cannot load checkpoint "x": vocabulary 50257 does not match 50000' },
  );
});

Deno.test("saveCheckpoint() writes model, optimizer, config.json and manifest atomically and keeps the newest N", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const wte = paramLayout(model).byName.get("wte.weight")!;
    for (const step of [10, 20, 30]) {
      const params = filled(n, (i) => Math.cos(i + step));
      params.fill(0, wte.offset + 50257 * 64, wte.offset + wte.size); // the engine keeps padded rows at zero
      const state = { step, params, m: filled(n, (i) => i * 1e-6 + step), v: filled(n, (i) => i * 1e-7) };
      const saved = await saveCheckpoint(
        `${dir}/job_a`,
        {
          job_id: "job_a",
          model,
          train,
          sampler: { epoch: 1, position: step * 4 },
          metrics: { loss: 5 - step / 10, val_loss: null },
        },
        state,
        2,
      );
      assert.equal(saved.name, checkpointName(step));
      assert.equal(saved.path, `${dir}/job_a/iter_00000${step}`);
    }
    const list = await listCheckpoints(`${dir}/job_a`);
    assert.deepEqual(list.map((c) => c.name), ["iter_0000020", "iter_0000030"]);
    assert.deepEqual([...Deno.readDirSync(`${dir}/job_a`)].map((e) => e.name).sort(), [
      "iter_0000020",
      "iter_0000030",
    ]);
    const files = [...Deno.readDirSync(list[1].path)].map((e) => e.name).sort();
    assert.deepEqual(files, ["config.json", "manifest.json", "model.safetensors", "optimizer.safetensors"]);

    const hf = JSON.parse(await Deno.readTextFile(`${list[1].path}/config.json`));
    assert.equal(hf.model_type, "gpt2");
    assert.equal(hf.vocab_size, 50257);
    assert.equal(hf.activation_function, "gelu_new");
    assert.equal(hf.layer_norm_epsilon, 1e-5);
    assert.deepEqual([hf.n_layer, hf.n_head, hf.n_embd, hf.n_positions], [2, 4, 64, 64]);
    const st = await readSafetensors(`${list[1].path}/model.safetensors`);
    assert.deepEqual(st.metadata, { format: "pt" });

    const { manifest, state } = await loadCheckpoint(list[1].path, model);
    assert.equal(manifest.iteration, 30);
    assert.deepEqual(manifest.sampler, { epoch: 1, position: 120 });
    assert.deepEqual(manifest.rng, { seed: 7, step: 30 });
    assert.equal(manifest.model.padded_vocab_size, 50304);
    assert.equal(manifest.model.vocab_size, 50257);
    assert.deepEqual(manifest.train, train);
    assert.equal(state.step, 30);
    const want = filled(n, (i) => Math.cos(i + 30));
    want.fill(0, wte.offset + 50257 * 64, wte.offset + wte.size);
    // Alignment gaps between tensors are not stored; compare every tensor's values.
    for (const t of paramLayout(model).tensors) {
      const d = firstDiff(
        state.params.subarray(t.offset, t.offset + t.size),
        want.subarray(t.offset, t.offset + t.size),
      );
      assert.equal(d, -1, t.name);
    }
    assert.equal(firstDiff(state.m, filled(n, (i) => i * 1e-6 + 30)), -1);
    assert.equal(firstDiff(state.v, filled(n, (i) => i * 1e-7)), -1);

    const bigger = makeConfig({ n_layer: 3, n_head: 4, n_embd: 64, n_positions: 64 });
    await assert.rejects(loadCheckpoint(list[1].path, bigger), {
      message: `Cannot load checkpoint "${list[1].path}": n_layer 2 does not match 3`,
    });
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("listCheckpoints() ignores temporary and manifest-less directories left by a crash", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    await Deno.mkdir(`${dir}/.tmp-iter_0000040-abcd`);
    await Deno.mkdir(`${dir}/iter_0000050`);
    assert.deepEqual(await listCheckpoints(dir), []);
    assert.deepEqual(await listCheckpoints(`${dir}/missing`), []);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("saveCheckpoint() replaces a same-named checkpoint and refuses non-finite weights, keeping what was saved", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const meta = {
      job_id: "job_a",
      model,
      train,
      sampler: { epoch: 0, position: 0 },
      metrics: { loss: null, val_loss: null },
    };
    const state = (value: number) => ({
      step: 10,
      params: new Float32Array(n).fill(value),
      m: new Float32Array(n),
      v: new Float32Array(n),
    });
    await saveCheckpoint(`${dir}/job_a`, meta, state(0.5), 2);
    await saveCheckpoint(`${dir}/job_a`, meta, state(0.25), 2);
    const bad = state(0.125);
    bad.params[123] = NaN;
    await assert.rejects(saveCheckpoint(`${dir}/job_a`, meta, bad, 2), {
      message: "Refusing to save checkpoint at iteration 10: parameter 123 is NaN",
    });
    bad.params[123] = 0;
    bad.params[7] = -Infinity;
    await assert.rejects(saveCheckpoint(`${dir}/job_a`, meta, bad, 2), /parameter 7 is -Infinity/);
    assert.deepEqual([...Deno.readDirSync(`${dir}/job_a`)].map((e) => e.name), ["iter_0000010"]);
    const loaded = await loadCheckpoint(`${dir}/job_a/iter_0000010`, model);
    assert.equal(loaded.state.params[0], 0.25);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("saveCheckpoint() asks beforeCommit after writing: a refusal commits nothing, keeps the older same-named one and leaves no temporary", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const meta = {
      job_id: "job_a",
      model,
      train,
      sampler: { epoch: 0, position: 0 },
      metrics: { loss: null, val_loss: null },
    };
    const state = (step: number, value: number) => ({
      step,
      params: new Float32Array(n).fill(value),
      m: new Float32Array(n),
      v: new Float32Array(n),
    });
    const asked: string[] = [];
    const ask = (held: boolean) => async (name: string, iteration: number) => {
      // Asked once the files are complete, before anything is renamed into place.
      const tmp = [...Deno.readDirSync(`${dir}/job_a`)].find((e) => e.name.startsWith(".tmp-"))!;
      assert.ok(await Deno.stat(`${dir}/job_a/${tmp.name}/manifest.json`));
      asked.push(`${name}@${iteration}`);
      if (!held) throw new Error("lease lost");
    };
    await saveCheckpoint(`${dir}/job_a`, meta, state(10, 0.5), 3, { beforeCommit: ask(true) });
    await assert.rejects(
      saveCheckpoint(`${dir}/job_a`, meta, state(10, 0.25), 3, { beforeCommit: ask(false) }),
      /lease lost/,
    );
    await assert.rejects(
      saveCheckpoint(`${dir}/job_a`, meta, state(20, 0.25), 3, { beforeCommit: ask(false) }),
      /lease lost/,
    );
    assert.deepEqual(asked, ["iter_0000010@10", "iter_0000010@10", "iter_0000020@20"]);
    assert.deepEqual([...Deno.readDirSync(`${dir}/job_a`)].map((e) => e.name), ["iter_0000010"]);
    assert.equal((await loadCheckpoint(`${dir}/job_a/iter_0000010`, model)).state.params[0], 0.5);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("removeStaleCheckpointTemporaries() removes what a killed writer left and nothing else", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    await Deno.mkdir(`${root}/checkpoints/job_a/.tmp-iter_0000040-abcd`, { recursive: true });
    await Deno.mkdir(`${root}/checkpoints/job_a/.old-iter_0000030-ef01`);
    await Deno.mkdir(`${root}/checkpoints/job_a/iter_0000030`);
    await Deno.mkdir(`${root}/checkpoints/job_b`);
    assert.deepEqual((await removeStaleCheckpointTemporaries(root)).sort(), [
      "checkpoints/job_a/.old-iter_0000030-ef01",
      "checkpoints/job_a/.tmp-iter_0000040-abcd",
    ]);
    assert.deepEqual([...Deno.readDirSync(`${root}/checkpoints/job_a`)].map((e) => e.name), ["iter_0000030"]);
    assert.deepEqual(await removeStaleCheckpointTemporaries(`${root}/missing`), []);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test("loadCheckpoint() moves AdamW moments saved in the older 64-element layout into today's", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const now = paramLayout(model), old = paramLayout(model, 64);
    assert.notEqual(now.totalSize, old.totalSize, "the layouts differ for this model");
    const params = new Float32Array(now.totalSize);
    const saved = await saveCheckpoint(
      `${dir}/job_a`,
      {
        job_id: "job_a",
        model,
        train,
        sampler: { epoch: 0, position: 0 },
        metrics: { loss: null, val_loss: null },
      },
      { step: 3, params, m: new Float32Array(now.totalSize), v: new Float32Array(now.totalSize) },
      1,
    );
    // Rewrite the optimizer file as a checkpoint from before the change wrote it: old layout, no "align".
    const m = new Float32Array(old.totalSize), v = new Float32Array(old.totalSize);
    for (const t of old.tensors) {
      for (let i = 0; i < t.size; i++) [m[t.offset + i], v[t.offset + i]] = [t.offset + i, -(t.offset + i)];
    }
    await writeSafetensors(`${saved.path}/optimizer.safetensors`, [
      { name: "m", shape: [m.length], data: m },
      { name: "v", shape: [v.length], data: v },
    ], { format: "pt", layout: "flat", step: "3" });
    // ...and its manifest as one from before file checksums were recorded.
    const manifest = JSON.parse(await Deno.readTextFile(`${saved.path}/manifest.json`));
    delete manifest.checksums;
    await Deno.writeTextFile(`${saved.path}/manifest.json`, JSON.stringify(manifest));
    const { state } = await loadCheckpoint(saved.path, model);
    for (const t of now.tensors) {
      const src = old.byName.get(t.name)!;
      assert.equal(state.m[t.offset], src.offset, t.name);
      assert.equal(state.v[t.offset + t.size - 1], -(src.offset + t.size - 1), t.name);
    }
    // Resharded on load, the old layout is read through its alignment too.
    const two = tensorParallelConfig(model, 2), wide = paramLayout(two);
    const ranks = await Promise.all(
      [0, 1].map((rank) => loadCheckpoint(saved.path, two, { tensorParallel: 2, rank })),
    );
    const m2 = mergeParams(two, 2, ranks.map((r) => r.state.m));
    for (const t of now.tensors) {
      const size = t.name === "wte.weight" ? 50257 * 64 : t.size, at = wide.byName.get(t.name)!.offset;
      const d = firstDiff(m2.subarray(at, at + size), state.m.subarray(t.offset, t.offset + size));
      assert.equal(d, -1, t.name);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

/** The value pattern the TP=1 byte check was recorded with (exact in float32 on every machine). */
function pattern(n: number, k: number): Float32Array {
  const a = new Float32Array(n);
  for (let i = 0; i < n; i++) a[i] = (((i * k) % 65521) - 32760) / 4096;
  return a;
}

const sha256 = async (path: string) => createHash("sha256").update(await Deno.readFile(path)).digest("hex");

const metaOf = (model: ReturnType<typeof presetConfig>) => ({
  job_id: "job_a",
  model,
  train,
  sampler: { epoch: 0, position: 0 },
  metrics: { loss: null, val_loss: null },
});

Deno.test("saveCheckpoint() at TP=1 writes model.safetensors, optimizer.safetensors and config.json byte for byte as before shards, and records the layout", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const state = { step: 5, params: pattern(n, 7919), m: pattern(n, 104729), v: pattern(n, 1299709) };
    const meta = { ...metaOf(model), job_id: "j" };
    const { path } = await saveCheckpoint(`${dir}/j`, meta, state, 1);
    // Hashes of the files the code before version 2 wrote for this state (commit 6a7a307).
    assert.equal(
      await sha256(`${path}/model.safetensors`),
      "f9e058835583c3f6f9d57b791ad64cae209e8c112cda21a341bc08b80242ea77",
    );
    assert.equal(
      await sha256(`${path}/optimizer.safetensors`),
      "31a565cca96d6b027ac60779c15ef6ae5772efe441d93be6bfe5ef276cbe14cf",
    );
    assert.equal(
      await sha256(`${path}/config.json`),
      "84ea8dfb9ec01aa6897c827fa616cfd20ab9f5fd6477f78438f20b222eaa228c",
    );
    const manifest = await readManifest(path);
    assert.equal(manifest.version, 2);
    // Each file's size and SHA-256, as loading verifies them (the manifest itself is not listed).
    assert.deepEqual(Object.keys(manifest.checksums ?? {}).sort(), [
      "config.json",
      "model.safetensors",
      "optimizer.safetensors",
    ]);
    for (const [file, digest] of Object.entries(manifest.checksums!)) {
      assert.deepEqual(digest, {
        bytes: (await Deno.stat(`${path}/${file}`)).size,
        sha256: await sha256(`${path}/${file}`),
      });
    }
    assert.equal(
      manifest.checksums!["model.safetensors"].sha256,
      "f9e058835583c3f6f9d57b791ad64cae209e8c112cda21a341bc08b80242ea77",
    );
    assert.deepEqual(manifest.parallel, { tensor_parallel: 1, data_parallel: 1 });
    assert.deepEqual(manifest.vocab, {
      vocab_size: 50257,
      padded_vocab_size: 50304,
      tensor_parallel_vocab_size: 50304,
      rank_vocab_size: 50304,
      tensor_parallel: 1,
    });
    assert.deepEqual(manifest.files, {
      model: "model.safetensors",
      optimizer: "optimizer.safetensors",
      hf_config: "config.json",
    });
    assert.equal(manifest.tensors.length, 2 + 12 * 2 + 2);
    // wte is stored with its real rows: a [50257, 64] slice of the [50304, 64] tensor.
    assert.deepEqual(manifest.tensors[0], {
      name: "wte.weight",
      global_shape: [50304, 64],
      split: "vocab",
      axis: 0,
      shards: [{ tp_rank: 0, shape: [50257, 64], slices: [{ offset: [0, 0], shape: [50257, 64] }] }],
    });
    // One line per tensor record keeps the manifest readable.
    const text = await Deno.readTextFile(`${path}/manifest.json`);
    assert.ok(text.includes('\n    {"name":"h.0.attn.c_attn.weight","global_shape":[64,192],"split":"qkv"'));
    assert.deepEqual((await listCheckpoints(`${dir}/j`)).map((c) => c.tensor_parallel), [1]);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("readManifest() reads a version 1 manifest as its TP=1 layout and loadCheckpoint() loads it as before", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = presetConfig("gpt2-tiny");
    const n = paramLayout(model).totalSize;
    const state = { step: 8, params: pattern(n, 31), m: pattern(n, 37), v: pattern(n, 41) };
    const { path } = await saveCheckpoint(`${dir}/job_a`, metaOf(model), state, 1);
    const now: CheckpointManifest = JSON.parse(await Deno.readTextFile(`${path}/manifest.json`));
    const { parallel: _p, vocab: _v, tensors, ...v1 } = now;
    await Deno.writeTextFile(`${path}/manifest.json`, JSON.stringify({ ...v1, version: 1 }, null, 2));
    const read = await readManifest(path);
    assert.equal(read.version, 1);
    assert.deepEqual(read.parallel, { tensor_parallel: 1, data_parallel: 1 });
    assert.deepEqual(read.tensors, tensors);
    assert.equal(read.vocab.tensor_parallel_vocab_size, 50304);
    const { state: back } = await loadCheckpoint(path, model);
    // Moments as stored; weights tensor by tensor (gaps and wte's padded rows are not stored).
    assert.equal(firstDiff(back.m, state.m), -1);
    assert.equal(firstDiff(back.v, state.v), -1);
    for (const t of paramLayout(model).tensors) {
      const size = t.name === "wte.weight" ? 50257 * 64 : t.size;
      const d = firstDiff(
        back.params.subarray(t.offset, t.offset + size),
        state.params.subarray(t.offset, t.offset + size),
      );
      assert.equal(d, -1, t.name);
    }
    await Deno.writeTextFile(`${path}/manifest.json`, JSON.stringify({ ...v1, version: 3 }));
    await assert.rejects(readManifest(path), {
      message:
        `Cannot load checkpoint "${path}": format "gpt2-webgpu-checkpoint" v3 is not "gpt2-webgpu-checkpoint" v1 or v2`,
    });
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("saveCheckpoint() of TP=2 rank states writes a model and an optimizer shard per rank, records each tensor's slices, and loads back at tp 2 exactly", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = tensorParallelConfig(presetConfig("gpt2-tiny"), 2);
    const local = shardLayout(model, 2);
    // Cut from whole buffers (replicated tensors the same on both ranks); padded rows hold values
    // too: at the same layout they come back as saved.
    const [p, m, v] = [101, 211, 307].map((k) =>
      splitParams(model, 2, pattern(paramLayout(model).totalSize, k))
    );
    const ranks = [0, 1].map((r) => ({ step: 12, params: p[r], m: m[r], v: v[r] }));
    const { path } = await saveCheckpoint(`${dir}/job_a`, metaOf(model), ranks, 1, { dataParallel: 3 });
    assert.deepEqual([...Deno.readDirSync(path)].map((e) => e.name).sort(), [
      "config.json",
      "manifest.json",
      "model-tp00-of-02.safetensors",
      "model-tp01-of-02.safetensors",
      "optimizer-tp00-of-02.safetensors",
      "optimizer-tp01-of-02.safetensors",
    ]);
    const manifest = await readManifest(path);
    assert.deepEqual(manifest.parallel, { tensor_parallel: 2, data_parallel: 3 });
    assert.equal(manifest.model.padded_vocab_size, 50432);
    assert.equal(manifest.vocab.rank_vocab_size, 25216);
    const qkv = manifest.tensors.find((t) => t.name === "h.1.attn.c_attn.weight")!;
    assert.deepEqual(qkv.shards[1], {
      tp_rank: 1,
      shape: [64, 96],
      slices: [
        { offset: [0, 32], shape: [64, 32] },
        { offset: [0, 96], shape: [64, 32] },
        { offset: [0, 160], shape: [64, 32] },
      ],
    });
    const wte = manifest.tensors.find((t) => t.name === "wte.weight")!;
    assert.deepEqual(wte.shards.map((s) => s.slices[0].offset), [[0, 0], [25216, 0]]);
    const shard1 = await readSafetensors(`${path}/model-tp01-of-02.safetensors`);
    assert.deepEqual(shard1.metadata, { format: "pt", tensor_parallel: "2", tp_rank: "1" });
    assert.deepEqual(shard1.tensors.get("wte.weight")!.shape, [25216, 64]);
    assert.deepEqual(shard1.tensors.get("h.0.mlp.c_proj.weight")!.shape, [128, 64]);
    const opt1 = await readSafetensors(`${path}/optimizer-tp01-of-02.safetensors`);
    assert.equal(opt1.metadata.layout, "tensors");
    assert.deepEqual(opt1.tensors.get("v.h.0.mlp.c_fc.bias")!.shape, [128]);
    assert.deepEqual((await listCheckpoints(`${dir}/job_a`)).map((c) => c.tensor_parallel), [2]);

    for (const rank of [0, 1]) {
      const { state } = await loadCheckpoint(path, model, { tensorParallel: 2, rank });
      for (const t of local.tensors) {
        for (const k of ["params", "m", "v"] as const) {
          const d = firstDiff(
            state[k].subarray(t.offset, t.offset + t.size),
            ranks[rank][k].subarray(t.offset, t.offset + t.size),
          );
          assert.equal(d, -1, `${k} ${t.name} rank ${rank}`);
        }
      }
    }
    await assert.rejects(loadCheckpoint(path, model, { tensorParallel: 3 }), (e: unknown) => {
      assert.ok(e instanceof ConfigError);
      assert.equal(e.field, "tensor_parallel");
      assert.match(e.message, /tensor_parallel: 3 does not divide n_head 4/);
      return true;
    });
    await assert.rejects(
      loadCheckpoint(path, model, { tensorParallel: 2, rank: 2 }),
      /rank must be in \[0, 2\)/,
    );
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("loadCheckpoint() reshards a TP=2 checkpoint to tp 1 and tp 4: moments with their weights, real rows bit for bit, padded rows zero", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const base = presetConfig("gpt2-tiny"), two = tensorParallelConfig(base, 2);
    const full2 = paramLayout(two);
    const whole = (k: number) => {
      const a = new Float32Array(full2.totalSize);
      for (const t of full2.tensors) a.set(pattern(t.size, k + t.offset), t.offset); // padded rows non-zero
      return a;
    };
    const want = { params: whole(3), m: whole(5), v: whole(7) };
    const [p, m, v] = [want.params, want.m, want.v].map((a) => splitParams(two, 2, a));
    const ranks = [0, 1].map((r) => ({ step: 9, params: p[r], m: m[r], v: v[r] }));
    const { path } = await saveCheckpoint(`${dir}/job_a`, metaOf(two), ranks, 1);

    // At tp 1 (50304 rows): every tensor as merged, wte's real rows kept and its padded rows zero.
    const { state } = await loadCheckpoint(path, base);
    const l1 = paramLayout(base);
    assert.equal(state.params.length, l1.totalSize);
    for (const t of l1.tensors) {
      const src = full2.byName.get(t.name)!;
      const real = t.name === "wte.weight" ? 50257 * 64 : t.size;
      for (const k of ["params", "m", "v"] as const) {
        const got = state[k].subarray(t.offset, t.offset + t.size);
        assert.equal(
          firstDiff(got.subarray(0, real), want[k].subarray(src.offset, src.offset + real)),
          -1,
          `${k} ${t.name}`,
        );
        assert.ok(got.subarray(real).every((x) => x === 0), `${k} ${t.name} padding`);
      }
    }
    // Weights alone, for generation: the same as the training load.
    assert.equal(firstDiff(await loadCheckpointWeights(path, base), state.params), -1);

    // At tp 4 (50688 rows): rank r holds rank r's cut of the same tensors.
    const four = tensorParallelConfig(base, 4);
    const got4 = await Promise.all(
      [0, 1, 2, 3].map((rank) => loadCheckpoint(path, four, { tensorParallel: 4, rank })),
    );
    const merged = mergeParams(four, 4, got4.map((g) => g.state.m));
    const l4 = paramLayout(four);
    for (const t of l4.tensors) {
      const src = full2.byName.get(t.name)!;
      const real = t.name === "wte.weight" ? 50257 * 64 : t.size;
      const row = merged.subarray(t.offset, t.offset + t.size);
      assert.equal(
        firstDiff(row.subarray(0, real), want.m.subarray(src.offset, src.offset + real)),
        -1,
        t.name,
      );
      assert.ok(row.subarray(real).every((x) => x === 0), `${t.name} padding`);
    }
    assert.equal(got4[3].manifest.parallel.tensor_parallel, 2);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});

Deno.test("saveCheckpoint() of rank states refuses a non-finite weight naming the rank, and states of the wrong layout", async () => {
  const dir = await Deno.makeTempDir({ prefix: "gpt2_ckpt_" });
  try {
    const model = tensorParallelConfig(presetConfig("gpt2-tiny"), 2);
    const n = shardLayout(model, 2).totalSize;
    const rank = () => ({
      step: 4,
      params: new Float32Array(n),
      m: new Float32Array(n),
      v: new Float32Array(n),
    });
    const bad = [rank(), rank()];
    bad[1].params[77] = Infinity;
    await assert.rejects(saveCheckpoint(`${dir}/job_a`, metaOf(model), bad, 1), {
      message:
        "Refusing to save checkpoint at iteration 4: parameter 77 of tensor-parallel rank 1 is Infinity",
    });
    const short = [rank(), { ...rank(), m: new Float32Array(10) }];
    await assert.rejects(saveCheckpoint(`${dir}/job_a`, metaOf(model), short, 1), {
      message: `Cannot save checkpoint at iteration 4: m of rank 1 has 10 floats, the layout ${n}`,
    });
    assert.deepEqual(await listCheckpoints(`${dir}/job_a`), []);
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
