/**
 * Variants compared in one process (`--variants "A;B;…" --rounds N`): each variant is a set of the
 * benchmark's own flags, put before the command's other flags so that they win over them; "default"
 * (or nothing) is the command as given. Every round runs every variant once, each round's order
 * turned by one place, so that a drift of the machine over the call (clocks, temperature, another
 * tenant) lands on every variant alike. The summary gives each variant's median over all its runs,
 * their range, and its ratio to the first variant's median, so one device call measures several
 * options against the same call's default, with repeats, where separate processes each paid their
 * start and their peers.
 *
 * Imports nothing, so it runs with `deno run -A --no-config --no-check` on the GPU machine.
 */

/** One variant: its name (its flags as written, or "default") and its flags as words. */
export interface Variant {
  name: string;
  args: string[];
}

/**
 * The variants of `--variants` ("default;--attn-fills;--colsum-unroll 32"), or one default variant
 * when the flag is absent. Throws a RangeError naming the problem for an empty list, a variant
 * named twice, or a word of a variant that is not a flag or a flag's value.
 */
export function parseVariants(args: readonly string[]): Variant[] {
  const i = args.indexOf("--variants");
  if (i < 0) return [{ name: "default", args: [] }];
  const spec = args[i + 1];
  if (spec === undefined) throw new RangeError(`--variants needs a list such as "default;--attn-fills"`);
  const out: Variant[] = [];
  for (const part of spec.split(";")) {
    const words = part.trim().split(/\s+/).filter((w) => w.length > 0);
    const name = words.length === 0 || (words.length === 1 && words[0] === "default")
      ? "default"
      : words.join(" ");
    const flags = name === "default" ? [] : words;
    if (flags.length && !flags[0].startsWith("--")) {
      throw new RangeError(`--variants: "${part.trim()}" must start with a flag (--name)`);
    }
    if (flags.includes("--variants") || flags.includes("--rounds")) {
      throw new RangeError(`--variants: "${part.trim()}" may not set --variants or --rounds`);
    }
    if (out.some((v) => v.name === name)) throw new RangeError(`--variants: "${name}" is named twice`);
    out.push({ name, args: flags });
  }
  if (out.length === 0) throw new RangeError("--variants: no variant given");
  return out;
}

/** The command's flags without `--variants LIST` and `--rounds N`. */
export function baseArgs(args: readonly string[]): string[] {
  const out: string[] = [];
  for (let i = 0; i < args.length; i++) {
    if (args[i] === "--variants" || args[i] === "--rounds") i++;
    else out.push(args[i]);
  }
  return out;
}

/** A variant's full flags: its own first, so that `arg()` (the first occurrence) reads them. */
export function variantArgs(v: Variant, base: readonly string[]): string[] {
  return [...v.args, ...base];
}

/** The order of the variants in round r (0-based): turned by r places. */
export function roundOrder<T>(variants: readonly T[], round: number): T[] {
  const n = variants.length, k = ((round % n) + n) % n;
  return [...variants.slice(k), ...variants.slice(0, k)];
}

/** `--rounds N` (default 1 with one variant, 2 with several), at least 1. */
export function parseRounds(args: readonly string[], variants: number): number {
  const i = args.indexOf("--rounds");
  if (i < 0) return variants > 1 ? 2 : 1;
  const n = Number(args[i + 1]);
  if (!Number.isInteger(n) || n < 1) {
    throw new RangeError(`--rounds "${args[i + 1]}" must be a whole number ≥ 1`);
  }
  return n;
}

/**
 * A command's variants, each with the options its flags give (every variant's read up front, so a bad
 * one fails the call before anything runs), and the rounds (`--rounds`).
 */
export function planVariants<O>(
  args: readonly string[],
  optionsOf: (flags: readonly string[]) => O,
): { variants: Array<Variant & { options: O }>; rounds: number } {
  const variants = parseVariants(args), base = baseArgs(args);
  return {
    variants: variants.map((v) => ({ ...v, options: optionsOf(variantArgs(v, base)) })),
    rounds: parseRounds(args, variants.length),
  };
}

/** A figure of one run: which variant, which measurement (e.g. "gpt2-345M" or "batch 16"), its value. */
export interface Sample {
  variant: string;
  key: string;
  value: number;
}

/** One variant's figures for one key over its runs, and its ratio to the first variant's median. */
export interface SummaryRow {
  variant: string;
  key: string;
  runs: number;
  median: number;
  min: number;
  max: number;
  /** This median over the first variant's (for the same key), or null for the first variant itself. */
  ratio: number | null;
  /**
   * Every run of this variant beats every run of the first one (in the direction `higherIsBetter`),
   * each having run at least twice.
   */
  clear: boolean;
}

export function median(xs: readonly number[]): number {
  const s = [...xs].sort((a, b) => a - b), m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Rows per key (in the order keys first appear) and variant (in the order given). */
export function summarize(
  samples: readonly Sample[],
  variants: readonly string[],
  higherIsBetter: boolean,
): SummaryRow[] {
  const keys = [...new Set(samples.map((s) => s.key))];
  const rows: SummaryRow[] = [];
  for (const key of keys) {
    const of = (v: string) => samples.filter((s) => s.key === key && s.variant === v).map((s) => s.value);
    const base = of(variants[0]);
    for (const v of variants) {
      const xs = of(v);
      if (!xs.length) continue;
      const m = median(xs), lo = Math.min(...xs), hi = Math.max(...xs);
      const first = v === variants[0] || !base.length;
      rows.push({
        variant: v,
        key,
        runs: xs.length,
        median: m,
        min: lo,
        max: hi,
        ratio: first ? null : m / median(base),
        clear: !first && xs.length > 1 && base.length > 1 &&
          (higherIsBetter ? lo > Math.max(...base) : hi < Math.min(...base)),
      });
    }
  }
  return rows;
}

/** The summary as readable lines, and one JSON line per row (`{"variant_summary": …}`). */
export function summaryLines(rows: readonly SummaryRow[], unit: string, higherIsBetter: boolean): string[] {
  const width = Math.max(8, ...rows.map((r) => r.variant.length));
  const keyWidth = Math.max(8, ...rows.map((r) => r.key.length));
  const f = (n: number) => (n >= 100 ? n.toFixed(1) : n.toFixed(3));
  const lines = [`variants (median of the runs, range; against the first variant, ${unit}):`];
  for (const r of rows) {
    const vs = r.ratio === null
      ? ""
      : `  ${r.ratio.toFixed(3)}× the first${
        r.clear ? (higherIsBetter ? ", every run above" : ", every run below") : ""
      }`;
    lines.push(
      `  ${r.key.padEnd(keyWidth)} ${r.variant.padEnd(width)} ${f(r.median)} (${f(r.min)}-${
        f(r.max)
      }, ${r.runs} runs)${vs}`,
    );
  }
  for (const r of rows) lines.push(JSON.stringify({ variant_summary: { ...r, unit } }));
  return lines;
}
