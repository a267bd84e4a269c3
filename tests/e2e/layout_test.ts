/**
 * The process boundary, checked against the imports. README draws three processes: the HTTP
 * process (main.ts, server/), the GPU host (host/) and one Worker per GPU (worker/, which drives
 * engine/). Shared by them: pure descriptions (model/), the job service's domain (job/: the job
 * record, its configs, the caller-mistake errors), checkpoints (checkpoint/), the data pipeline
 * (data/, not pure: it downloads, tokenizes on Workers and locks its folders) and the messages
 * (protocol.ts). These tests read every product file's imports (the ones that load code at run
 * time: `import type` loads nothing) and check which way they point, so a convenience import that
 * would pull WebGPU code into the HTTP process fails here, not in production; type imports count
 * too when the homes are checked for cycles. They also keep file names unique, so a name tells
 * you where you are.
 */

import assert from "node:assert/strict";
import { dirname, join, normalize, relative } from "node:path";

const ROOT = normalize(join(dirname(new URL(import.meta.url).pathname), "../.."));
const PRODUCT = [
  "main.ts",
  "protocol.ts",
  "server",
  "host",
  "worker",
  "engine",
  "model",
  "job",
  "checkpoint",
  "data",
];

/** Product .ts files, relative to the repository root. */
async function productFiles(): Promise<string[]> {
  const out: string[] = [];
  async function walk(rel: string): Promise<void> {
    const info = await Deno.stat(join(ROOT, rel));
    if (info.isFile) {
      if (rel.endsWith(".ts")) out.push(rel);
      return;
    }
    for await (const e of Deno.readDir(join(ROOT, rel))) await walk(join(rel, e.name));
  }
  for (const p of PRODUCT) await walk(p);
  return out.sort();
}

/**
 * The relative modules a file loads at run time: static `import … from`, `export … from`, bare
 * `import "…"` and dynamic `import("…")`, but not `import type` / `export type`, and not Workers
 * or subprocesses (they start another thread or process, which is the point of the boundary).
 */
export function runtimeImports(file: string, source: string): string[] {
  const out: string[] = [];
  const text = source.replace(/\/\*[\s\S]*?\*\//g, "").replace(/^\s*\/\/.*$/gm, "");
  const statement = /(?:^|\n)\s*(import|export)\s+(type\s+)?([^;'"]*?)\s*from\s*["']([^"']+)["']/g;
  for (const m of text.matchAll(statement)) {
    if (m[2]) continue;
    // `import { type A, type B } from` loads the module all the same (without verbatim elision we count it).
    out.push(m[4]);
  }
  for (const m of text.matchAll(/(?:^|\n)\s*import\s*["']([^"']+)["']/g)) out.push(m[1]);
  for (const m of text.matchAll(/\bimport\(\s*["']([^"']+)["']\s*\)/g)) out.push(m[1]);
  return out.filter((s) => s.startsWith(".")).map((s) => normalize(join(dirname(file), s)));
}

/** The relative modules a file names only for their types (`import type`, `export type`): they load nothing. */
export function typeImports(file: string, source: string): string[] {
  const text = source.replace(/\/\*[\s\S]*?\*\//g, "").replace(/^\s*\/\/.*$/gm, "");
  const statement = /(?:^|\n)\s*(?:import|export)\s+type\s+[^;'"]*?\s*from\s*["']([^"']+)["']/g;
  return [...text.matchAll(statement)].map((m) => m[1]).filter((s) => s.startsWith("."))
    .map((s) => normalize(join(dirname(file), s)));
}

async function graph(): Promise<Map<string, string[]>> {
  const g = new Map<string, string[]>();
  for (const f of await productFiles()) g.set(f, runtimeImports(f, await Deno.readTextFile(join(ROOT, f))));
  return g;
}

/** The top-level home of a path: "server", "engine", "protocol.ts", … */
function home(path: string): string {
  return path.split("/")[0];
}

/** Every module `from` reaches at run time, with the chain that got there. */
function reach(g: Map<string, string[]>, from: string): Map<string, string[]> {
  const seen = new Map<string, string[]>([[from, [from]]]);
  const queue = [from];
  while (queue.length) {
    const f = queue.shift()!;
    for (const d of g.get(f) ?? []) {
      if (seen.has(d)) continue;
      seen.set(d, [...seen.get(f)!, d]);
      queue.push(d);
    }
  }
  return seen;
}

Deno.test("The HTTP process never loads GPU host, Worker or WebGPU code (main.ts and every server/ file)", async () => {
  const g = await graph();
  const allowed = new Set(["main.ts", "protocol.ts", "server", "model", "job", "checkpoint", "data"]);
  const starts = [...g.keys()].filter((f) => f === "main.ts" || home(f) === "server");
  assert.ok(starts.length > 20, `expected the server's files, found ${starts.length}`);
  for (const start of starts) {
    for (const [mod, chain] of reach(g, start)) {
      assert.ok(allowed.has(home(mod)), `${start} reaches ${mod}: ${chain.join(" -> ")}`);
    }
  }
});

Deno.test("Each home imports only the homes below it", async () => {
  const g = await graph();
  const may: Record<string, string[]> = {
    "model": ["model"],
    "job": ["job", "model"],
    "data": ["data"],
    "protocol.ts": ["model", "job"],
    "checkpoint": ["checkpoint", "model", "job", "protocol.ts"],
    "engine": ["engine", "model"],
    "worker": ["worker", "engine", "model", "job", "checkpoint", "data", "protocol.ts"],
    "host": ["host", "model", "job", "protocol.ts", "engine"],
    "server": ["server", "model", "job", "checkpoint", "data", "protocol.ts"],
    "main.ts": ["server", "model", "data"],
  };
  const broken: string[] = [];
  for (const [file, deps] of g) {
    for (const d of deps) {
      const ok = home(d) === home(file) || (may[home(file)] ?? []).includes(home(d));
      if (!ok) broken.push(`${file} imports ${d}`);
    }
  }
  assert.deepEqual(broken, []);
});

Deno.test("Homes import each other one way only, type imports included (model/ names no home, job/ only model/)", async () => {
  const uses = new Map<string, Set<string>>();
  for (const f of await productFiles()) {
    const source = await Deno.readTextFile(join(ROOT, f));
    for (const d of [...runtimeImports(f, source), ...typeImports(f, source)]) {
      if (home(d) === home(f)) continue;
      uses.set(home(f), (uses.get(home(f)) ?? new Set()).add(home(d)));
    }
  }
  const cycles = new Set<string>(), done = new Set<string>();
  function visit(h: string, path: string[]): void {
    if (path.includes(h)) return void cycles.add([...path.slice(path.indexOf(h)), h].join(" -> "));
    if (done.has(h)) return;
    for (const d of uses.get(h) ?? []) visit(d, [...path, h]);
    done.add(h);
  }
  for (const h of uses.keys()) visit(h, []);
  assert.deepEqual([...cycles], []);
  assert.deepEqual([...uses.get("model") ?? []], []);
  assert.deepEqual([...uses.get("job") ?? []], ["model"]);
});

Deno.test("The GPU host reaches engine/ only for the shared-memory communicators, never a device", async () => {
  const g = await graph();
  for (const start of [...g.keys()].filter((f) => home(f) === "host")) {
    for (const [mod, chain] of reach(g, start)) {
      if (home(mod) !== "engine") continue;
      assert.ok(
        /^engine\/parallel\/(allreduce|groups|data_parallel|exchange|exchange_kernels)\.ts$/.test(mod) &&
          !mod.endsWith("device.ts"),
        `${start} reaches ${mod}: ${chain.join(" -> ")}`,
      );
    }
  }
});

Deno.test("No two files share a name (mod.ts aside), so a name says where you are", async () => {
  const byName = new Map<string, string[]>();
  for (const f of await productFiles()) {
    const name = f.split("/").pop()!;
    if (name === "mod.ts") continue;
    byName.set(name, [...byName.get(name) ?? [], f]);
  }
  const dupes = [...byName.values()].filter((fs) => fs.length > 1);
  assert.deepEqual(dupes, []);
});

Deno.test("runtimeImports() skips type-only imports and follows static, bare and dynamic ones", () => {
  const src = [
    'import type { A } from "./a.ts";',
    'import { type B, c } from "../b.ts";',
    'export type { D } from "./d.ts";',
    'export { e } from "./e.ts";',
    'import "./f.ts";',
    'const g = await import("./g.ts");',
    '// import { h } from "./h.ts";',
    'import { z } from "zod";',
  ].join("\n");
  assert.deepEqual(runtimeImports("server/x.ts", src), ["b.ts", "server/e.ts", "server/f.ts", "server/g.ts"]);
  assert.deepEqual(typeImports("server/x.ts", src), ["server/a.ts", "server/d.ts"]);
  assert.equal(relative(ROOT, join(ROOT, "server")), "server");
});

Deno.test("Each process reads the environment in one settings module", async () => {
  const settings = new Set([
    "server/settings.ts",
    "host/host_settings.ts",
    "worker/worker_settings.ts",
    "worker/compile_report.ts", // driverCacheDisabled(env), called by worker_settings.ts
    "data/cli.ts", // the data pipeline's command line
  ]);
  const readers: string[] = [];
  for (const f of await productFiles()) {
    const text = (await Deno.readTextFile(join(ROOT, f))).replace(/\/\*[\s\S]*?\*\//g, "").replace(
      /^\s*\/\/.*$/gm,
      "",
    );
    if (/\bDeno\.env\.(get|toObject|has)\(|\benv\.get\(/.test(text) && !settings.has(f)) readers.push(f);
  }
  assert.deepEqual(readers, []);
});
