/**
 * Kernel compilation as a GPU Worker reports it. A build (a Trainer, a Generator) hears of each
 * pipeline it compiles; {@link compileReporter} turns that into throttled `CompileReport`s, and
 * keeps a small marker per adapter under `<data dir>/kernel-cache/` recording the builds that
 * completed there, so a report can say whether this is a first run on the adapter: the driver's
 * own shader cache (Mesa's under ~/.cache/mesa_shader_cache) makes later runs compile much faster.
 * The marker is a hint, not a guarantee: the driver's cache may be cleared behind it, and is off
 * when `MESA_SHADER_CACHE_DISABLE` is set, which the reports then say instead. The report's
 * shape and `compileLine`, which words it for the server's log and the demo, live in protocol.ts.
 */

import type { CompileListener, CompileProgress } from "../engine/ops.ts";
import type { CompileReport } from "../protocol.ts";

/** Whether `env` disables Mesa's shader cache (its boolean spellings: 1, y, yes, t, true). */
export function driverCacheDisabled(env: { get(key: string): string | undefined }): boolean {
  return /^(1|y|yes|t|true)$/i.test(env.get("MESA_SHADER_CACHE_DISABLE")?.trim() ?? "");
}

/** The marker of one adapter: its full description and the builds that completed on it. */
interface Marker {
  adapter: string;
  builds: Record<string, { pipelines: number; ms: number; at: string }>;
}

/** A file name for an adapter: its readable name, then a hash of its full description (GL and Vulkan differ there). */
async function markerPath(root: string, name: string, description: string): Promise<string> {
  const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(description)));
  const hash = [...digest.slice(0, 4)].map((b) => b.toString(16).padStart(2, "0")).join("");
  const safe = name.replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 60) || "adapter";
  return `${root}/kernel-cache/${safe}-${hash}.json`;
}

async function readMarker(path: string, description: string): Promise<Marker> {
  try {
    const m = JSON.parse(await Deno.readTextFile(path)) as Marker;
    if (m && typeof m.builds === "object" && m.builds !== null) return m;
  } catch {
    // Missing or unreadable: nothing recorded yet.
  }
  return { adapter: description, builds: {} };
}

/** Options of {@link compileReporter}. */
export interface CompileReporterOptions {
  /** Data directory holding `kernel-cache/`; null: first runs are not tracked (`first_run` null). */
  root: string | null;
  /** The adapter's short name, shown in reports. */
  adapter: string;
  /** Its full description (features, limits): tells apart two backends of one name. */
  description: string;
  /** What decides the kernels (model shape, batch, precision…): one key per kind of build. */
  build: string;
  cacheDisabled: boolean;
  send: (r: CompileReport) => void;
  /** Least ms between two reports; the first and the last of a build are always sent. Default 250. */
  intervalMs?: number;
}

/**
 * A listener to hand a build: it sends a report at most every `intervalMs` plus the first and
 * last of each build, and once a build completes records it in the adapter's marker.
 */
export async function compileReporter(o: CompileReporterOptions): Promise<CompileListener> {
  const path = o.root === null ? null : await markerPath(o.root, o.adapter, o.description);
  const seen = path === null ? null : await readMarker(path, o.description);
  const firstRun = seen === null ? null : !(o.build in seen.builds);
  const interval = o.intervalMs ?? 250;
  let ms = 0, last = -Infinity;
  return (p: CompileProgress) => {
    ms += p.ms;
    const now = performance.now();
    const complete = p.done >= p.total;
    if (p.done === 1 || complete || now - last >= interval) {
      last = now;
      o.send({
        done: p.done,
        total: p.total,
        label: p.label,
        ms: Math.round(ms),
        adapter: o.adapter,
        first_run: firstRun,
        cache_disabled: o.cacheDisabled,
      });
    }
    if (!complete) return;
    const total = ms;
    ms = 0; // a build may compile again later (a generator's new batch sizes)
    if (path !== null && !o.cacheDisabled) {
      record(path, o.description, o.build, p.total, total).catch((e) => {
        console.warn(`Cannot record compiled kernels in "${path}": ${(e as Error).message}`);
      });
    }
  };
}

/** Adds a completed build to the marker (re-read first: another build may have written it meanwhile). */
async function record(path: string, description: string, build: string, pipelines: number, ms: number) {
  const m = await readMarker(path, description);
  m.builds[build] = { pipelines, ms: Math.round(ms), at: new Date().toISOString() };
  await Deno.mkdir(path.slice(0, path.lastIndexOf("/")), { recursive: true });
  const tmp = `${path}.${crypto.randomUUID().slice(0, 8)}.tmp`;
  await Deno.writeTextFile(tmp, JSON.stringify(m, null, 1) + "\n");
  await Deno.rename(tmp, path);
}
