/**
 * Model configuration: presets, the padded vocabulary, parameter counts, and clear errors naming
 * the field for invalid configs, including sizes beyond the device's limits.
 */

import assert from "node:assert/strict";
import {
  ConfigError,
  makeConfig,
  padVocab,
  parameterCount,
  paramLayout,
  PRESET_NAMES,
  presetConfig,
  validateSeqLen,
} from "../../model/config.ts";
import type { GpuContext } from "../../engine/device.ts";
import { checkFits } from "../../engine/graph/mod.ts";

function throwsField(fn: () => unknown, field: string, pattern: RegExp) {
  assert.throws(fn, (e: unknown) => {
    assert.ok(e instanceof ConfigError, `expected a ConfigError, got ${e}`);
    assert.equal(e.field, field);
    assert.match(e.message, pattern);
    return true;
  });
}

Deno.test("presetConfig() keeps the real and the padded vocabulary", () => {
  const c = presetConfig("gpt2-345M");
  assert.deepEqual(c, {
    n_layer: 24,
    n_head: 16,
    n_embd: 1024,
    n_positions: 1024,
    vocab_size: 50257,
    padded_vocab_size: 50304,
  });
  assert.equal(padVocab(50257), 50304);
  assert.equal(presetConfig("gpt2-124M").n_layer, 12);
});

Deno.test("parameterCount() matches Megatron's 354,871,296 for 345M and the layout for every preset", () => {
  assert.equal(parameterCount(presetConfig("gpt2-345M")), 354871296);
  assert.equal(parameterCount(presetConfig("gpt2-124M")), 124475904);
  assert.equal(parameterCount(presetConfig("gpt2-774M")), 774090240);
  assert.equal(parameterCount(presetConfig("gpt2-1558M")), 1557686400);
  for (const name of PRESET_NAMES) {
    const c = presetConfig(name);
    assert.equal(paramLayout(c).numParams, parameterCount(c), name);
  }
});

Deno.test("paramLayout() puts every decayed 2-D tensor before the biases and LayerNorm parameters", () => {
  const layout = paramLayout(presetConfig("gpt2-tiny"));
  for (const t of layout.tensors) {
    assert.equal(t.offset % 64, 0, `${t.name} is 256-byte aligned`);
    assert.equal(t.decay, t.shape.length === 2, t.name);
    assert.equal(t.offset < layout.decayEnd, t.decay, t.name);
  }
  assert.ok(layout.byName.has("h.1.mlp.c_proj.weight") && layout.byName.has("ln_f.bias"));
});

Deno.test("makeConfig() names the invalid field", () => {
  const ok = { n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 };
  throwsField(() => makeConfig({ ...ok, n_embd: 66 }), "n_embd", /not divisible by n_head 4/);
  throwsField(() => makeConfig({ ...ok, n_layer: 0 }), "n_layer", /positive integer, got 0/);
  throwsField(() => makeConfig({ ...ok, n_head: 1.5 }), "n_head", /positive integer/);
  throwsField(() => makeConfig({ ...ok, n_embd: 4 * 129, n_head: 1 }), "n_embd", /at most 128/);
  throwsField(
    () => makeConfig({ ...ok, padded_vocab_size: 50000 }),
    "padded_vocab_size",
    /at least vocab_size/,
  );
  throwsField(() => presetConfig("gpt2-xxl"), "model", /unknown preset "gpt2-xxl"/);
  throwsField(() => validateSeqLen(makeConfig(ok), 65), "seq_len", /past the position table of 64/);
});

Deno.test("checkFits() refuses sizes beyond the device's limits before allocating", () => {
  const ctx = {
    limits: {
      maxStorageBufferBindingSize: 256 * 2 ** 20,
      maxBufferSize: 2 ** 31,
      maxComputeWorkgroupStorageSize: 32768,
      maxComputeInvocationsPerWorkgroup: 256,
      maxComputeWorkgroupsPerDimension: 65535,
      maxStorageBuffersPerShaderStage: 8,
    },
  } as unknown as GpuContext;
  const shape = { config: presetConfig("gpt2-124M"), B: 8, T: 1024, attnDropout: 0, hiddenDropout: 0 };
  // Logits and parameters are chunked; the MLP activations of one layer still bind whole.
  throwsField(
    () => checkFits(ctx, { ...shape, B: 32 }),
    "batch_size",
    /buffer "l0.qkv" of 301989888 bytes exceeds the device's storage binding limit/,
  );
  checkFits(ctx, shape);
  const xl = { ...shape, config: presetConfig("gpt2-1558M"), B: 1 };
  throwsField(() => checkFits(ctx, xl), "model", /tensor "wte.weight" of 321945600 bytes exceeds/);
  throwsField(() => checkFits(ctx, { ...shape, B: 1, T: 2048 }), "seq_len", /past the position table/);
  throwsField(() => checkFits(ctx, { ...shape, B: 0 }), "batch_size", /positive integer/);
  checkFits(ctx, { ...shape, config: presetConfig("gpt2-tiny"), B: 4, T: 64 });
});
