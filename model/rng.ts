/**
 * Counter-based random numbers shared bit-for-bit by the GPU kernels (WGSL) and the CPU reference.
 *
 * Dropout never stores a mask: the kept/dropped decision for element `i` of dropout site `s` at
 * step `t` is `pcg(pcg(i) ^ key)` with `key = dropoutKey(seed, t, s)`, recomputed in the backward
 * pass. Sites: 0 is the embedding, then per layer l: 3l+1 attention probabilities, 3l+2 the
 * attention output projection, 3l+3 the MLP output projection.
 */

/** PCG-RXS-M-XS 32-bit hash (u32 → u32). */
export function pcg(v: number): number {
  const state = (Math.imul(v >>> 0, 747796405) + 2891336453) >>> 0;
  const word = Math.imul(((state >>> ((state >>> 28) + 4)) ^ state) >>> 0, 277803737) >>> 0;
  return ((word >>> 22) ^ word) >>> 0;
}

/** WGSL twin of {@link pcg}. */
export const PCG_WGSL = /* wgsl */ `
fn pcg(v: u32) -> u32 {
  let state = v * 747796405u + 2891336453u;
  let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
  return (word >> 22u) ^ word;
}`;

/** Dropout site ids. */
export const dropoutSite = {
  embedding: 0,
  attnProbs: (layer: number) => 3 * layer + 1,
  attnProj: (layer: number) => 3 * layer + 2,
  mlpProj: (layer: number) => 3 * layer + 3,
  count: (nLayer: number) => 3 * nLayer + 1,
};

/**
 * Bytes per site in the dropout uniform: a site's vec4 (key, threshold, bitcast scale, unused) at
 * site · DROPOUT_SLOT_BYTES, where an op binds it (uniform binding offsets align to 256 bytes at
 * most), so kernels never name their site and one pipeline serves every layer.
 */
export const DROPOUT_SLOT_BYTES = 256;

/** The per-step key of one dropout site. */
export function dropoutKey(seed: number, step: number, site: number): number {
  return pcg((pcg(seed >>> 0) ^ pcg((step >>> 0) ^ pcg(site + 0x9e3779b9))) >>> 0);
}

/** u32 threshold: an element is kept when its hash is >= this (probability 1 - p). */
export function dropThreshold(p: number): number {
  if (!(p >= 0 && p < 1)) throw new RangeError(`Dropout probability must be in [0, 1), got ${p}`);
  return Math.min(Math.floor(p * 4294967296), 4294967295) >>> 0;
}

/** Whether element `i` is kept under `key` (CPU twin of the WGSL test `pcg(pcg(i) ^ key) >= threshold`). */
export function dropKeep(i: number, key: number, threshold: number): boolean {
  return pcg((pcg(i >>> 0) ^ key) >>> 0) >= threshold;
}

/** A small seeded PRNG (uniform and normal draws) for parameter initialisation and sampling seeds. */
export class Rng {
  #state: number;
  #spare: number | null = null;
  constructor(seed: number) {
    this.#state = pcg(seed >>> 0) || 1;
  }
  /** Next u32. */
  nextU32(): number {
    this.#state = (this.#state + 0x9e3779b9) >>> 0;
    return pcg(this.#state);
  }
  /** Uniform in (0, 1). */
  uniform(): number {
    return (this.nextU32() + 0.5) / 4294967296;
  }
  /** Standard normal (Box–Muller). */
  normal(): number {
    if (this.#spare !== null) {
      const s = this.#spare;
      this.#spare = null;
      return s;
    }
    const u = this.uniform(), v = this.uniform();
    const r = Math.sqrt(-2 * Math.log(u));
    this.#spare = r * Math.sin(2 * Math.PI * v);
    return r * Math.cos(2 * Math.PI * v);
  }
  /** The generator's state, to store in a checkpoint. */
  get state(): number {
    return this.#state;
  }
  set state(s: number) {
    this.#state = s >>> 0;
    this.#spare = null;
  }
}
