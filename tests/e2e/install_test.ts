/**
 * What a fresh machine installs. `deno task` installs every npm package of the lockfile it finds
 * before running a task, so deno.json's import map and deno.lock hold only what the product runs
 * (the demo and `serve` install 32 packages). Test-only packages (puppeteer-core for
 * tests/web/browser_test.ts) are imported by their full `npm:` specifier and pinned in tests/deno.lock,
 * which `deno task test` and `deno task check` use. Run a test file that needs one with
 * `deno test -A --lock=tests/deno.lock tests/<file>_test.ts`; without `--lock` Deno writes the
 * test-only packages into deno.lock, and the first test below fails.
 *
 * The last test starts `deno task serve` with no network (a fresh network namespace, where only
 * loopback exists) and checks that it listens: once installed, serving needs no download.
 */

import assert from "node:assert/strict";
import { dirname, join, normalize } from "node:path";

const ROOT = normalize(join(dirname(new URL(import.meta.url).pathname), "../.."));
/** The most npm packages a fresh `deno task demo` may install (issue 39). */
const MAX_PACKAGES = 80;
/** Packages only tests use, or that only the dropped dataset packages pulled in. */
const NOT_IN_PRODUCT = /^(puppeteer-core|chromium-bidi|devtools-protocol|@puppeteer\/|@stdlib\/)/;

interface Lockfile {
  specifiers: Record<string, string>;
  npm: Record<string, { integrity: string; dependencies?: string[] }>;
  workspace: { dependencies: string[] };
}

async function readJson<T>(rel: string): Promise<T> {
  return JSON.parse(await Deno.readTextFile(join(ROOT, rel))) as T;
}

/** The `npm:` specifiers of deno.json's import map, without a trailing path (`npm:/hono@1/` → `npm:hono@1`). */
async function importMapPackages(): Promise<string[]> {
  const config = await readJson<{ imports: Record<string, string> }>("deno.json");
  const packages = Object.values(config.imports)
    .filter((s) => s.startsWith("npm:"))
    .map((s) => "npm:" + s.slice(4).replace(/^\//, "").replace(/\/$/, ""));
  return [...new Set(packages)].sort();
}

Deno.test("deno.lock holds only the packages of deno.json's import map, at most 80", async () => {
  const lock = await readJson<Lockfile>("deno.lock");
  const wanted = await importMapPackages();
  assert.deepEqual([...lock.workspace.dependencies].sort(), wanted);
  assert.deepEqual(
    Object.keys(lock.specifiers).filter((s) => !wanted.includes(s)),
    [],
    "deno.lock pins a package outside deno.json's imports (a test run without --lock=tests/deno.lock?)",
  );
  const names = Object.keys(lock.npm);
  assert.deepEqual(names.filter((n) => NOT_IN_PRODUCT.test(n)), []);
  assert.ok(names.length <= MAX_PACKAGES, `deno.lock has ${names.length} npm packages`);
});

Deno.test("tests/deno.lock pins the product's packages as deno.lock does", async () => {
  const product = await readJson<Lockfile>("deno.lock");
  const tests = await readJson<Lockfile>("tests/deno.lock");
  assert.deepEqual(tests.workspace, product.workspace);
  for (const [name, entry] of Object.entries(product.npm)) assert.deepEqual(tests.npm[name], entry, name);
  for (const [spec, version] of Object.entries(product.specifiers)) {
    assert.equal(tests.specifiers[spec], version);
  }
});

Deno.test("Product files import npm packages only through deno.json's import map", async () => {
  const config = await readJson<{ imports: Record<string, string> }>("deno.json");
  const mapped = (s: string) =>
    Object.keys(config.imports).some((k) => (k.endsWith("/") ? s.startsWith(k) : s === k));
  const bad: string[] = [];
  async function walk(rel: string): Promise<void> {
    const info = await Deno.stat(join(ROOT, rel));
    if (info.isDirectory) {
      for await (const e of Deno.readDir(join(ROOT, rel))) await walk(join(rel, e.name));
      return;
    }
    if (!rel.endsWith(".ts")) return;
    const text = (await Deno.readTextFile(join(ROOT, rel))).replace(/\/\*[\s\S]*?\*\//g, "")
      .replace(/^\s*\/\/.*$/gm, "");
    const specs = [
      ...text.matchAll(/(?:^|\n)\s*(?:import|export)\s+[^;'"]*?\s*from\s*["']([^"']+)["']/g),
      ...text.matchAll(/(?:^|\n)\s*import\s*["']([^"']+)["']/g),
      ...text.matchAll(/\bimport\(\s*["']([^"']+)["']\s*\)/g),
    ].map((m) => m[1]).filter((s) => !s.startsWith(".") && !s.startsWith("/"));
    for (const s of specs) if (!s.startsWith("node:") && !mapped(s)) bad.push(`${rel}: ${s}`);
  }
  for (
    const p of [
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
      "scripts",
    ]
  ) await walk(p);
  assert.deepEqual(bad, []);
});

/** Whether this machine can run a command with no network (unprivileged user and network namespaces). */
function canIsolateNetwork(): boolean {
  try {
    const r = new Deno.Command("unshare", { args: ["-rn", "ip", "link", "set", "lo", "up"], stderr: "null" })
      .outputSync();
    return r.success;
  } catch {
    return false;
  }
}

Deno.test({
  name: "`deno task serve` starts with no network once installed",
  ignore: !canIsolateNetwork(),
  async fn() {
    const home = await Deno.makeTempDir({ prefix: "gpt2-offline-" });
    // A fresh network namespace: loopback only, brought up so the server can bind 127.0.0.1.
    const child = new Deno.Command("unshare", {
      args: ["-rn", "sh", "-c", 'ip link set lo up && exec "$0" task serve', Deno.execPath()],
      cwd: ROOT,
      env: { PORT: "0", HOST: "127.0.0.1", GPT2_HOME: home, NO_COLOR: "1" },
      stdout: "piped",
      stderr: "piped",
    }).spawn();
    let output = "";
    const collect = async (s: ReadableStream<Uint8Array>) => {
      const decoder = new TextDecoder();
      for await (const chunk of s) output += decoder.decode(chunk, { stream: true });
    };
    const done = Promise.all([collect(child.stdout), collect(child.stderr)]);
    const deadline = Date.now() + 90_000;
    while (Date.now() < deadline && !/listening on http:\/\/127\.0\.0\.1:\d+\//.test(output)) {
      const exited = await Promise.race([child.status.then(() => true), delay(200).then(() => false)]);
      if (exited) break;
    }
    try {
      child.kill("SIGTERM");
    } catch { /* already exited */ }
    await child.status;
    await done;
    await Deno.remove(home, { recursive: true });
    assert.match(output, /listening on http:\/\/127\.0\.0\.1:\d+\//, output);
  },
});

function delay(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}
