/**
 * Checkpoint files without a GPU: safetensors round trips and header layout, Hugging Face tensor
 * names and shapes, the real-vocabulary wte export and zero-padded import, config.json, the
 * manifest, atomic save with pruning, replacing a same-named checkpoint, refusing non-finite
 * weights, removal of stale temporaries, and refusal of mismatched checkpoints.
 */

import assert from "node:assert/strict";
import { makeConfig, paramLayout, presetConfig } from "../gpu/config.ts";
import {
  checkpointName,
  decodeSafetensors,
  encodeSafetensors,
  exportTensors,
  importTensors,
  listCheckpoints,
  loadCheckpoint,
  readSafetensors,
  removeStaleCheckpointTemporaries,
  saveCheckpoint,
  type TrainConfig,
  writeSafetensors,
} from "../jobs/mod.ts";

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
    const { state } = await loadCheckpoint(saved.path, model);
    for (const t of now.tensors) {
      const src = old.byName.get(t.name)!;
      assert.equal(state.m[t.offset], src.offset, t.name);
      assert.equal(state.v[t.offset + t.size - 1], -(src.offset + t.size - 1), t.name);
    }
  } finally {
    await Deno.remove(dir, { recursive: true });
  }
});
