/**
 * Built-in corpora shipped in the repository, so a fresh checkout can train with no download:
 * `sotu` (the State of the Union addresses, 1790-2021, public domain) and `moby-dick`.
 *
 * Each is a gzip'd JSON array under data/builtin/, the data of an npm package by The Stdlib
 * Authors (see data/builtin/NOTICE.md for the source and the licence). A file is read and
 * decompressed only when a preparation names it.
 */
import type { SourceDocument } from "./merge.ts";

/** Names of the built-in datasets. */
export const BUILTIN_NAMES = ["sotu", "moby-dick"] as const;
/** A built-in dataset's name. */
export type BuiltinName = typeof BUILTIN_NAMES[number];

/**
 * Default split weights of each built-in: Megatron's 949,50,1, except moby-dick (~290K tokens),
 * whose 0.1% test split would be shorter than one 1024-token sequence.
 */
export const BUILTIN_DEFAULT_SPLIT: Readonly<Record<BuiltinName, readonly [number, number, number]>> = {
  "sotu": [949, 50, 1],
  "moby-dick": [98, 1, 1],
};

/** Whether `name` is a built-in dataset. */
export function isBuiltinName(name: string): name is BuiltinName {
  return (BUILTIN_NAMES as readonly string[]).includes(name);
}

/** The rows of a shipped corpus file: a gzip'd JSON array. */
async function readRows<T>(name: BuiltinName): Promise<T[]> {
  const gz = await Deno.readFile(new URL(`./builtin/${name}.json.gz`, import.meta.url));
  const json = new Blob([gz]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(json).text()) as T[];
}

/** The documents of a built-in dataset, in the package's order. */
export async function builtinDocuments(name: BuiltinName): Promise<SourceDocument[]> {
  if (name === "sotu") {
    const rows = await readRows<{ year: number; name: string; text: string }>(name);
    return rows.map((r) => ({ text: r.text, url: `sotu:${r.year}:${r.name}` }));
  }
  if (name === "moby-dick") {
    const rows = await readRows<{ chapter: string; title: string; text: string }>(name);
    return rows.map((r) => ({ text: r.text, url: `moby-dick:${r.chapter}` }));
  }
  throw new Error(
    `Unknown built-in dataset "${name}": expected one of ${BUILTIN_NAMES.map((n) => `"${n}"`).join(", ")}`,
  );
}
