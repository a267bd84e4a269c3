/**
 * What the generator's callers hand it and get back: sampling parameters, sizing options, the
 * tokens (and log-probabilities) a stream produced, and where a step spent its time.
 */

import type { GraphOptions } from "../graph/mod.ts";
import type { CompileListener } from "../ops.ts";
import type { Readback } from "../readback.ts";

/**
 * How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters.
 * `logprobs` (0 … LOGPROBS_MAX) asks for the chosen token's log-probability and that many top ones.
 */
export interface SamplingParams {
  temperature: number;
  top_k: number;
  top_p: number;
  seed: number;
  logprobs?: number;
}

/** Generator sizing. */
export interface GeneratorOptions {
  /** Most streams decoded together (KV-cache slots, allocated by need). */
  maxStreams: number;
  /** Most tokens a stream gets per `step`. */
  chunk: number;
  /** Prompt tokens (padded) per prefill batch; a longer prompt runs alone. Default 2048. */
  prefillTokens?: number;
  /**
   * CPU adapters: read the decode weights through uniform buffers (gemvUboWgsl, gemvUboLayerWgsl;
   * default true). false keeps the storage-buffer kernels that GPUs run (tests cover both).
   */
  cpuUniform?: boolean;
  /**
   * CPU adapters: sample with the one-invocation kernel, which has no barriers (sampleDirectWgsl).
   * Default: where the adapter has no subgroups, i.e. Mesa's OpenGL llvmpipe, which compiles the
   * workgroup kernel's barriers for minutes (the direct one in about 20 s); Mesa's Vulkan lavapipe
   * compiles the workgroup kernel in about a second.
   */
  directSampler?: boolean;
  /**
   * Decode steps per queue submission within a step (default 4): the GPU starts on the first
   * steps while the rest are still being encoded.
   */
  submitEvery?: number;
  /**
   * Queue submissions a prefill batch is cut into: with more than one, the GPU starts on the first
   * layers while the later ones are still being encoded. Default 6 on GPUs (H200, 124M, a lone
   * 32-token prompt: 3.38 ms from step to its first token in one submission, 2.68 in 6), 1 on CPU
   * adapters (lavapipe runs each submission as it comes: 21 ms in one, 36 in 6).
   */
  prefillPieces?: number;
  /**
   * Record a lone stream's next chunk while the GPU still runs the one being read, and only submit
   * it once the tokens are handed out (`runAhead`), so the GPU does not idle through its encoding:
   * wgpu's `finish` of 4 decode steps took 1.2-2.3 ms of the H200 host's CPU, `submit` 0.1. Only
   * when the chunk being read is at least as long (its GPU time covers the recording). Default true.
   */
  prerecord?: boolean;
  /**
   * Weights the decode LM head reads over up to GEMV_T_MAX_ROWS rows on GPUs: "f32" (default) wte
   * itself; "f16" a copy of wte rounded to f16 at load (Vp × C halves), half the bytes a step
   * reads, summed in f32 (gemvTWgsl's `weights`). A prefill's head, larger batches and CPU
   * adapters' head kernels read wte.
   */
  lmHead?: "f32" | "f16";
  /** Hears of each kernel compiled, with the total of the plan being built (see OpBatch.compile). */
  onCompile?: CompileListener;
  /**
   * Reads the chunks of a lone stream back through this reader's canvas path where it serves their
   * size (engine/readback.ts: well under a millisecond for a chunk's few KB, against mapAsync's 10 ms
   * floor); null or absent, or several streams: mapAsync.
   */
  readback?: Readback | null;
  /**
   * Kernel choices, for tests and benchmarks: of the prefill plans (see BuildOptions.kernels), e.g.
   * the GPUs' tiled kernels on a CPU adapter, or other matmul tile rules; and `cpuHead` false, on
   * a CPU adapter the LM head the GPUs run (gemvTWgsl, tiled above GEMV_T_MAX_ROWS rows) instead
   * of wte transposed, in uniform blocks or per thread.
   */
  kernels?: {
    tileRules?: NonNullable<GraphOptions["kernels"]>["tileRules"];
    cpuDirect?: boolean;
    cpuHead?: boolean;
    /**
     * Decode steps of at most this many rows leave the two residual reduces of each layer to the
     * gemv that normalises their sum next (graph/decode_step.ts residualFused): two kernels a layer
     * fewer, the same values. Default 0 (off).
     */
    residualRows?: number;
    /**
     * The sampler's passes written out to their ends and its rank loops 4 candidates a trip
     * (SampleSpec.writtenRest): the same picks and logprobs. Default false.
     */
    writtenSampler?: boolean;
  };
}

/** Where the last `step` spent its time (wall-clock ms on the JS thread). */
export interface StepTiming {
  /** Encoding and submitting the decode steps (the prefill excluded). */
  encodeMs: number;
  /** From the last submission until the readback arrived. */
  waitMs: number;
  /** Of which issuing the readback's mapAsync (it blocks until the GPU has run all queued work). */
  mapMs: number;
  /** Decode steps run. */
  steps: number;
  /**
   * Whether the readback waited for the GPU on this thread (the canvas path): the event loop did
   * not run meanwhile, so messages from other threads have not been taken in.
   */
  blocked: boolean;
}

/** Log-probabilities of one generated token (natural log, the model's raw distribution). */
export interface TokenLogprobs {
  logprob: number;
  /** The most likely tokens, best first. */
  top: { id: number; logprob: number }[];
}

/** What one stream produced in a step. */
export interface StreamOutput {
  tokens: number[];
  /** One entry per token when the stream asked for logprobs, else null. */
  logprobs: TokenLogprobs[] | null;
  /**
   * Tokens the stream may still be handed out: its `maxTokens` (Generator.admit) less those handed
   * out so far (Infinity without one). A stream is never handed more than its maxTokens; at 0 it
   * is done.
   */
  left: number;
}
