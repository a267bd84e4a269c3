/**
 * The training sampler of SFT: batches of packed rows (data/chat.ts packChats) with their loss
 * masks. It is the token sampler (data/sampler.ts) over one window per row, so shuffling, epochs,
 * data-parallel slices and the resumable state are exactly the plain sampler's.
 */
import { type PackedBatch, packedBatch, type PackedRows } from "./chat.ts";
import { Sampler, type SamplerOptions, type SamplerState } from "./sampler.ts";

/** Batches of packed conversation rows, shuffled per epoch, sharded by rank, resumable. */
export class PackedSampler {
  readonly packed: PackedRows;
  readonly #rows: Sampler;
  readonly #seqLen: number;
  readonly #batchSize: number;

  /** A sampler over `packed`'s rows; `state` resumes one with the same rows and options. */
  constructor(packed: PackedRows, opts: SamplerOptions, state?: SamplerState) {
    if (packed.rows < 1) throw new Error("No conversation fits: the chat dataset packs into 0 rows");
    this.packed = packed;
    this.#seqLen = opts.seqLen;
    this.#batchSize = opts.batchSize;
    // One window of seqLen tokens per row, from offset 0 (no slack): window k starts at k·seqLen.
    this.#rows = new Sampler(new Uint16Array(packed.rows * opts.seqLen + 1), {
      ...opts,
      onEpoch: opts.onEpoch ??
        ((e) => console.log(`Sampler: epoch ${e} begins (${packed.rows} packed rows)`)),
    }, state);
  }

  /** The state to store in a checkpoint (see Sampler.state). */
  get state(): SamplerState {
    return this.#rows.state;
  }

  /** The next batch of rows with their loss masks. */
  nextBatch(): PackedBatch {
    const rows = Array.from({ length: this.#batchSize }, () => this.#rows.nextWindowStart() / this.#seqLen);
    return packedBatch(this.packed, this.#seqLen, rows);
  }
}
