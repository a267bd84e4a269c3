/**
 * Tests of the data-parallel sampler (data/sampler.ts): ranks read disjoint contiguous slices of
 * each global batch, DP=N reproduces DP=1 with N× accumulation (same windows, same order), and
 * the checkpointed state is the global position, so a DP=2 job resumes at DP=1 (and DP=3 at
 * DP=1) with the identical continuation.
 */
import assert from "node:assert/strict";
import { Sampler, type SamplerState } from "../../data/mod.ts";

const tokens = Uint16Array.from({ length: 2001 }, (_, i) => (i * 7) % 65536);
const seqLen = 16, seed = 11, quiet = { onEpoch: () => {} };

/** The windows of `steps` global batches as DP=`dp` ranks draw them, rank by rank, micro-batch by micro-batch. */
function globalBatches(
  dp: number,
  micro: number,
  accumulation: number,
  steps: number,
  state?: SamplerState,
): { batches: Uint16Array[][]; states: SamplerState[] } {
  const ranks = Array.from(
    { length: dp },
    (_, rank) =>
      new Sampler(
        tokens,
        { seqLen, batchSize: micro, accumulation, seed, rank, worldSize: dp, ...quiet },
        state,
      ),
  );
  const batches: Uint16Array[][] = [], states: SamplerState[] = [];
  for (let s = 0; s < steps; s++) {
    batches.push(ranks.flatMap((r) => Array.from({ length: accumulation }, () => r.nextBatch())));
    for (const r of ranks) assert.deepEqual(r.state, ranks[0].state, "ranks disagree on the global position");
    states.push(ranks[0].state);
  }
  return { batches, states };
}

/** Concatenates a global batch's micro-batches into one array of rows. */
const flat = (micro: Uint16Array[]) => Uint16Array.from(micro.flatMap((m) => [...m]));

Deno.test("Sampler: DP=2 × micro 4 reads what DP=1 reads with micro 4 × 2 accumulation steps, over epochs", () => {
  const dp2 = globalBatches(2, 4, 1, 30), dp1 = globalBatches(1, 4, 2, 30), big = globalBatches(1, 8, 1, 30);
  assert.ok(dp1.states.at(-1)!.epoch >= 1, "the run crosses an epoch");
  for (let s = 0; s < 30; s++) {
    assert.deepEqual(flat(dp2.batches[s]), flat(dp1.batches[s]), `global batch ${s}`);
    assert.deepEqual(flat(dp1.batches[s]), flat(big.batches[s]), `global batch ${s} vs micro 8`);
  }
  assert.deepEqual(dp2.states, dp1.states);
});

Deno.test("Sampler: DP=3 × micro 2 × 2 accumulation matches DP=1 × micro 3 × 4 (sizes not divisible by 3)", () => {
  const dp3 = globalBatches(3, 2, 2, 25), dp1 = globalBatches(1, 3, 4, 25);
  for (let s = 0; s < 25; s++) {
    assert.deepEqual(flat(dp3.batches[s]), flat(dp1.batches[s]), `global batch ${s}`);
  }
});

Deno.test("Sampler: the ranks' slices of a global batch are disjoint windows", () => {
  const ranks = Array.from(
    { length: 3 },
    (_, rank) =>
      new Sampler(tokens, { seqLen, batchSize: 5, accumulation: 2, seed, rank, worldSize: 3, ...quiet }),
  );
  for (let step = 0; step < 3; step++) {
    const starts = ranks.flatMap((r) => Array.from({ length: 10 }, () => r.nextWindowStart()));
    assert.equal(new Set(starts).size, 30, `global batch ${step} repeats a window`);
  }
});

Deno.test("Sampler: a DP=2 checkpoint resumes at DP=1 (and DP=3 at DP=1) with the identical continuation", () => {
  const whole = globalBatches(2, 4, 1, 40);
  const saved: SamplerState = JSON.parse(JSON.stringify(whole.states[22]));
  const resumed = globalBatches(1, 4, 2, 17, saved);
  for (let s = 0; s < 17; s++) {
    assert.deepEqual(flat(resumed.batches[s]), flat(whole.batches[23 + s]), `step ${23 + s}`);
  }
  const three = globalBatches(3, 2, 1, 20);
  const at1 = globalBatches(1, 6, 1, 10, three.states[9]);
  for (let s = 0; s < 10; s++) {
    assert.deepEqual(flat(at1.batches[s]), flat(three.batches[10 + s]), `step ${10 + s}`);
  }
});

Deno.test("Sampler: a partly drawn global batch is not in the state, so a resume replays it whole", () => {
  const s = new Sampler(tokens, { seqLen, batchSize: 4, accumulation: 3, seed, ...quiet });
  s.nextBatch();
  s.nextBatch();
  assert.deepEqual(s.state, { epoch: 0, position: 0 });
  s.nextBatch();
  assert.deepEqual(s.state, { epoch: 0, position: 12 });
  assert.throws(
    () => new Sampler(tokens, { seqLen, batchSize: 4, accumulation: 0, seed }),
    /accumulation must be a positive integer, got 0/,
  );
});
