/** Tests of stages 7-8: split sizes and errors, sampler determinism, epoch cycling, exact resume and rank shards. */
import assert from "node:assert/strict";
import { parseSplitWeights, Sampler, splitSizes } from "../../data/mod.ts";

const tokens = Uint16Array.from({ length: 1001 }, (_, i) => i);

Deno.test("splitSizes divides tokens by weights and sums to the total", () => {
  assert.deepEqual(splitSizes(100_000, [949, 50, 1], 64), { train: 94_900, valid: 5_000, test: 100 });
  assert.deepEqual(splitSizes(1000, parseSplitWeights("98,2"), 4), { train: 980, valid: 20, test: 0 });
  assert.deepEqual(parseSplitWeights("949, 50, 1"), [949, 50, 1]);
  assert.throws(() => parseSplitWeights("a,b"), /Invalid split "a,b"/);
  assert.throws(() => parseSplitWeights("1,,1"), /Invalid split "1,,1"/); // a missing weight, not 1,1,0
  assert.deepEqual(parseSplitWeights("90/5/5"), [90, 5, 5]);
});

Deno.test("splitSizes names a split too small for one sequence", () => {
  assert.throws(
    () => splitSizes(100_000, [949, 50, 1], 1024),
    /Split "test" gets 100 tokens .* seq_len \+ 1 = 1025/,
  );
});

Deno.test("Sampler batches are windows of seqLen+1 consecutive tokens, deterministic from the seed", () => {
  const a = new Sampler(tokens, { seqLen: 10, batchSize: 4, seed: 42, onEpoch: () => {} });
  const b = new Sampler(tokens, { seqLen: 10, batchSize: 4, seed: 42, onEpoch: () => {} });
  const c = new Sampler(tokens, { seqLen: 10, batchSize: 4, seed: 43, onEpoch: () => {} });
  const batch = a.nextBatch();
  assert.equal(batch.length, 44);
  for (let r = 0; r < 4; r++) {
    const row = batch.subarray(r * 11, r * 11 + 11);
    for (let i = 1; i < 11; i++) assert.equal(row[i], row[0] + i);
  }
  assert.deepEqual(b.nextBatch(), batch);
  assert.notDeepEqual(c.nextBatch(), batch);
});

Deno.test("Sampler cycles epochs with a new order, covering every window once per epoch", () => {
  const epochs: number[] = [];
  const s = new Sampler(tokens, { seqLen: 100, batchSize: 3, seed: 1, onEpoch: (e) => epochs.push(e) });
  assert.equal(s.windowsPerRank, 10);
  const starts: number[] = [];
  for (let i = 0; i < 10; i++) {
    starts.push(...Array.from({ length: 3 }, (_, r) => r).map(() => s.nextWindowStart()));
  }
  assert.deepEqual(epochs, [1, 2]);
  const first = starts.slice(0, 10), second = starts.slice(10, 20);
  assert.deepEqual([...first].sort((x, y) => x - y), first.map((_, i) => i * 100).sort((x, y) => x - y));
  assert.notDeepEqual(first, second);
  assert.deepEqual(s.state, { epoch: 2, position: 10 });
});

Deno.test("Sampler resumes exactly from its JSON state", () => {
  const opts = { seqLen: 16, batchSize: 5, seed: 7, onEpoch: () => {} };
  const full = new Sampler(tokens, opts);
  const reference = Array.from({ length: 40 }, () => full.nextBatch());
  const first = new Sampler(tokens, opts);
  for (let i = 0; i < 17; i++) first.nextBatch();
  const saved = JSON.parse(JSON.stringify(first.state));
  const resumed = new Sampler(tokens, opts, saved);
  for (let i = 17; i < 40; i++) assert.deepEqual(resumed.nextBatch(), reference[i], `batch ${i}`);
  assert.throws(() => new Sampler(tokens, opts, { epoch: 0, position: 999 }), /Invalid sampler state/);
});

Deno.test("Sampler gives data-parallel ranks disjoint windows", () => {
  const seen = new Set<number>();
  for (let rank = 0; rank < 3; rank++) {
    const s = new Sampler(tokens, {
      seqLen: 10,
      batchSize: 1,
      seed: 5,
      rank,
      worldSize: 3,
      onEpoch: () => {},
    });
    for (let i = 0; i < s.windowsPerRank; i++) {
      const start = s.nextWindowStart();
      assert.ok(!seen.has(start), `window ${start} served twice`);
      seen.add(start);
    }
  }
  assert.equal(seen.size, 99);
});

Deno.test("Sampler throws naming the split size and seqLen when one window does not fit", () => {
  assert.throws(
    () => new Sampler(new Uint16Array(64), { seqLen: 64, batchSize: 1, seed: 0 }),
    /Split of 64 tokens is too small for one window of seqLen \+ 1 = 65 tokens with seqLen 64/,
  );
});
