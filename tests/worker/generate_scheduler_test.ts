/**
 * The continuous-batching policy and GPU roles, without a GPU: admission in arrival order up to
 * the free slots and the prefill token budget (one long prompt still admitted alone), short first
 * chunks when admitting (none when nothing runs), chunks bounded by what the streams still need and
 * by the step time budget (and the steps queued ahead by it, a first chunk after admitting), queueing when full; and
 * GPT2_GPU_ROLES parsing with its errors.
 */

import { deepStrictEqual as assertEquals, throws as assertThrows } from "node:assert/strict";
import { planStep, type SchedulerLimits } from "../../worker/batching.ts";
import { generationGpus, parseGpuRoles, trainingGpus } from "../../server/gpus/roles.ts";

const limits: SchedulerLimits = { chunk: 16, firstChunk: 4, prefillTokens: 100 };
const req = (promptTokens: number, maxTokens = 50) => ({ promptTokens, maxTokens });

Deno.test("planStep() admits in arrival order up to the free slots and runs a short first chunk", () => {
  const waiting = [req(10), req(10), req(10)];
  assertEquals(planStep(waiting, 2, [30], limits), { admit: 2, steps: 4, ahead: 4 });
  // Nothing else running: the prefill's first tokens come back at once.
  assertEquals(planStep(waiting, 5, [], limits), { admit: 3, steps: 0, ahead: 4 });
});

Deno.test("planStep() keeps a step within its time budget at the measured time per decode step", () => {
  assertEquals(planStep([], 4, [40], { ...limits, stepBudgetMs: 250 }, 100), {
    admit: 0,
    steps: 2,
    ahead: 2,
  });
  assertEquals(planStep([], 4, [40], { ...limits, stepBudgetMs: 250 }, 400), {
    admit: 0,
    steps: 1,
    ahead: 1,
  });
  assertEquals(planStep([], 4, [40], { ...limits, stepBudgetMs: 250 }, 2), {
    admit: 0,
    steps: 16,
    ahead: 16,
  });
  assertEquals(planStep([req(5)], 4, [40], { ...limits, stepBudgetMs: 250 }, 100), {
    admit: 1,
    steps: 2,
    ahead: 2,
  });
});

Deno.test("planStep() queues when no slot is free and decodes a full chunk for the running streams", () => {
  assertEquals(planStep([req(10)], 0, [40, 3], limits), { admit: 0, steps: 16, ahead: 16 });
  assertEquals(
    planStep([], 4, [5, 3], limits),
    { admit: 0, steps: 5, ahead: 16 },
    "no more steps than needed",
  );
  assertEquals(planStep([], 4, [], limits), { admit: 0, steps: 0, ahead: 16 });
});

Deno.test("planStep() keeps a step's prefill within the token budget, but admits one long prompt alone", () => {
  assertEquals(planStep([req(60), req(60), req(10)], 8, [], limits).admit, 1);
  assertEquals(planStep([req(500), req(10)], 8, [], limits).admit, 1);
  assertEquals(planStep([req(40), req(40), req(20), req(1)], 8, [], limits).admit, 3);
});

Deno.test("planStep() runs no more decode steps than the streams need (a prefill samples the first token)", () => {
  assertEquals(planStep([req(5, 1)], 4, [9], limits), { admit: 1, steps: 4, ahead: 4 });
  assertEquals(planStep([req(5, 1)], 4, [], limits), { admit: 1, steps: 0, ahead: 4 });
  assertEquals(planStep([req(5, 3)], 4, [7], { ...limits, chunk: 2 }), { admit: 1, steps: 1, ahead: 2 });
});

Deno.test("parseGpuRoles() reads one role per GPU and refuses bad lists naming the entry", () => {
  const r = parseGpuRoles("train,generate", 3);
  assertEquals(trainingGpus(r), [0, 2]);
  assertEquals(generationGpus(r), [1, 2]);
  assertEquals(generationGpus(parseGpuRoles(undefined, 2)), [0, 1]);
  assertEquals(trainingGpus(parseGpuRoles("any, train+generate", 2)), [0, 1]);
  assertThrows(() => parseGpuRoles("train,cook", 2), /entry "cook" for GPU 1 must be train, generate or any/);
  assertThrows(() => parseGpuRoles("train,train", 2), /leaves no GPU to generate/);
  assertThrows(() => parseGpuRoles("train,generate,any", 2), /names 3 GPUs, there are 2/);
});
