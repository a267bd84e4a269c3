/**
 * Stage 8: the training sampler. Serves batches of windows of `seqLen + 1` consecutive tokens
 * (inputs and shifted targets), deterministic from a seed, never running out: when the
 * iterations outrun the data it starts a new epoch, reshuffled, and says so.
 *
 * An epoch is a permutation of the non-overlapping windows (start offsets `offset + k * seqLen`,
 * with a per-epoch random offset so window boundaries move between epochs). Data-parallel rank r
 * of w takes every w-th window of the shared permutation, so ranks see disjoint windows. The
 * whole state is `{epoch, position}`: a checkpoint stores it and a resumed sampler continues
 * exactly where the old one stopped.
 */

/** Resumable sampler state: JSON-serialisable, stored in checkpoints. */
export interface SamplerState {
  /** Epoch number, from 0. */
  epoch: number;
  /** Windows this rank has consumed in the current epoch. */
  position: number;
}

/** Options of {@link Sampler}. */
export interface SamplerOptions {
  /** Sequence length: each window holds seqLen + 1 tokens. */
  seqLen: number;
  /** Windows per batch. */
  batchSize: number;
  /** Seed of the shuffles. */
  seed: number;
  /** This data-parallel rank (default 0). */
  rank?: number;
  /** Number of data-parallel ranks (default 1). */
  worldSize?: number;
  /** Called when a new epoch starts (default: a log line on the console). */
  onEpoch?: (epoch: number) => void;
}

/** splitmix32: a tiny seeded PRNG for the shuffles. */
function splitmix32(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = s;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
    return (z ^ (z >>> 16)) >>> 0;
  };
}

/** Batches of token windows, shuffled per epoch, sharded by rank, resumable from its state. */
export class Sampler {
  /** Tokens of the split. */
  readonly tokens: Uint16Array;
  /** Sequence length. */
  readonly seqLen: number;
  /** Windows per batch. */
  readonly batchSize: number;
  /** Seed. */
  readonly seed: number;
  /** This rank. */
  readonly rank: number;
  /** Number of ranks. */
  readonly worldSize: number;
  /** Windows in one epoch over all ranks. */
  readonly windows: number;
  /** Windows this rank sees per epoch. */
  readonly windowsPerRank: number;
  /** Called when a new epoch starts. */
  onEpoch?: (epoch: number) => void;
  #epoch = 0;
  #position = 0;
  #permEpoch = -1;
  #perm: Uint32Array;
  #offset = 0;

  /**
   * A sampler over `tokens`. Throws when the split cannot hold one window of `seqLen + 1` tokens
   * per rank. `state` resumes a previous sampler with the same tokens and options.
   */
  constructor(tokens: Uint16Array, opts: SamplerOptions, state?: SamplerState) {
    const { seqLen, batchSize, seed } = opts;
    const rank = opts.rank ?? 0, worldSize = opts.worldSize ?? 1;
    if (!Number.isInteger(seqLen) || seqLen < 1) {
      throw new RangeError(`seqLen must be a positive integer, got ${seqLen}`);
    }
    if (!Number.isInteger(batchSize) || batchSize < 1) {
      throw new RangeError(`batchSize must be a positive integer, got ${batchSize}`);
    }
    if (
      !Number.isInteger(worldSize) || worldSize < 1 || !Number.isInteger(rank) || rank < 0 ||
      rank >= worldSize
    ) {
      throw new RangeError(`rank must be in [0, worldSize), got rank ${rank} of worldSize ${worldSize}`);
    }
    this.tokens = tokens;
    this.seqLen = seqLen;
    this.batchSize = batchSize;
    this.seed = seed >>> 0;
    this.rank = rank;
    this.worldSize = worldSize;
    this.windows = tokens.length > 0 ? Math.floor((tokens.length - 1) / seqLen) : 0;
    this.windowsPerRank = Math.floor(this.windows / worldSize);
    if (this.windowsPerRank < 1) {
      throw new Error(
        `Split of ${tokens.length} tokens is too small for one window of seqLen + 1 = ${seqLen + 1} tokens` +
          (worldSize > 1 ? ` per rank (${worldSize} ranks)` : "") + ` with seqLen ${seqLen}`,
      );
    }
    this.onEpoch = opts.onEpoch ??
      ((epoch) =>
        console.log(
          `Sampler: epoch ${epoch} begins (${this.windowsPerRank} windows of ${seqLen + 1} tokens per rank)`,
        ));
    this.#perm = new Uint32Array(this.windows);
    if (state) {
      const { epoch, position } = state;
      if (
        !Number.isInteger(epoch) || epoch < 0 || !Number.isInteger(position) || position < 0 ||
        position > this.windowsPerRank
      ) {
        throw new RangeError(
          `Invalid sampler state {"epoch": ${epoch}, "position": ${position}}: position must be in [0, ${this.windowsPerRank}]`,
        );
      }
      this.#epoch = epoch;
      this.#position = position;
    }
  }

  /** The state to store in a checkpoint: `new Sampler(tokens, opts, state)` continues exactly. */
  get state(): SamplerState {
    return { epoch: this.#epoch, position: this.#position };
  }

  /** Build the permutation and offset of the current epoch. */
  #shuffle(): void {
    const rand = splitmix32(
      Math.imul(this.seed ^ 0x5bd1e995, 0x01000193) ^ Math.imul(this.#epoch + 1, 0x9e3779b9),
    );
    const perm = this.#perm;
    for (let i = 0; i < perm.length; i++) perm[i] = i;
    for (let i = perm.length - 1; i > 0; i--) {
      const j = rand() % (i + 1);
      const t = perm[i];
      perm[i] = perm[j];
      perm[j] = t;
    }
    const slack = this.tokens.length - 1 - this.windows * this.seqLen;
    this.#offset = rand() % (slack + 1);
    this.#permEpoch = this.#epoch;
  }

  /** Start offset of the next window for this rank (advancing the epoch when needed). */
  nextWindowStart(): number {
    if (this.#position >= this.windowsPerRank) {
      this.#epoch++;
      this.#position = 0;
      this.onEpoch?.(this.#epoch);
    }
    if (this.#permEpoch !== this.#epoch) this.#shuffle();
    const w = this.#perm[this.#position * this.worldSize + this.rank];
    this.#position++;
    return this.#offset + w * this.seqLen;
  }

  /** The next batch: batchSize rows of seqLen + 1 consecutive tokens, row-major. */
  nextBatch(): Uint16Array {
    const len = this.seqLen + 1;
    const out = new Uint16Array(this.batchSize * len);
    for (let b = 0; b < this.batchSize; b++) {
      const start = this.nextWindowStart();
      out.set(this.tokens.subarray(start, start + len), b * len);
    }
    return out;
  }
}
