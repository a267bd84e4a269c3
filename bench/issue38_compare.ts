/**
 * Reads the logs `bench/issue38_next.sh` writes (decode.log, fills.log, tiles.log, split345.log in
 * one folder) and prints each option against the default run of the same call: the decode rate's
 * median and range per batch (generate engine's JSON lines), and each model's ms per step (train
 * bench lines), so the next step (which defaults to flip) can be read off. No GPU.
 * Commands run with `--variants` (bench/variants.ts) compare in their own process; their summary
 * rows (`{"variant_summary": …}` lines) are printed as they are, each log's in turn.
 *
 *   deno run -A bench/issue38_compare.ts DIR
 */

import type { SummaryRow } from "./variants.ts";

/** One command of a log: its flags (after the scenario) and what it printed. */
export interface LoggedRun {
  command: string;
  lines: string[];
}

/** Splits a log into its commands (`=== <date> <command>` … `=== exit N`). */
export function logRuns(text: string): LoggedRun[] {
  const runs: LoggedRun[] = [];
  for (const line of text.split("\n")) {
    const m = /^=== \S+ (.*)$/.exec(line);
    if (m && !/^=== exit /.test(line)) runs.push({ command: m[1], lines: [] });
    else if (runs.length && !/^=== exit /.test(line)) runs[runs.length - 1].lines.push(line);
  }
  return runs;
}

/** The flags of a command that tell it from the default run (the words after the last fixed one). */
export function variantOf(command: string, fixed: RegExp): string {
  return command.replace(fixed, "").replace(/--(profile|torch)\b/g, "").replace(/\s+/g, " ").trim() ||
    "default";
}

/** Decode rates per variant and batch: generate engine's JSON lines. */
export function decodeRates(
  runs: LoggedRun[],
): Map<string, Map<number, { median: number; min: number; max: number }>> {
  const out = new Map<string, Map<number, { median: number; min: number; max: number }>>();
  for (const r of runs) {
    // Commands with --variants compare in their own process: variantRows reads their summaries.
    if (!/generate engine/.test(r.command) || /--variants\b/.test(r.command)) continue;
    const name = variantOf(r.command, /.*generate engine --models \S+ --batches \S+( --repeat \d+)?/);
    // A variant run twice (the default at the start and the end of a call) keeps both: "default #2".
    let v = name;
    for (let k = 2; out.has(v); k++) v = `${name} #${k}`;
    for (const line of r.lines) {
      if (!line.startsWith("{")) continue;
      const j = JSON.parse(line);
      if (j.scenario !== "engine" || j.decode_tokens_per_s === undefined) continue;
      const m = out.get(v) ?? new Map();
      m.set(j.batch, {
        median: j.decode_tokens_per_s,
        min: j.decode_tokens_per_s_min,
        max: j.decode_tokens_per_s_max,
      });
      out.set(v, m);
    }
  }
  return out;
}

/** ms per step per variant and model: the train bench's result lines. */
export function stepTimes(runs: LoggedRun[]): Map<string, Map<string, number>> {
  const out = new Map<string, Map<string, number>>();
  for (const r of runs) {
    if (!/bench train/.test(r.command) || /--variants\b/.test(r.command)) continue;
    const name = variantOf(r.command, /.*bench train --models \S+ --batch \d+ --seq \d+ --steps \d+/);
    let v = name;
    for (let k = 2; out.has(v); k++) v = `${name} #${k}`;
    for (const line of r.lines) {
      const m = /^(gpt2-\S+)\s+batch \d+ seq \d+ \S+: ([\d.]+) ms\/step/.exec(line);
      if (!m) continue;
      const t = out.get(v) ?? new Map();
      t.set(m[1], +m[2]);
      out.set(v, t);
    }
  }
  return out;
}

/** The summary rows of the commands run with --variants, with the unit each names. */
export function variantRows(runs: LoggedRun[]): Array<SummaryRow & { unit: string; command: string }> {
  const out: Array<SummaryRow & { unit: string; command: string }> = [];
  for (const r of runs) {
    for (const line of r.lines) {
      if (!line.startsWith('{"variant_summary"')) continue;
      out.push({ ...JSON.parse(line).variant_summary, command: r.command });
    }
  }
  return out;
}

if (import.meta.main) {
  const dir = Deno.args[0] ?? "/tmp/issue38";
  const read = (name: string) => {
    try {
      return logRuns(Deno.readTextFileSync(`${dir}/${name}`));
    } catch {
      return [];
    }
  };
  const rates = decodeRates(read("decode.log"));
  if (rates.size) {
    const base = rates.get("default");
    console.log("decode tokens/s (median of the runs, range), against the same call's default run:");
    for (const [v, m] of rates) {
      for (const [batch, r] of [...m].sort((a, b) => a[0] - b[0])) {
        const d = base?.get(batch);
        const vs = d && v !== "default" ? `  ${(r.median / d.median).toFixed(3)}x default` : "";
        const beats = d && v !== "default" && r.min > d.max ? " (every run above the default's range)" : "";
        console.log(
          `  ${v.padEnd(34)} batch ${String(batch).padStart(2)}: ${r.median.toFixed(0)} (${
            r.min.toFixed(0)
          }-${r.max.toFixed(0)})${vs}${beats}`,
        );
      }
    }
  }
  const steps = new Map([
    ...stepTimes(read("fills.log")),
    ...stepTimes(read("tiles.log")),
    ...stepTimes(read("split345.log")),
  ]);
  if (steps.size) {
    const base = stepTimes(read("fills.log")).get("default");
    console.log("training ms per step, against the fills part's default run:");
    for (const [v, m] of steps) {
      for (const [model, ms] of m) {
        const d = base?.get(model);
        console.log(
          `  ${v.padEnd(60)} ${model}: ${ms.toFixed(1)}${
            d && v !== "default" ? `  ${(ms / d).toFixed(3)}x` : ""
          }`,
        );
      }
    }
  }
  let rows = 0;
  for (const name of ["decode.log", "fills.log", "tiles.log", "split345.log", "final.log"]) {
    let command = "";
    for (const r of variantRows(read(name))) {
      if (r.command !== command) console.log(`${name}: ${(command = r.command)}\n  (${r.unit})`);
      const f = (n: number) => (n >= 100 ? n.toFixed(1) : n.toFixed(3));
      console.log(
        `  ${r.key.padEnd(24)} ${r.variant.padEnd(44)} ${f(r.median)} (${f(r.min)}-${f(r.max)}, ${r.runs})${
          r.ratio === null
            ? ""
            : `  ${r.ratio.toFixed(3)}x${r.clear ? " (every run past the first's range)" : ""}`
        }`,
      );
      rows++;
    }
  }
  if (!rates.size && !steps.size && !rows) console.log(`nothing to compare in ${dir}`);
}
