/**
 * A forward-only plan that scores tokens with another plan's weights: `batchSize` rows of
 * `seqLen`, its parameters a buffer it shares (a trainer's fp32 weights, read as they are at each
 * submission), no gradients or optimizer state. Evaluations during training use it when their
 * rows are much shorter than the training window (multiple choice), so a forward pass does not
 * pay for padding; the per-token losses come out as `Trainer.encodeTokenLosses` gives them.
 */

import type { ModelConfig } from "../model/config.ts";
import type { GpuContext } from "./device.ts";
import { checkDevice, GpuError } from "./device.ts";
import { encodeOps } from "./ops.ts";
import { buildModel, destroyModel } from "./graph/mod.ts";
import type { GpuModel } from "./graph/program.ts";

/** Scores rows of tokens with shared weights (see the file's header). */
export class TokenScorer {
  readonly config: ModelConfig;
  readonly batchSize: number;
  readonly seqLen: number;
  #ctx: GpuContext;
  #model: GpuModel;
  #losses: GPUBuffer;

  private constructor(
    ctx: GpuContext,
    model: GpuModel,
    config: ModelConfig,
    batchSize: number,
    seqLen: number,
  ) {
    this.#ctx = ctx;
    this.#model = model;
    this.config = config;
    this.batchSize = batchSize;
    this.seqLen = seqLen;
    const losses = model.buffers.find((b) => b.label === "losses");
    if (!losses) throw new GpuError("Cannot score tokens", 'the plan has no "losses" buffer');
    this.#losses = losses;
  }

  /** Plans `batchSize` × `seqLen` over `params` (the flat fp32 layout of `config`, one buffer). */
  static async create(
    ctx: GpuContext,
    config: ModelConfig,
    params: GPUBuffer,
    batchSize: number,
    seqLen: number,
  ): Promise<TokenScorer> {
    checkDevice(ctx);
    const model = await buildModel(
      ctx,
      { config, B: batchSize, T: seqLen, attnDropout: 0, hiddenDropout: 0 },
      { train: false, params },
    );
    try {
      return new TokenScorer(ctx, model, config, batchSize, seqLen);
    } catch (e) {
      destroyModel(model);
      throw e;
    }
  }

  /** Rows of one LM head chunk (B·T when the head runs in one piece). */
  get headRows(): number {
    return this.#model.headRows;
  }

  /** GPU bytes of the plan's own buffers. */
  get memoryBytes(): number {
    return this.#model.memoryBytes;
  }

  /**
   * Per-token losses of a forward pass on `tokens` (B·(T+1)) copied into `out` at byte `offset`
   * (B·T floats, row b·T + t), then the logits rows `logitRows` (one-chunk heads only). One
   * submission; returns the bytes written.
   */
  encodeTokenLosses(
    tokens: Uint32Array,
    out: GPUBuffer,
    offset: number,
    logitRows: readonly number[] = [],
  ): Promise<number> {
    const B = this.batchSize, T = this.seqLen, m = this.#model;
    const rowBytes = this.config.padded_vocab_size * 4, lossBytes = B * T * 4;
    if (tokens.length !== B * (T + 1)) {
      throw new RangeError(
        `Batch has ${tokens.length} tokens, expected batch_size·(seq_len+1) = ${B * (T + 1)}`,
      );
    }
    if (logitRows.length && m.headRows < B * T) {
      throw new RangeError(`Logits of ${B * T} rows are computed in chunks of ${m.headRows}`);
    }
    for (let i = 0; i < tokens.length; i++) {
      if (tokens[i] >= this.config.vocab_size) {
        throw new RangeError(`Token ${tokens[i]} at ${i} is outside the vocabulary`);
      }
    }
    const q = this.#ctx.device.queue;
    q.writeBuffer(m.tokens, 0, tokens.buffer as ArrayBuffer, tokens.byteOffset, tokens.byteLength);
    const enc = this.#ctx.device.createCommandEncoder();
    encodeOps(enc, [...m.forward, ...m.evalLoss]);
    enc.copyBufferToBuffer(this.#losses, 0, out, offset, lossBytes);
    logitRows.forEach((row, i) => {
      enc.copyBufferToBuffer(m.logits, row * rowBytes, out, offset + lossBytes + i * rowBytes, rowBytes);
    });
    q.submit([enc.finish()]);
    return Promise.resolve(lossBytes + logitRows.length * rowBytes);
  }

  /** Frees the plan's buffers (not the shared weights). */
  destroy(): void {
    destroyModel(this.#model);
  }
}
