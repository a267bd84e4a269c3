/**
 * Stage 8: the training sampler. Serves batches of windows of `seqLen + 1` consecutive tokens
 * (inputs and shifted targets), deterministic from a seed, never running out: when the
 * iterations outrun the data it starts a new epoch, reshuffled, and says so.
 *
 * An epoch is a permutation of the non-overlapping windows (start offsets `offset + k * seqLen`,
 * with a per-epoch random offset so window boundaries move between epochs); epochs follow one
 * another as one global stream of windows. Data parallelism cuts that stream into global batches
 * of `batchSize × accumulation × worldSize` windows (Megatron's global batch: micro-batch ×
 * accumulation steps × data-parallel ranks); rank r takes the r-th contiguous slice of each
 * global batch, as `accumulation` micro-batches. So ranks see disjoint windows, and DP=2 with
 * micro-batch 4 reads exactly the windows DP=1 reads with micro-batch 4 and 2 accumulation steps.
 *
 * The whole state is the global position `{epoch, position}` (windows of the epoch consumed by
 * all ranks together, at the start of the first global batch this rank has not finished), the
 * same on every rank and independent of the data-parallel size: a checkpoint stores it and a job
 * resumes exactly, at the same or another data-parallel size.
 */

/** Resumable sampler state: JSON-serialisable, stored in checkpoints. */
export interface SamplerState {
  /** Epoch number, from 0. */
  epoch: number;
  /** Windows of the epoch consumed by all ranks together (in [0, windows]: a finished epoch reads as its last). */
  position: number;
}

/** Options of {@link Sampler}. */
export interface SamplerOptions {
  /** Sequence length: each window holds seqLen + 1 tokens. */
  seqLen: number;
  /** Windows per (micro-)batch of this rank. */
  batchSize: number;
  /** Micro-batches per rank in one global batch (gradient accumulation steps; default 1). */
  accumulation?: number;
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
  /** Micro-batches per rank in one global batch. */
  readonly accumulation: number;
  /** Seed. */
  readonly seed: number;
  /** This rank. */
  readonly rank: number;
  /** Number of ranks. */
  readonly worldSize: number;
  /** Windows in one epoch over all ranks. */
  readonly windows: number;
  /** Windows per epoch divided among the ranks (at least 1). */
  readonly windowsPerRank: number;
  /** Windows in one global batch: batchSize × accumulation × worldSize. */
  readonly globalBatchWindows: number;
  /** Called when a new epoch starts. */
  onEpoch?: (epoch: number) => void;
  /** Global stream index of the first window of the current global batch. */
  #next = 0;
  /** Windows this rank has drawn from the current global batch. */
  #drawn = 0;
  /** Last epoch this sampler has entered (announced through onEpoch when it grows). */
  #entered = 0;
  #permEpoch = -1;
  #perm: Uint32Array;
  #offset = 0;

  /**
   * A sampler over `tokens`. Throws when the split cannot hold one window of `seqLen + 1` tokens
   * per rank. `state` resumes a previous sampler with the same tokens and options.
   */
  constructor(tokens: Uint16Array, opts: SamplerOptions, state?: SamplerState) {
    const { seqLen, batchSize, seed } = opts;
    const rank = opts.rank ?? 0, worldSize = opts.worldSize ?? 1, accumulation = opts.accumulation ?? 1;
    if (!Number.isInteger(seqLen) || seqLen < 1) {
      throw new RangeError(`seqLen must be a positive integer, got ${seqLen}`);
    }
    if (!Number.isInteger(batchSize) || batchSize < 1) {
      throw new RangeError(`batchSize must be a positive integer, got ${batchSize}`);
    }
    if (!Number.isInteger(accumulation) || accumulation < 1) {
      throw new RangeError(`accumulation must be a positive integer, got ${accumulation}`);
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
    this.accumulation = accumulation;
    this.globalBatchWindows = batchSize * accumulation * worldSize;
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
        position > this.windows
      ) {
        throw new RangeError(
          `Invalid sampler state {"epoch": ${epoch}, "position": ${position}}: position must be in [0, ${this.windows}]`,
        );
      }
      this.#next = epoch * this.windows + position;
      this.#entered = epoch;
    }
  }

  /**
   * The state to store in a checkpoint: `new Sampler(tokens, opts, state)` continues exactly, with
   * any data-parallel size and accumulation. A global batch this rank has only partly drawn is
   * not counted, so a resume replays it whole.
   */
  get state(): SamplerState {
    const k = this.#next;
    if (k === 0) return { epoch: 0, position: 0 };
    const epoch = Math.floor((k - 1) / this.windows);
    return { epoch, position: k - epoch * this.windows };
  }

  /** Build the permutation and offset of `epoch`. */
  #shuffle(epoch: number): void {
    const rand = splitmix32(
      Math.imul(this.seed ^ 0x5bd1e995, 0x01000193) ^ Math.imul(epoch + 1, 0x9e3779b9),
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
    this.#permEpoch = epoch;
  }

  /** Start offset of the next window for this rank (advancing the epoch when needed). */
  nextWindowStart(): number {
    const perRank = this.batchSize * this.accumulation;
    const k = this.#next + this.rank * perRank + this.#drawn;
    if (++this.#drawn === perRank) {
      this.#next += this.globalBatchWindows;
      this.#drawn = 0;
    }
    const epoch = Math.floor(k / this.windows);
    while (this.#entered < epoch) this.onEpoch?.(++this.#entered);
    if (this.#permEpoch !== epoch) this.#shuffle(epoch);
    return this.#offset + this.#perm[k - epoch * this.windows] * this.seqLen;
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
