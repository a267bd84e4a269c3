/**
 * Puts tile rules measured inside the training step (bench/split_sweep.ts or bench/tile_sweep.ts
 * `--emit F`) at the head of the measured table, engine/kernels/matmul_tiles.json, each in place of
 * the table's rules for exactly its shape (M, N, K, layout, math, storage) and of its kind, split-K
 * or not (a split rule leaves the shape's unsplit rule for callers that cannot split); every other
 * rule stays where it was. No GPU.
 *
 *   deno run -A bench/merge_tile_rules.ts F [--table engine/kernels/matmul_tiles.json]
 */

import type { TileRule } from "../engine/kernels/matmul.ts";

/** The shape a rule names, as one key (fields a rule leaves out match anything: kept apart). */
function shapeKey(r: TileRule): string {
  return JSON.stringify([
    r.M ?? "*",
    r.N ?? "*",
    r.K ?? "*",
    r.layout ?? "*",
    r.math ?? "*",
    r.storage ?? "*",
    (r.tile.splitK ?? 1) > 1,
  ]);
}

/** `rules` first, then the table's rules for every other shape (or kind), in their order. */
export function mergeTileRules(table: readonly TileRule[], rules: readonly TileRule[]): TileRule[] {
  const replaced = new Set(rules.map(shapeKey));
  if (replaced.size !== rules.length) throw new RangeError("Two of the new rules name the same shape");
  return [...rules, ...table.filter((r) => !replaced.has(shapeKey(r)))];
}

if (import.meta.main) {
  const from = Deno.args.find((a) => !a.startsWith("--"));
  if (!from) throw new Error("usage: deno run -A bench/merge_tile_rules.ts RULES.json [--table FILE]");
  const i = Deno.args.indexOf("--table");
  const path = i >= 0
    ? Deno.args[i + 1]
    : new URL("../engine/kernels/matmul_tiles.json", import.meta.url).pathname;
  const rules = JSON.parse(await Deno.readTextFile(from)) as TileRule[];
  if (!Array.isArray(rules)) throw new Error(`${from}: expected an array of tile rules`);
  const doc = JSON.parse(await Deno.readTextFile(path)) as { rules: TileRule[] };
  const before = doc.rules.length;
  doc.rules = mergeTileRules(doc.rules, rules);
  await Deno.writeTextFile(path, JSON.stringify(doc, null, 2) + "\n");
  console.log(
    `${path}: ${rules.length} rules put first, ${before + rules.length - doc.rules.length} replaced, ` +
      `${doc.rules.length} in all`,
  );
}
