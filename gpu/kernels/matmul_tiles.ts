/**
 * Measured matmul tile choices, consulted first by `chooseTile` (gpu/kernels/matmul.ts).
 *
 * Written from a sweep on the target GPU: `deno task bench matmul --sweep --json sweep.json`, then
 * `deno task bench matmul --from-json sweep.json --emit-tiles gpu/kernels/matmul_tiles.ts` (no GPU
 * needed for the second step). Empty until measured: chooseTile then falls back to its built-in
 * rules, which are what the engine ran before the sweep existed.
 *
 * Rules are tried in order; the first whose given fields all match the spec, and whose tile fits
 * the device (threads, workgroup bytes) and the caller (split-K only when the caller can run a
 * second kernel), wins. Exact shapes come first, then per-layout defaults.
 */

import type { MatmulTile } from "./matmul.ts";

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
}

/** The adapter the rules were measured on ("" until measured). */
export const MATMUL_TILES_DEVICE = "";

/** The measured rules (empty until measured). */
export const MATMUL_TILE_RULES: readonly TileRule[] = [];
