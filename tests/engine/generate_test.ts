/**
 * Generation on the GPU with continuous batching: streams admitted at different steps, released
 * midway and refilled, through the fused skinny gemv (≤ 8 rows) and the tiled matmul (more), with
 * the KV cache growing as streams arrive, each equal to the CPU reference's greedy continuation
 * token for token; seeded sampling gives the same tokens alone or in a batch; logprobs equal the
 * reference's log-softmax; top-k 1 is greedy; padded vocabulary ids are never produced.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { Generator, type SamplingParams } from "../../engine/generator.ts";
import { createReadback } from "../../engine/readback.ts";
import { referenceForward } from "../reference/cpu_gpt2.ts";
import { Trainer } from "../../engine/trainer.ts";
import { noGpu, testContext } from "../_helpers.ts";

const config = makeConfig({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 });

let trained: Promise<Float32Array> | null = null;
/** A briefly trained tiny model (trained once, shared by the tests), so logits are not near-ties. */
function trainedParams(): Promise<Float32Array> {
  trained ??= train();
  return trained;
}

async function train(): Promise<Float32Array> {
  const ctx = (await testContext())!;
  const B = 2, T = 32;
  const tr = await Trainer.create(ctx, {
    config,
    batchSize: B,
    seqLen: T,
    schedule: { lr: 1e-2, min_lr: 1e-3, warmup_iters: 2, decay_iters: 30, style: "cosine" },
    adamw: { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0, clip_grad: 1 },
    attnDropout: 0,
    hiddenDropout: 0,
    seed: 3,
  });
  const tokens = new Uint16Array(B * (T + 1)).map((_, i) =>
    [464, 3290, 318, 257, 1310, 13, 198][i % 7] + (i % 5)
  );
  for (let i = 0; i < 30; i++) tr.trainStep(tokens);
  const { params } = await tr.exportState();
  tr.destroy();
  return params;
}

const greedy: SamplingParams = { temperature: 0, top_k: 0, top_p: 1, seed: 0 };
const prompts = Array.from(
  { length: 11 },
  (_, i) =>
    Array.from({ length: 2 + (i * 5) % 11 }, (_, j) => [464, 3290, 318, 257, 1310, 13, 198][(i + j) % 7] + i),
);

/**
 * The reference's greedy choice after each prefix of `prompt + tokens`, from one forward pass
 * (teacher forcing): equals `tokens` exactly when they are the reference's greedy continuation.
 */
function referenceArgmaxes(p64: Float64Array, prompt: number[], tokens: number[]): number[] {
  const seq = [...prompt, ...tokens], T = seq.length, Vp = config.padded_vocab_size;
  const { logits } = referenceForward(config, p64, Int32Array.from([...seq, 0]), 1, T);
  return tokens.map((_, i) => {
    const row = logits.subarray((prompt.length - 1 + i) * Vp, (prompt.length + i) * Vp);
    let best = 0;
    for (let v = 1; v < config.vocab_size; v++) if (row[v] > row[best]) best = v;
    return best;
  });
}

/** Runs one step and appends each stream's tokens to `got` (by stream index, through `owner`). */
async function collect(
  gen: Generator,
  owner: Map<number, number>,
  got: number[][],
  steps: number,
): Promise<void> {
  for (const [h, o] of await gen.step(steps)) got[owner.get(h)!].push(...o.tokens);
}

for (const cpuUniform of [true, false]) {
  Deno.test({
    name:
      `Generator continuous batching: greedy equals the reference for streams admitted and released at any step${
        cpuUniform ? "" : " (storage-buffer kernels, as on GPUs)"
      }`,
    ignore: noGpu,
    fn: async () => {
      const params = await trainedParams();
      const p64 = Float64Array.from(params);
      const N = 10;
      const ctx = (await testContext())!;
      const gen = await Generator.create(ctx, config, params, {
        maxStreams: N,
        chunk: 8,
        cpuUniform,
      });
      assert.equal(gen.capacity, 4, "the cache starts small");
      const got: number[][] = prompts.map(() => []);
      const owner = new Map<number, number>();
      const admit = async (i: number) => owner.set(await gen.admit(prompts[i], greedy), i);
      // Three streams, one step; five more join (prefilled beside the decode); then three more (9+ rows).
      for (const i of [0, 1, 2]) await admit(i);
      await collect(gen, owner, got, 7);
      for (const i of [3, 4, 5, 6, 7]) await admit(i);
      await collect(gen, owner, got, 7);
      // Stream 1 leaves early (after 15 tokens): its row is refilled and its slot reused, the others must not notice.
      gen.release([...owner].find(([, i]) => i === 1)![0]);
      for (const i of [8, 9, 10]) await admit(i);
      assert.equal(gen.free, 0);
      assert.equal(gen.capacity, N, "the cache grew by need");
      await assert.rejects(() => gen.admit(prompts[0], greedy), RangeError, "past maxStreams");
      // Ten rows: the tiled matmul and separate LayerNorm and KV-append kernels.
      await collect(gen, owner, got, 3);
      const lengths = got.map((t) => t.length);
      assert.deepEqual(lengths, [18, 15, 18, 11, 11, 11, 11, 11, 4, 4, 4]);
      for (let i = 0; i < prompts.length; i++) {
        assert.deepEqual(got[i], referenceArgmaxes(p64, prompts[i], got[i]), `stream ${i}`);
      }
      gen.destroy();
    },
  });
}

Deno.test({
  name:
    "Generator prefill with the GPUs' tiled kernels and split-K forward matmuls (as an H200 runs short prompts): greedy equals the reference",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const p64 = Float64Array.from(params);
    const ctx = (await testContext())!;
    // Every forward matmul of the prefill split in 3 slices of K (partial sums, then bias, gelu
    // or the residual in the reduction), as the measured rules do for few rows on an H200.
    const split = { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4, gen: 2, buffers: 2, splitK: 3 } as const;
    const gen = await Generator.create(ctx, config, params, {
      maxStreams: 4,
      chunk: 6,
      cpuUniform: false,
      kernels: { cpuDirect: false, tileRules: [{ layout: "NN", tile: split }] },
    });
    const got: number[][] = [[], [], []];
    const owner = new Map<number, number>();
    for (const i of [0, 1, 2]) owner.set(await gen.admit(prompts[i + 3], greedy), i);
    await collect(gen, owner, got, 5);
    for (let i = 0; i < 3; i++) {
      assert.equal(got[i].length, 6);
      assert.deepEqual(got[i], referenceArgmaxes(p64, prompts[i + 3], got[i]), `stream ${i}`);
    }
    gen.destroy();
  },
});

Deno.test({
  name:
    "Generator seeded sampling gives the same tokens alone or batched; top_k 1 is greedy; real vocabulary only",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const gen = await Generator.create((await testContext())!, config, params, { maxStreams: 6, chunk: 10 });
    const prompt = [464, 3290, 318];
    const hot = (seed: number): SamplingParams => ({ temperature: 1.5, top_k: 0, top_p: 1, seed });
    const run = async (s: SamplingParams, others = 0) => {
      const extra = [];
      for (let i = 0; i < others; i++) extra.push(await gen.admit(prompts[i], hot(100 + i)));
      const h = await gen.admit(prompt, s);
      const tokens = (await gen.step(9)).get(h)!.tokens;
      for (const e of [...extra, h]) gen.release(e);
      return tokens;
    };
    const a = await run(hot(42));
    const b = await run(hot(42), 5);
    const c = await run(hot(43));
    assert.equal(a.length, 10);
    assert.deepEqual(a, b, "same seed, same tokens, alone or among five");
    assert.notDeepEqual(a, c, "another seed, other tokens");
    assert.ok([...a, ...c].every((t) => t < config.vocab_size), "no padded ids");
    const g = await run(greedy);
    assert.deepEqual(
      await run({ temperature: 1.0, top_k: 1, top_p: 1, seed: 9 }),
      g,
      "top_k 1 equals greedy",
    );
    assert.deepEqual(
      await run({ temperature: 1.0, top_k: 0, top_p: 1e-6, seed: 5 }),
      g,
      "tiny top_p is greedy",
    );
    gen.destroy();
  },
});

for (const cpuUniform of [true, false]) {
  Deno.test({
    name: `Generator logprobs equal the reference's log-softmax, chosen and top 3${
      cpuUniform ? "" : " (storage-buffer kernels, as on GPUs: the decode's fused reduces)"
    }`,
    ignore: noGpu,
    fn: async () => {
      const params = await trainedParams();
      const p64 = Float64Array.from(params);
      const gen = await Generator.create((await testContext())!, config, params, {
        maxStreams: 2,
        chunk: 4,
        cpuUniform,
      });
      const prompt = [464, 3290, 318, 257];
      const other = await gen.admit(prompts[3], greedy);
      const h = await gen.admit(prompt, { temperature: 0.9, top_k: 0, top_p: 1, seed: 7, logprobs: 3 });
      const out = (await gen.step(3)).get(h)!;
      assert.equal((await Promise.resolve(out.tokens)).length, 4);
      assert.equal(out.logprobs!.length, 4);
      const seq = [...prompt];
      for (const [i, id] of out.tokens.entries()) {
        const T = seq.length;
        const { logits } = referenceForward(config, p64, Int32Array.from([...seq, 0]), 1, T);
        const row = Array.from(
          logits.subarray((T - 1) * config.padded_vocab_size).slice(0, config.vocab_size),
        );
        const mx = Math.max(...row);
        const lse = mx + Math.log(row.reduce((a, x) => a + Math.exp(x - mx), 0));
        const lp = out.logprobs![i];
        assert.ok(
          Math.abs(lp.logprob - (row[id] - lse)) < 1e-3,
          `token ${i}: ${lp.logprob} vs ${row[id] - lse}`,
        );
        const order = row.map((x, v) => [x, v]).sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, 3);
        assert.deepEqual(lp.top.map((t) => t.id), order.map((o) => o[1]), `token ${i} top ids`);
        for (const [k, t] of lp.top.entries()) assert.ok(Math.abs(t.logprob - (order[k][0] - lse)) < 1e-3);
        seq.push(id);
      }
      assert.equal((await gen.step(0)).get(other)!.logprobs, null, "a stream that did not ask gets none");
      gen.destroy();
    },
  });
}

Deno.test({
  name:
    "Generator with the direct sampler (OpenGL's default) draws what the workgroup sampler draws: seeded top-k, top-p, logprobs",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const ctx = (await testContext())!;
    const draws: number[][][] = [];
    const lps: number[][] = [];
    for (const directSampler of [false, true]) {
      const gen = await Generator.create(ctx, config, params, { maxStreams: 3, chunk: 6, directSampler });
      const hs = [
        await gen.admit(prompts[0], { temperature: 0.8, top_k: 40, top_p: 1, seed: 11 }),
        await gen.admit(prompts[1], { temperature: 1, top_k: 0, top_p: 0.9, seed: 12, logprobs: 2 }),
        await gen.admit(prompts[2], { temperature: 1.2, top_k: 100, top_p: 0.8, seed: 13 }),
      ];
      const out = await gen.step(5);
      draws.push(hs.map((h) => out.get(h)!.tokens));
      lps.push(out.get(hs[1])!.logprobs!.map((l) => l.logprob));
      gen.destroy();
    }
    assert.deepEqual(draws[1], draws[0]);
    assert.ok(draws[0].every((t) => t.length === 6), JSON.stringify(draws[0]));
    for (const [i, lp] of lps[1].entries()) assert.ok(Math.abs(lp - lps[0][i]) < 1e-4, `logprob ${i}`);
  },
});

for (const fast of [false, true]) {
  Deno.test({
    name:
      `Generator running ahead: the same greedy tokens while streams join and leave with a chunk still queued; maxTokens bounds it and what is handed out${
        fast ? " (a lone stream's chunks read through the canvas path)" : ""
      }`,
    ignore: noGpu,
    fn: async () => {
      const params = await trainedParams();
      const p64 = Float64Array.from(params);
      const ctx = (await testContext())!;
      const readback = fast ? await createReadback(ctx) : null;
      const gen = await Generator.create(ctx, config, params, { maxStreams: 6, chunk: 8, readback });
      const got: number[][] = [[], [], [], []], lps: number[] = [0, 0, 0, 0];
      const owner = new Map<number, number>();
      const admit = async (i: number, s: SamplingParams = greedy) =>
        owner.set(await gen.admit(prompts[i], s), i);
      const step = async (steps: number, ahead: number) => {
        for (const [h, o] of await gen.step(steps, ahead)) {
          const i = owner.get(h)!;
          got[i].push(...o.tokens);
          if (o.logprobs) {
            lps[i] += o.logprobs.length;
            // Greedy: the chosen token is the most likely one.
            for (const l of o.logprobs) assert.ok(Math.abs(l.logprob - l.top[0].logprob) < 1e-6);
          }
        }
      };
      await admit(0);
      await admit(1, { ...greedy, logprobs: 2 });
      await step(3, 5); // prefill + 3 steps; 5 more run ahead
      assert.deepEqual(got.map((t) => t.length), [4, 4, 0, 0]);
      await admit(2); // joins while the 5 steps are queued
      await step(2, 5); // those 5, then its prefill and 2 steps for all; 5 more ahead
      assert.deepEqual(got.map((t) => t.length), [11, 11, 3, 0]);
      assert.equal(gen.timing.steps, 7);
      gen.release([...owner].find(([, i]) => i === 0)![0]); // leaves with 5 steps queued for it
      await step(4, 5); // nothing pending: returns the queued 5 (stream 0's dropped), 5 more ahead
      assert.deepEqual(got.map((t) => t.length), [11, 16, 8, 0]);
      await admit(3); // takes stream 0's slot while the chunk ahead still writes it
      await step(1, 0);
      assert.deepEqual(got.map((t) => t.length), [11, 22, 14, 2]);
      assert.equal(lps[1], 22, "logprobs for every token, across chunks");
      for (let i = 0; i < got.length; i++) {
        assert.deepEqual(got[i], referenceArgmaxes(p64, prompts[i], got[i]), `stream ${i}`);
      }
      for (const h of [...owner.keys()]) gen.release(h);
      // A stream that will be asked for 3 tokens: the generator runs ahead 2 steps, then stops.
      const h = await gen.admit(prompts[4], greedy, 3);
      const seen: number[] = [];
      for (let i = 0; i < 3; i++) seen.push(...((await gen.step(0, 8)).get(h)?.tokens ?? []));
      assert.equal(seen.length, 3);
      assert.deepEqual(seen, referenceArgmaxes(p64, prompts[4], seen));
      assert.equal(gen.timing.steps, 0, "nothing ran past the 3 tokens");
      gen.release(h);
      // Asked for more steps than that, the generator still hands out 3 tokens, and says so.
      const k = await gen.admit(prompts[4], greedy, 3);
      assert.equal(gen.remaining(k), 3);
      const o = (await gen.step(5)).get(k)!;
      assert.deepEqual(o.tokens, seen);
      assert.equal(o.left, 0);
      assert.equal(gen.remaining(k), 0);
      gen.release(k);
      // The last stream leaving drops the chunk that ran ahead for it: nothing is left to read.
      const g = await gen.admit(prompts[5], greedy);
      assert.equal((await gen.step(0, 8)).get(g)?.tokens.length, 1);
      gen.release(g);
      assert.equal((await gen.step(0)).size, 0);
      assert.equal(gen.timing.steps, 0, "the chunk run ahead was not read");
      await assert.rejects(() => gen.step(0, 9), RangeError, "ahead past the chunk");
      gen.destroy();
      if (readback?.canvas) {
        // A lone stream's chunks go through the canvas, several streams' through mapAsync.
        assert.ok(readback.counts.canvas >= 3, `${readback.counts.canvas} chunks through the canvas`);
        assert.equal(readback.counts.mapAsync, 0, "no fallback");
      }
      readback?.destroy();
    },
  });
}

Deno.test({
  name:
    "Generator: a step read through the canvas path hands out its tokens before the chunk run ahead is queued; runAhead queues it, once; prefills in pieces and chunks recorded ahead give the same tokens",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const p64 = Float64Array.from(params);
    const ctx = (await testContext())!;
    const readback = await createReadback(ctx);
    assert.ok(readback.canvas, `the canvas path: ${readback.fallbackReason}`);
    const q = ctx.device.queue, submit = q.submit.bind(q);
    let submits = 0;
    q.submit = (buffers: GPUCommandBuffer[]) => {
      submits++;
      return submit(buffers);
    };
    try {
      for (const prefillPieces of [1, 3]) {
        const gen = await Generator.create(ctx, config, params, {
          maxStreams: 4,
          chunk: 8,
          readback,
          prefillPieces,
        });
        const h = await gen.admit(prompts[0], greedy);
        const tokens = [...(await gen.step(0, 4)).get(h)!.tokens];
        assert.equal(tokens.length, 1, "the prefill's first token");
        const before = submits;
        await gen.runAhead();
        assert.ok(submits > before, "the chunk run ahead was left for runAhead, which queued it");
        const after = submits;
        await gen.runAhead();
        assert.equal(submits, after, "a second runAhead queues nothing");
        tokens.push(...(await gen.step(0, 0)).get(h)!.tokens);
        assert.equal(tokens.length, 5, "the 4 steps run ahead, read by the next step");
        assert.deepEqual(tokens, referenceArgmaxes(p64, prompts[0], tokens), `${prefillPieces} piece(s)`);
        // Never called: the next step queues the chunk itself, and the tokens are the same.
        const g = await gen.admit(prompts[1], greedy);
        const more = [...(await gen.step(0, 4)).get(g)!.tokens];
        more.push(...(await gen.step(0, 0)).get(g)!.tokens);
        assert.equal(more.length, 5);
        assert.deepEqual(more, referenceArgmaxes(p64, prompts[1], more));
        gen.release(h);
        gen.release(g);
        gen.destroy();
      }
      // A lone stream's chunks of 8: from the second on, the next chunk is recorded while the GPU
      // runs the one being read, and runAhead only submits it (one submission, against the remap's
      // and the steps' own without); the tokens are greedy decoding's either way.
      for (const prerecord of [true, false]) {
        const gen = await Generator.create(ctx, config, params, {
          maxStreams: 4,
          chunk: 8,
          readback,
          prerecord,
        });
        const h = await gen.admit(prompts[2], greedy, 1 + 4 + 8 * 4);
        const tokens: number[] = [], perRunAhead: number[] = [];
        for (const ahead of [4, 8, 8, 8, 8, 8]) {
          tokens.push(...((await gen.step(0, ahead)).get(h)?.tokens ?? []));
          const before = submits;
          await gen.runAhead();
          perRunAhead.push(submits - before);
        }
        tokens.push(...((await gen.step(0, 0)).get(h)?.tokens ?? []));
        assert.equal(tokens.length, 1 + 4 + 8 * 4);
        assert.deepEqual(tokens, referenceArgmaxes(p64, prompts[2], tokens), `prerecord ${prerecord}`);
        // Reading the prefill's token and the 4 steps after it: nothing recorded (too short to cover it).
        assert.ok(perRunAhead[0] >= 2 && perRunAhead[1] >= 2, `${perRunAhead}`);
        if (prerecord) assert.deepEqual(perRunAhead.slice(2, 5), [1, 1, 1], `${perRunAhead}`);
        else assert.ok(perRunAhead.slice(2, 5).every((n) => n >= 2), `${perRunAhead}`);
        assert.equal(perRunAhead[5], 0, "nothing left to run ahead past maxTokens");
        gen.release(h);
        gen.destroy();
      }
    } finally {
      q.submit = submit;
      readback.destroy();
    }
  },
});

Deno.test({
  name:
    "Generator.warm() compiles every batch bucket's decode kernels: growing the batch compiles nothing more",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const gen = await Generator.create((await testContext())!, config, params, { maxStreams: 4, chunk: 4 });
    const hs = [await gen.admit(prompts[0], greedy)];
    await gen.step(2); // one stream: the prefill's kernels and bucket 1's
    assert.ok(await gen.warm() >= 0);
    const kernels = gen.kernels;
    for (const i of [1, 2]) {
      hs.push(await gen.admit(prompts[i], greedy)); // alone in its prefill, as the first was
      await gen.step(2); // buckets 2, then 4
    }
    assert.equal(gen.kernels, kernels, "no kernel compiled after warm()");
    for (const h of hs) gen.release(h);
    gen.destroy();
  },
});

Deno.test({
  name:
    "Generator.warm() compiles every prefill shape and reserves the cache: no pipeline is created for any batch of prompts after it, and its rehearsal changes no stream's tokens",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const params = await trainedParams();
    const gen = await Generator.create(ctx, config, params, { maxStreams: 4, chunk: 4, prefillTokens: 64 });
    const shapes = gen.prefillShapes();
    // Up to 8 prompts per batch, lengths bucketed to 32 or n_positions, B·T within 64 tokens.
    assert.deepEqual(shapes, [[1, 32], [1, 64], [2, 32]]);
    await gen.warm({ reserve: true, rehearse: true });
    assert.equal(gen.capacity, 4, "the KV cache reserved for every stream");
    assert.equal(gen.streams, 0, "the rehearsal's streams are gone");
    const device = ctx.device, create = device.createComputePipeline;
    let created = 0;
    device.createComputePipeline = (d: GPUComputePipelineDescriptor) => {
      created++;
      return create.call(device, d);
    };
    try {
      for (const n of [1, 2, 3, 4]) {
        for (const len of [3, 31, config.n_positions - 1]) {
          const hs = [];
          for (let i = 0; i < n; i++) hs.push(await gen.admit(Array(len).fill(11 + i), greedy));
          await gen.step(2);
          for (const h of hs) gen.release(h);
        }
      }
    } finally {
      device.createComputePipeline = create;
    }
    assert.equal(created, 0, "pipelines created after warm()");
    // The rehearsal left nothing behind: the same greedy tokens as a generator never warmed.
    const fresh = await Generator.create(ctx, config, params, { maxStreams: 4, chunk: 4, prefillTokens: 64 });
    const tokensOf = async (g: Generator) => {
      const hs = [await g.admit(prompts[0], greedy), await g.admit(prompts[1], greedy)];
      const out = [await g.step(0), await g.step(3)];
      const got = hs.map((h) => out.flatMap((o) => o.get(h)!.tokens));
      for (const h of hs) g.release(h);
      return got;
    };
    assert.deepEqual(await tokensOf(gen), await tokensOf(fresh));
    fresh.destroy();
    gen.destroy();
  },
});

Deno.test({
  name:
    "A decode step on GPUs is 7 kernels a layer: the attention reduces qkv's partial sums and fcproj reduces fc's (no qkv.sum or fc.sum)",
  ignore: noGpu,
  fn: async () => {
    const params = await trainedParams();
    const labels = async (cpuUniform: boolean) => {
      const gen = await Generator.create((await testContext())!, config, params, {
        maxStreams: 2,
        chunk: 4,
        cpuUniform,
        // The residual reduces kept (decode_dispatch_test.ts covers them left to the next gemv).
        kernels: { residualRows: 0 },
      });
      try {
        await gen.admit(prompts[0], greedy);
        await gen.step(0);
        return (await (await gen.forProfiling()).decode()).map((op) => op.label);
      } finally {
        gen.destroy();
      }
    };
    const gpu = await labels(false);
    const layer = (l: number) =>
      ["qkv.gemv", "attn", "proj.gemv", "proj.sum", "fc.gemv", "fcproj.gemv", "fcproj.sum"].map((k) =>
        `dec.l${l}.${k}`
      );
    assert.deepEqual(gpu, [
      "dec.embed",
      ...Array.from({ length: config.n_layer }, (_, l) => layer(l)).flat(),
      "dec.lnf",
      "dec.lm_head",
      "dec.sample",
    ]);
    // Where fcproj reads its input as uniforms (CPU adapters), the fc reduce stays; qkv's never comes back.
    const cpu = await labels(true);
    assert.equal(cpu.filter((l) => l.endsWith(".fc.sum")).length, config.n_layer);
    assert.equal(cpu.filter((l) => l.endsWith(".qkv.sum")).length, 0);
  },
});
