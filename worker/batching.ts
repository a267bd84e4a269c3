/**
 * The continuous-batching policy of one loaded model, kept free of the GPU so it can be tested
 * alone: at every step, admit waiting requests (first come, first served) into the free stream
 * slots within a prefill token budget, and choose how many decode steps the step runs. A step
 * that admits runs a short chunk, so new requests see their first token soon, while the streams
 * already running keep decoding in the same submission. Requests that do not fit wait in order
 * (nothing is preempted: a stream keeps its slot until it ends).
 */

/** Limits of one batcher (worker/serving.ts). */
export interface SchedulerLimits {
  /** Tokens a stream may get per step (the generator's chunk). */
  chunk: number;
  /** Decode steps of a step that admits requests (time to first token). */
  firstChunk: number;
  /** Prompt tokens prefilled per step; one longer prompt is still admitted alone. */
  prefillTokens: number;
  /** Longest a step should take, in ms, at the measured time per decode step (default 250). */
  stepBudgetMs?: number;
}

/** What the scheduler needs of a waiting request. */
export interface WaitingRequest {
  promptTokens: number;
  maxTokens: number;
}

/** The plan of one step. */
export interface StepPlan {
  /** How many of the waiting requests (from the front) to admit. */
  admit: number;
  /** Decode steps to run after their prefill. */
  steps: number;
  /**
   * Decode steps the generator may queue ahead for the next step: the chunk within the time
   * budget, but only a first chunk after admitting, so requests arriving in a burst join soon.
   */
  ahead: number;
}

/**
 * Plans a step. `free` is the slots free in the generator; `remaining` the tokens each running
 * stream still needs (before this step); `msPerStep` the measured time of one decode step, if known.
 */
export function planStep(
  waiting: readonly WaitingRequest[],
  free: number,
  remaining: readonly number[],
  limits: SchedulerLimits,
  msPerStep?: number,
): StepPlan {
  let admit = 0, tokens = 0;
  while (admit < waiting.length && admit < free) {
    const t = waiting[admit].promptTokens;
    if (admit > 0 && tokens + t > limits.prefillTokens) break;
    tokens += t;
    admit++;
  }
  // A new stream's prefill yields its first token: it needs maxTokens − 1 more from decoding.
  const need = Math.max(0, ...remaining, ...waiting.slice(0, admit).map((w) => w.maxTokens - 1));
  const budget = msPerStep && msPerStep > 0
    ? Math.max(1, Math.floor((limits.stepBudgetMs ?? 250) / msPerStep))
    : limits.chunk;
  let cap = Math.min(limits.chunk, budget);
  const ahead = admit > 0 ? Math.min(cap, limits.firstChunk) : cap;
  if (admit > 0) cap = remaining.length === 0 ? 0 : Math.min(cap, limits.firstChunk, limits.chunk - 1);
  return { admit, steps: Math.min(cap, need), ahead };
}
