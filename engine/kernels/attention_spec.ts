/**
 * Attention's problem sizes and tilings, and the choosers that fit them to a device: the spec every
 * attention kernel generator (attention.ts, attention_flash.ts) takes, the bindings they share, and
 * the FLOP count. Pure arithmetic, no WGSL beyond the binding declarations.
 */

import { dropWgsl, type StorageDtype } from "./common.ts";

/** Attention problem sizes and tiling. */
export interface AttentionSpec {
  B: number;
  T: number;
  H: number;
  /** Head size (multiple of 4). */
  D: number;
  /** Queries per workgroup (threads of the forward and dQ kernels). */
  BQ: number;
  /** Keys per tile (threads of the dK/dV kernel). */
  BKV: number;
  /** Attention dropout: its site's slot of the dropout uniform is bound at group 1 (see dropWgsl). */
  dropout?: { site: number; nSites: number };
  /**
   * Threads per row: 1 = the plain kernels; 2 or 4 = the subgroup variants (forward, dK/dV,
   * dQ), where S adjacent threads split a row's head dimension (needs the "subgroups" feature,
   * a subgroup size ≥ S, and D/4 divisible by S).
   */
  split?: 1 | 2 | 4 | 8;
  /**
   * Split backward kernels: keys per group of S threads in the dK/dV kernel (default 1). R keys
   * share each query row read from workgroup memory, so a thread does R times the multiply-adds
   * per load; its registers grow by the same factor.
   */
  kvRows?: 1 | 2 | 4;
  /** Split backward kernels: queries per group of S threads in the dQ kernel (default 1), as kvRows. */
  qRows?: 1 | 2 | 4;
  /** Split dK/dV kernel: query rows written out per trip of its loop (default 1; see BackwardTiling.unroll). */
  kvUnroll?: 1 | 2 | 4;
  /** Split dQ kernel: key rows written out per trip of its loop (default 1). */
  qUnroll?: 1 | 2 | 4;
  /**
   * The split backward kernels' and the dS·K kernel's tile fills (storage to workgroup memory)
   * written out, one block per trip of the fill loop, so each thread's loads of a tile are in
   * flight together (the loop's counter otherwise keeps them one at a time). Same values.
   */
  writtenFills?: boolean;
  /**
   * Split dK/dV kernel: each query row's score and dP sums reduce-scattered over the S threads of a
   * group (each shuffle level halves the values a thread sends, until one key's pair is left, so a
   * thread takes the exp of one key instead of all R), then the probabilities and dS gathered back:
   * 14 shuffled values a row instead of 24 at S = 8, R = 4, and no selects (each thread holds its
   * keys in an order of its own). The same additions in the same order as the butterfly, so the
   * same values bit for bit. Needs kvRows > 1 (no effect at 1).
   */
  scatterSums?: boolean;
  /** The dK/dV kernel's own tiling, replacing split, BQ, BKV and kvRows for it (see backwardKVSpec). */
  bwdKV?: BackwardTiling;
  /** The dQ kernel's own tiling, replacing split, BQ, BKV and qRows for it (see backwardQSpec). */
  bwdQ?: BackwardTiling;
  /**
   * Split dK/dV kernel: also write each dS entry it computes to binding 5 (`dst`, f32,
   * query-major), for the dQ kernel of attention_dq.ts to read instead of recomputing them.
   */
  writeDS?: boolean;
  /** Element type of qkv and of the output y in memory (arithmetic is f32); default f32. */
  dtype?: StorageDtype;
  /** Element type of the gradients dy and dqkv in memory; default f32. */
  gradDtype?: StorageDtype;
  /**
   * FlashAttention-2 style register blocking for the forward (see flashForwardWgsl; the fused
   * backward experiment in bench/experiments/ reads it too); `split` is then unused.
   */
  flash?: FlashOptions;
  /**
   * CPU adapters: one thread per query (forward, dQ) or key (dK/dV) reading keys and queries
   * straight from storage, with no workgroup memory and no barriers, which Mesa compiles in a
   * fraction of a second instead of 2-20 s (see attentionForwardDirectWgsl). Same loop order and
   * arithmetic as the plain kernels; `split` and `flash` are then unused.
   */
  direct?: boolean;
}

/**
 * A split backward kernel's tiling: S threads per row, the BQ-query and BKV-key tiles, and rows per
 * thread group (keys in dK/dV, queries in dQ).
 */
export interface BackwardTiling {
  split: 1 | 2 | 4 | 8;
  BQ: number;
  BKV: number;
  rows: 1 | 2 | 4;
  /**
   * Rows of the loop (queries for dK/dV, keys for dQ) written out per trip, default 1: their
   * loads, shuffles and exps are independent, so they overlap; the sums are the same.
   */
  unroll?: 1 | 2 | 4;
}

/** The spec the dK/dV kernel runs: `s` with its own tiling applied (its grid is ceil(T/BKV), H, B). */
export function backwardKVSpec(s: AttentionSpec): AttentionSpec {
  const t = s.bwdKV;
  return t ? { ...s, split: t.split, BQ: t.BQ, BKV: t.BKV, kvRows: t.rows, kvUnroll: t.unroll } : s;
}

/** The spec the dQ kernel runs: `s` with its own tiling applied (its grid is ceil(T/BQ), H, B). */
export function backwardQSpec(s: AttentionSpec): AttentionSpec {
  const t = s.bwdQ;
  return t ? { ...s, split: t.split, BQ: t.BQ, BKV: t.BKV, qRows: t.rows, qUnroll: t.unroll } : s;
}

/**
 * How the flash kernels block the work. `lanes` threads share 4 query rows (forward, dQ) or 4
 * keys (dK/dV); each holds a 4 × BKV/lanes block of scores and a 4 × D/lanes block of its
 * output. Row statistics combine across the lanes by subgroup shuffles ("subgroup": needs the
 * feature and a subgroup of at least `lanes`) or through workgroup memory ("shared").
 */
export interface FlashOptions {
  lanes: 4 | 8 | 16;
  reduce: "subgroup" | "shared";
  /** Load the next K/V tile into registers while the current one is multiplied (default true). */
  prefetch?: boolean;
}

/** Picks tiles that fit the device's workgroup memory. */
export function chooseAttentionTiles(
  dims: Pick<AttentionSpec, "T" | "D">,
  maxWorkgroupBytes: number,
): { BQ: number; BKV: number } {
  let BQ = 64, BKV = 32;
  const bwdBytes = (bq: number, bkv: number) => (2 * bq * dims.D + 2 * bkv * (dims.D + 4) + 2 * bq) * 4;
  while (BKV > 8 && bwdBytes(BQ, BKV) > maxWorkgroupBytes) {
    if (BQ > BKV) BQ /= 2;
    else BKV /= 2;
  }
  while (BQ > 8 && bwdBytes(BQ, BKV) > maxWorkgroupBytes) BQ /= 2;
  return { BQ: Math.min(BQ, 64), BKV };
}

/** The widest split (4, 2 or 1) that divides D/4; 1 without subgroups. */
export function chooseAttentionSplit(D: number, hasSubgroups: boolean): 1 | 2 | 4 {
  if (!hasSubgroups) return 1;
  return (D / 4) % 4 === 0 ? 4 : (D / 4) % 2 === 0 ? 2 : 1;
}

/**
 * The split backward kernels' own tilings, where the device fits them: candidates in order of
 * their speed measured on an H200 (bench/attention_bench.ts, GPT-2 124M and 345M at T = 1024; see
 * bench/RESULTS.md), the first that fits each kernel. Smaller tiles of the rows a workgroup loops
 * over (queries for dK/dV, keys for dQ) leave room for more workgroups per SM, and several rows per
 * thread group share each row read. Null for a kernel where none fits (the shared tiling stays).
 */
export function chooseBackwardTilings(
  dims: Pick<AttentionSpec, "T" | "D">,
  lim: { maxWorkgroupBytes: number; maxThreads: number; subgroupMinSize: number },
  candidates: { kv: readonly BackwardTiling[]; q: readonly BackwardTiling[] } = {
    kv: BACKWARD_KV_TILINGS,
    q: BACKWARD_Q_TILINGS,
  },
): { bwdKV?: BackwardTiling; bwdQ?: BackwardTiling } {
  const fits = (t: BackwardTiling, kv: boolean) =>
    lim.subgroupMinSize >= t.split && (dims.D / 4) % t.split === 0 &&
    (kv ? t.BKV : t.BQ) % t.rows === 0 && ((kv ? t.BKV : t.BQ) / t.rows) * t.split <= lim.maxThreads &&
    (kv ? splitKVBytes(t.BQ, dims.D) : splitQBytes(t.BKV, dims.D)) <= lim.maxWorkgroupBytes;
  const kv = candidates.kv.find((t) => fits(t, true));
  const q = candidates.q.find((t) => fits(t, false));
  return { ...(kv ? { bwdKV: kv } : {}), ...(q ? { bwdQ: q } : {}) };
}

/** dK/dV tilings, fastest first (see chooseBackwardTilings). */
export const BACKWARD_KV_TILINGS: readonly BackwardTiling[] = [
  // Unroll 4: 1.327 -> 1.294 ms a 124M layer alone (bench attention --quick, 2026-12-05).
  { split: 8, BQ: 32, BKV: 64, rows: 4, unroll: 4 },
  { split: 4, BQ: 32, BKV: 64, rows: 2 },
];

/**
 * dK/dV tilings with the sums reduce-scattered (AttentionSpec.scatterSums), preferred first: 4
 * threads a key and 2 keys a group, timed alone on the H200 at 1.189 against 1.290 ms a 124M layer
 * and 1.527 against 1.653 for 345M (bench attention --quick, issue 38, fifth session), then the
 * butterfly's own.
 */
export const SCATTER_KV_TILINGS: readonly BackwardTiling[] = [
  { split: 4, BQ: 32, BKV: 64, rows: 2, unroll: 4 },
  ...BACKWARD_KV_TILINGS,
];

/** dQ tilings, fastest first (see chooseBackwardTilings). */
export const BACKWARD_Q_TILINGS: readonly BackwardTiling[] = [
  // Unroll 4: 1.056 -> 0.876 ms a 124M layer alone (same run); the step 212.9 -> 210.3 ms.
  { split: 4, BQ: 64, BKV: 32, rows: 2, unroll: 4 },
];

/**
 * Tiles for the split (subgroup) backward kernels: the dK/dV kernel runs BKV·S threads and keeps
 * Q/dO tiles of BQ rows plus lse/delta in workgroup memory; the dQ kernel runs BQ·S threads with
 * K/V tiles of BKV rows, as does the split forward (BQ·S threads).
 */
export function chooseSplitAttentionTiles(
  dims: Pick<AttentionSpec, "T" | "D">,
  maxWorkgroupBytes: number,
  split: number,
  maxThreads = 256,
): { BQ: number; BKV: number } {
  let BQ = 64, BKV = 64;
  while (BQ > 8 && BQ * split > maxThreads) BQ /= 2;
  while (BKV > 8 && BKV * split > maxThreads) BKV /= 2;
  while (BQ > 8 && splitKVBytes(BQ, dims.D) > maxWorkgroupBytes) BQ /= 2;
  while (BKV > 8 && splitQBytes(BKV, dims.D) > maxWorkgroupBytes) BKV /= 2;
  return { BQ, BKV };
}

/** Workgroup bytes of the split dK/dV kernel (Q, dO tiles; lse, delta). */
export const splitKVBytes = (BQ: number, D: number) => (2 * BQ * D + 2 * BQ) * 4;
/** Workgroup bytes of the split dQ kernel and of the forward (K, V tiles). */
export const splitQBytes = (BKV: number, D: number) => 2 * BKV * D * 4;

export function header(s: AttentionSpec) {
  const D4 = s.D / 4, C4 = (s.H * s.D) / 4, R4 = 3 * C4;
  return { D4, C4, R4, scale: 1 / Math.sqrt(s.D) };
}

/** Bindings of the forward kernels: qkv in, y and lse out (and the dropout uniform). */
export function forwardBindings(s: AttentionSpec): string {
  return `@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> lse: array<f32>;
${s.dropout ? dropWgsl() : ""}`;
}

/** The dS scratch's element type as the dK/dV kernel writes it: R consecutive keys per store. */
const dsType = (R: number) => (R === 1 ? "f32" : `vec${R}<f32>`);

/**
 * Bindings of the backward kernels: qkv, dy, lse, delta in, dqkv out (and the dropout uniform; the
 * dS scratch where the dK/dV kernel writes it, `s` being that kernel's spec).
 */
export function backwardBindings(s: AttentionSpec): string {
  return `@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> dy: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> lse: array<f32>;
@group(0) @binding(3) var<storage, read> delta: array<f32>;
@group(0) @binding(4) var<storage, read_write> dqkv: array<vec4<f32>>;
${s.writeDS ? `@group(0) @binding(5) var<storage, read_write> dst: array<${dsType(s.kvRows ?? 1)}>;` : ""}
${s.dropout ? dropWgsl() : ""}`;
}

/** FLOPs of causal attention forward (QKᵀ and PV over the lower triangle). */
export function attentionFlops(s: Pick<AttentionSpec, "B" | "T" | "H" | "D">): number {
  return 2 * 2 * s.B * s.H * s.D * (s.T * (s.T + 1)) / 2;
}
