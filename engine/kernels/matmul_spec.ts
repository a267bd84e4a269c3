/**
 * A matmul's spec, tiles and the choice between them: the types every matmul generator takes
 * (matmul.ts, matmul_direct.ts, matmul_ubo.ts), the measured tile table (matmul_tiles.json) and
 * `chooseTile`, the one place that picks a tile, with the checks, sizes and counts that follow from a
 * tile. No WGSL here.
 */

import type { StorageDtype } from "./common.ts";
import TILE_TABLE from "./matmul_tiles.json" with { type: "json" };

/** Fused work after the multiply. */
export type MatmulEpilogue = "store" | "accumulate" | "residual" | "gelu" | "gelu_grad";

/** A matmul shape and its fused epilogue. */
export interface MatmulSpec {
  M: number;
  N: number;
  K: number;
  /** A is stored [K, M] (row-major) instead of [M, K]. */
  transA: boolean;
  /** B is stored [N, K] instead of [K, N]. */
  transB: boolean;
  /** Add bias[N]. */
  bias: boolean;
  epilogue: MatmulEpilogue;
  /** For the residual epilogue: apply seeded dropout of this site (its slot of the uniform at group 1, see dropWgsl). */
  dropout?: { site: number; nSites: number };
  /** Element types in memory of bindings that are not f32 (accumulation is always f32). */
  dtypes?: Partial<Record<MatmulBinding, StorageDtype>>;
  /** "f16": f16 products and sums within each k-tile, flushed to f32 (needs A and B in f16). */
  math?: "f32" | "f16";
  /** Apply GELU to every element of A as it is loaded. */
  prologueA?: "gelu";
  /**
   * Read M, N, K and the split-K slice from a uniform at group 1 (`dims`: vec4<u32>) instead of
   * writing them into the code, where uniformDimsError allows it: shapes that share a tile, a
   * layout and an epilogue then share one pipeline, compiled once (MatmulKernel.dims holds the
   * values to bind). Elsewhere the kernel is generated as without it.
   */
  uniformDims?: boolean;
}

/** Names of a matmul's storage bindings. */
export type MatmulBinding = "A" | "B" | "out" | "bias" | "res" | "out2" | "aux";

/** Block and thread tiling, and (generation 2) how the k loop runs. */
export interface MatmulTile {
  BM: number;
  BN: number;
  BK: number;
  /** Rows per thread: 4, 8 or 12. */
  TM: number;
  /** Columns per thread: 4, 8 or 12 (12: 96-wide blocks of 8 threads, for N = 768). */
  TN: number;
  /** Kernel generation (see the file header); default 1. The fields below need 2. */
  gen?: 1 | 2;
  /** Workgroup buffers per operand: 2 stores the next k-tile while the current one is read. Default 1. */
  buffers?: 1 | 2;
  /** Threads along N of one 32-lane warp (1 to 32); default: plain row-major thread order. */
  warpN?: number;
  /**
   * How a k-contiguous operand (A not transposed, B transposed) is read before its transposing
   * store: "k" as gen 1 (four threads per row), "mn" consecutive threads on consecutive rows
   * (the default).
   */
  transposeLoad?: "k" | "mn";
  /** Split K into up to this many slices (grid z) reduced by a second kernel; default 1. */
  splitK?: number;
  /**
   * With f16 math: k-tiles summed in f16 before each flush into the f32 accumulators (default 1;
   * more trades precision, BK·flushEvery products per f16 sum, for fewer conversions).
   */
  flushEvery?: number;
  /**
   * With f16 math (gen 2): workgroup tiles hold pairs of consecutive k side by side (one vec2<f16>
   * per row or column), and each thread keeps a vec2<f16> partial sum per output (even and odd k),
   * so one packed f16 multiply-add does two useful products with no operand splat. The two halves
   * are added when flushed.
   */
  kPairs?: boolean;
}

/** One kernel of a matmul: its WGSL, bindings in order ("part" is the split-K scratch), grid. */
export interface MatmulKernel {
  /** Appended to the op's label: "" for a single kernel, ".part" / ".sum" for split-K. */
  suffix: string;
  code: string;
  bindings: string[];
  grid: [number, number, number];
  /** Binds the dropout uniform at group 1. */
  uniform: boolean;
  /** Binds a uniform at group 1 holding these (M, N, K, split-K slice) as a vec4<u32> (MatmulSpec.uniformDims). */
  dims?: [number, number, number, number];
}

/** One measured choice: the fields present must match the matmul; absent fields match anything. */
export interface TileRule {
  M?: number;
  N?: number;
  K?: number;
  /** "NN", "NT", "TN" or "TT" (transA, transB). */
  layout?: string;
  /** "f16" when the spec multiplies in f16 (default "f32"). */
  math?: "f32" | "f16";
  /** "f16" when A or B is f16 in memory (default "f32"). */
  storage?: "f32" | "f16";
  tile: MatmulTile;
  /** The measured rate, for the record (not used to choose). */
  tflops?: number;
  /** Where the rule comes from, when not the sweep the table was written from. */
  note?: string;
}

/** The measured rules (matmul_tiles.json, written by bench/matmul_bench.ts), tried in order. */
export const MATMUL_TILE_RULES: readonly TileRule[] = TILE_TABLE.rules as TileRule[];
/** The adapter the rules were measured on. */
export const MATMUL_TILES_DEVICE: string = TILE_TABLE.device;

/** A short name of a tile, e.g. "128x128x16/8x8" or "g2 128x128x16/8x8 b2 w8 mn s4". */
export function tileName(t: MatmulTile): string {
  const base = `${t.BM}x${t.BN}x${t.BK}/${t.TM}x${t.TN}`;
  if ((t.gen ?? 1) === 1) return (t.flushEvery ?? 1) > 1 ? `${base} f${t.flushEvery}` : base;
  const parts = ["g2", base, `b${t.buffers ?? 1}`];
  if (t.warpN) parts.push(`w${t.warpN}`);
  parts.push(t.transposeLoad ?? "mn");
  if ((t.splitK ?? 1) > 1) parts.push(`s${t.splitK}`);
  if ((t.flushEvery ?? 1) > 1) parts.push(`f${t.flushEvery}`);
  if (t.kPairs) parts.push("kp");
  return parts.join(" ");
}

/** Bytes of workgroup memory a tile's kernel declares. */
export function matmulWorkgroupBytes(spec: Pick<MatmulSpec, "math">, t: MatmulTile): number {
  return (t.BM + t.BN) * t.BK * (spec.math === "f16" ? 2 : 4) * (t.buffers ?? 1);
}

/** Slices of a split-K tile: S of Kc (a multiple of BK) each, the last possibly shorter; S = 1 without. */
export function splitSlices(spec: Pick<MatmulSpec, "K">, t: MatmulTile): { S: number; Kc: number } {
  const want = Math.max(1, Math.floor(t.splitK ?? 1));
  const Kc = Math.ceil(spec.K / want / t.BK) * t.BK;
  return { S: Math.ceil(spec.K / Kc), Kc };
}

/** Why `tile` cannot compute `spec`, or null when it can. */
export function matmulTileError(spec: MatmulSpec, tile: MatmulTile): string | null {
  try {
    checkTile(spec, tile);
    return null;
  } catch (e) {
    return (e as Error).message;
  }
}

export function checkTile(spec: MatmulSpec, tile: MatmulTile): void {
  const { M, N, K, transA, transB } = spec;
  const { BM, BN, BK, TM, TN } = tile;
  if (![4, 8, 12].includes(TM) || ![4, 8, 12].includes(TN)) {
    throw new RangeError(`Matmul tile TM/TN must be 4, 8 or 12`);
  }
  if (BK % 4 !== 0) throw new RangeError(`Matmul tile BK ${BK} must be a multiple of 4`);
  if ((transA ? M : K) % 4 !== 0) {
    throw new RangeError(`Matmul A's contiguous dimension must be a multiple of 4`);
  }
  if ((transB ? K : N) % 4 !== 0) {
    throw new RangeError(`Matmul B's contiguous dimension must be a multiple of 4`);
  }
  if (N % 4 !== 0) throw new RangeError(`Matmul N ${N} must be a multiple of 4`);
  if (BM % TM !== 0 || BN % TN !== 0) {
    throw new RangeError(`Matmul tile ${BM}x${BN} is not a multiple of the thread tile ${TM}x${TN}`);
  }
  const TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
  if (((BM * BK) / 4) % THREADS !== 0 || ((BN * BK) / 4) % THREADS !== 0) {
    throw new RangeError(`Matmul tile ${BM}x${BN}x${BK} does not divide among ${THREADS} threads`);
  }
  if (spec.math === "f16" && (spec.dtypes?.A !== "f16" || spec.dtypes?.B !== "f16")) {
    throw new RangeError(`Matmul math "f16" needs A and B in f16`);
  }
  const gen = tile.gen ?? 1;
  if (gen !== 1 && gen !== 2) throw new RangeError(`Matmul tile gen ${gen} must be 1 or 2`);
  const g2 = [tile.buffers, tile.warpN, tile.transposeLoad, tile.splitK, tile.kPairs].some((v) =>
    v !== undefined
  );
  if (gen === 1 && g2) {
    throw new RangeError(
      `Matmul tile ${tileName(tile)}: buffers, warpN, transposeLoad, splitK and kPairs need gen 2`,
    );
  }
  if (tile.kPairs) {
    if (spec.math !== "f16") throw new RangeError(`Matmul tile kPairs needs math "f16"`);
    if (K % 2 !== 0) throw new RangeError(`Matmul tile kPairs needs an even K (got ${K})`);
    // Operands stored k-major load two rows of k per slot.
    if ((transA && ((BM * BK) / 8) % THREADS !== 0) || (!transB && ((BN * BK) / 8) % THREADS !== 0)) {
      throw new RangeError(
        `Matmul tile ${BM}x${BN}x${BK} kPairs: k-row pairs do not divide among ${THREADS} threads`,
      );
    }
  }
  if (![undefined, 1, 2].includes(tile.buffers)) throw new RangeError(`Matmul tile buffers must be 1 or 2`);
  if (![undefined, "k", "mn"].includes(tile.transposeLoad)) {
    throw new RangeError(`Matmul tile transposeLoad must be "k" or "mn"`);
  }
  const w = tile.warpN ?? 0;
  if (w) {
    if (![1, 2, 4, 8, 16, 32].includes(w)) throw new RangeError(`Matmul tile warpN ${w} must divide 32`);
    if (THREADS % 32 !== 0 || TX % w !== 0 || TY % (32 / w) !== 0) {
      throw new RangeError(`Matmul tile ${TY}x${TX} threads cannot be cut into ${32 / w}x${w} warps`);
    }
  }
  const s = tile.splitK ?? 1;
  if (!Number.isInteger(s) || s < 1) {
    throw new RangeError(`Matmul tile splitK ${s} must be a positive integer`);
  }
}

/**
 * Why `tile` cannot read `spec`'s sizes from a uniform (MatmulSpec.uniformDims), or null: the
 * group-1 uniform holds the dropout slot where there is dropout, and a guarded block or k-tile
 * would put the sizes in the code anyway.
 */
export function uniformDimsError(spec: MatmulSpec, tile: MatmulTile): string | null {
  if (spec.dropout) return "its group-1 uniform is the dropout slot";
  if (spec.M % tile.BM || spec.N % tile.BN || spec.K % tile.BK) {
    return `${spec.M}x${spec.N}x${spec.K} is not a multiple of the ${tile.BM}x${tile.BN}x${tile.BK} blocks`;
  }
  return null;
}

/** Threads of one workgroup of a tile. */
export function tileThreads(t: MatmulTile): number {
  return (t.BM / t.TM) * (t.BN / t.TN);
}

function ruleMatches(r: TileRule, spec: Partial<MatmulSpec>): boolean {
  const layout = `${spec.transA ? "T" : "N"}${spec.transB ? "T" : "N"}`;
  const storage = spec.dtypes?.A === "f16" || spec.dtypes?.B === "f16" ? "f16" : "f32";
  return (r.M === undefined || r.M === spec.M) && (r.N === undefined || r.N === spec.N) &&
    (r.K === undefined || r.K === spec.K) && (r.layout === undefined || r.layout === layout) &&
    (r.math === undefined || r.math === (spec.math ?? "f32")) &&
    (r.storage === undefined || r.storage === storage);
}

/** What chooseTile may pick beyond the spec itself. */
export interface ChooseTileOptions {
  /** The device's maxComputeWorkgroupStorageSize; default 16384 (WebGPU's guaranteed minimum). */
  maxWorkgroupBytes?: number;
  /** The caller runs matmulKernels (a scratch buffer and a second kernel), so split-K tiles are allowed. */
  splitK?: boolean;
  /** Rules to consult instead of the measured table (tests, the bench). */
  rules?: readonly TileRule[];
}

/**
 * Picks a tiling: the first measured rule (matmul_tiles.json) that matches the spec and fits the
 * device and caller, else large blocks when they still fill the GPU and smaller ones otherwise.
 * `spec` may carry layout, dtypes and math; rules that name them match only when they agree.
 */
export function chooseTile(
  spec: Pick<MatmulSpec, "M" | "N" | "K"> & Partial<MatmulSpec>,
  maxInvocations = 256,
  opts: ChooseTileOptions = {},
): MatmulTile {
  const full: MatmulSpec = { transA: false, transB: false, bias: false, epilogue: "store", ...spec };
  const maxBytes = opts.maxWorkgroupBytes ?? 16384;
  for (const r of opts.rules ?? MATMUL_TILE_RULES) {
    if (!ruleMatches(r, spec)) continue;
    if (!opts.splitK && (r.tile.splitK ?? 1) > 1) continue;
    if (tileThreads(r.tile) > maxInvocations || matmulWorkgroupBytes(full, r.tile) > maxBytes) continue;
    if (matmulTileError(full, r.tile) === null) return { ...r.tile };
  }
  const { M, N } = spec;
  const big = Math.ceil(M / 128) * Math.ceil(N / 128);
  // Measured on the H200 (bench/matmul_bench.ts): 128×128 tiles run 37–41 TFLOP/s on GPT-2's
  // shapes; when they would leave SMs idle (e.g. a 1024×1024 weight gradient), 128×64 runs 35
  // against 20.
  if (M >= 128 && N >= 128 && big >= 160) return { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 };
  if (M >= 128 && N >= 64 && maxInvocations >= 128) return { BM: 128, BN: 64, BK: 16, TM: 8, TN: 4 };
  if (M >= 64 && N >= 64 && maxInvocations >= 256) return { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 };
  return { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4 };
}

/** Names of the storage bindings, in binding order, that a spec's kernel declares. */
export function matmulBindings(spec: MatmulSpec): string[] {
  const b = ["A", "B", "out"];
  if (spec.bias) b.push("bias");
  if (spec.epilogue === "residual") b.push("res");
  if (spec.epilogue === "gelu") b.push("out2");
  if (spec.epilogue === "gelu_grad") b.push("aux");
  return b;
}

/** Bytes of the split-K scratch a tile needs (S partial M×N products in f32); 0 without split-K. */
export function matmulScratchBytes(spec: MatmulSpec, tile: MatmulTile): number {
  const { S } = splitSlices(spec, tile);
  return (tile.gen ?? 1) === 2 && S > 1 ? S * spec.M * spec.N * 4 : 0;
}

/** Workgroup counts (x over N, y over M); split-K adds grid z (see matmulKernels). */
export function matmulGrid(spec: MatmulSpec, tile: MatmulTile): [number, number] {
  return [Math.ceil(spec.N / tile.BN), Math.ceil(spec.M / tile.BM)];
}

/** FLOPs of one matmul (2·M·N·K). */
export function matmulFlops(spec: MatmulSpec): number {
  return 2 * spec.M * spec.N * spec.K;
}
