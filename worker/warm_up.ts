/**
 * The Worker's part of the start-up rehearsal, in one place. Two things make a first request
 * meet nothing cold:
 *
 * - At a model's load, every kernel is compiled and every plan run once (Generator.warm with
 *   `reserve` and `rehearse`) before the first request, since pipeline creation blocks this thread
 *   and compiling later, beside running streams, stalled them (H200: cold first tokens 10-39 times
 *   the warm ones when shapes compiled on first use). Beside training, the first request comes
 *   first: only the single-stream decode is built at the load (its prompt's prefill on
 *   admission), and the rest once the batcher is first idle, with training held as during a load
 *   (a 124M load's warm-up takes 2.3-4.6 s on an H200 with the driver's cache full, 11-16 s
 *   without).
 * - A rehearsal of the request path (WorkerGeneration.rehearsal, the server's start-up warm-up,
 *   whose HTTP side is server/rehearsal.ts) is answered as a generation's messages come, with no
 *   model or GPU.
 */

import { type GpuContext, isCpuAdapter } from "../engine/device.ts";
import type { Generator } from "../engine/generator.ts";
import { epochMs, type FromWorker, type WorkerGeneration } from "../protocol.ts";

/**
 * Warms a generator just loaded: fully (see above), or with `training` only the single-stream
 * decode, returning "deferred" (then call warmDeferred once idle); "none" where `warmAtLoad` is
 * off (default: on GPUs, off on CPU adapters, whose kernels compile on first use).
 */
export async function warmAtLoad(
  ctx: GpuContext,
  gen: Generator,
  opts: { warmAtLoad?: boolean; training: boolean },
): Promise<"full" | "deferred" | "none"> {
  if (!(opts.warmAtLoad ?? !isCpuAdapter(ctx))) return "none";
  if (opts.training) {
    await gen.warm({ rows: 1, prefill: false });
    return "deferred";
  }
  await gen.warm({ reserve: true, rehearse: true });
  return "full";
}

/** The rest of a warm-up deferred at a load beside training (warmAtLoad's "deferred"). */
export async function warmDeferred(gen: Generator): Promise<void> {
  await gen.warm({ reserve: true, rehearse: true });
}

/**
 * Answers a rehearsal (WorkerGeneration.rehearsal) through `post` as a generation's messages come:
 * started (its hops' stamps), then after `later` (a later task) the prompt's first tokens (at most
 * max_tokens, 8) and done. It takes no slot and is not counted; its use is the code it runs in
 * the GPU host and the HTTP process, which a burst of users' first requests would otherwise meet
 * cold.
 */
export async function answerRehearsal(
  post: (msg: FromWorker) => void,
  req: WorkerGeneration,
  later: () => Promise<void>,
): Promise<void> {
  const { sent_at, relayed_at, received_at } = req;
  const admitted_at = epochMs();
  post({
    type: "gen_started",
    id: req.id,
    load_ms: 0,
    stamps: { sent_at, relayed_at, received_at, admitted_at },
  });
  await later();
  const tokens = req.prompt.slice(0, Math.min(req.max_tokens, 8));
  if (tokens.length > 0) post({ type: "gen_tokens", id: req.id, tokens, first_at: epochMs() });
  post({
    type: "gen_done",
    id: req.id,
    reason: "length",
    error: null,
    completion_tokens: tokens.length,
  });
}
