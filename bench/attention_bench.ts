/**
 * Attention benchmark: the causal attention forward and backward of gpt2-124M and gpt2-345M
 * (B = 8, T = 1024, D = 64, H = 12 / 16), the kernels the engine runs today (engine/graph/'s
 * choice) against the flash kernels (every tiling the device fits) and the dK/dV kernel storing dS
 * for dQ as a matmul over it (attention_dq.ts), timed by timestamp queries
 * (median over ≥ 20 repetitions after warmup). Every flash result is compared on the GPU with
 * today's kernels on the same inputs (max |difference| / max |value| of y, lse and dqkv) and a
 * tiling that disagrees is reported and never chosen.
 *
 * TFLOP/s count useful work once, FlashAttention-2 style: forward 2 products (QKᵀ, PV) over the
 * causal half, backward 5 (QKᵀ, dO·Vᵀ, dV, dK, dQ), whatever a kernel recomputes.
 *
 *   deno task bench attention [--tiny] [--json F] [--models gpt2-124M,gpt2-345M] [--precision fp32,fp16]
 *                             [--reps N] [--no-flash-bwd] [--quick]
 *
 * `--quick`: today's kernels, chooseBackwardTilings's pick and the stored-dS pair (also with its
 * tile fills written out, and with the dK/dV kernel's sums reduce-scattered at a few tilings) only
 * (no flash tilings, no per-kernel tiling sweep), for a device session with little time.
 *
 * Imports nothing from npm, so it runs on the GPU machine with `deno run -A --no-config --no-check`.
 */

import { presetConfig } from "../model/config.ts";
import { createStorage, describeDevice, type GpuContext, openDevice } from "../engine/device.ts";
import {
  attentionBackwardKVWgsl,
  attentionBackwardQWgsl,
  attentionDeltaWgsl,
  attentionFlops,
  attentionForwardWgsl,
  type AttentionSpec,
  backwardKVSpec,
  backwardQSpec,
  type BackwardTiling,
  chooseAttentionSplit,
  chooseAttentionTiles,
  chooseBackwardTilings,
  chooseSplitAttentionTiles,
  flashForwardCandidates,
  flashForwardFits,
  type FlashLimits,
  type FlashTiles,
} from "../engine/kernels/attention.ts";
import {
  attentionBackwardQScoresWgsl,
  DQ_SCORES_TILES,
  type DqScoresTile,
  dqScoresTileError,
  scoresPathError,
  scoresScratchBytes,
} from "../engine/kernels/attention_dq.ts";
import {
  flashBackwardCandidates,
  flashBackwardFits,
  flashBackwardKVWgsl,
  flashBackwardQWgsl,
  flashScratchBytes,
} from "./experiments/flash_backward.ts";
import { grid1d, type StorageDtype } from "../engine/kernels/common.ts";
import { makeOp, type Op, PipelineCache, type View } from "../engine/ops.ts";
import { GpuDiff, GpuTimer, type Timing } from "./_gpu_bench.ts";

/** A dQ = dS·K tiling's name: "32x16c1", "64x16c2q8" (8 queries a thread). */
const dqName = (t: DqScoresTile) => `${t.BQ}x${t.BK}c${t.CP}${(t.RQ ?? 4) === 8 ? "q8" : ""}`;

/**
 * dK/dV tilings timed with their sums reduce-scattered (AttentionSpec.scatterSums) in --quick: the
 * pick (BACKWARD_KV_TILINGS' first), a longer query tile, more keys a workgroup, fewer keys per
 * group, 4 threads a key (which spilled with the butterfly's 4 exps and 24 shuffles a row), and
 * 4 threads a key with half the keys a workgroup.
 */
const SCATTER_KV_TILINGS: BackwardTiling[] = [
  { split: 8, BQ: 32, BKV: 64, rows: 4, unroll: 4 },
  { split: 8, BQ: 64, BKV: 64, rows: 4, unroll: 4 },
  { split: 8, BQ: 32, BKV: 128, rows: 4, unroll: 4 },
  { split: 8, BQ: 32, BKV: 64, rows: 2, unroll: 4 },
  { split: 8, BQ: 32, BKV: 64, rows: 4, unroll: 2 },
  { split: 4, BQ: 32, BKV: 64, rows: 4, unroll: 2 },
  { split: 4, BQ: 32, BKV: 64, rows: 2, unroll: 4 },
  // Half the keys a workgroup (64 threads): at ~180 registers a thread, 5 workgroups of 2 warps fit
  // an SM where 2 of 4 do, at the cost of reading each query tile for half as many keys.
  { split: 4, BQ: 32, BKV: 32, rows: 2, unroll: 4 },
  { split: 4, BQ: 64, BKV: 32, rows: 2, unroll: 4 },
];

function arg(args: string[], name: string, def: string): string {
  const i = args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : def;
}

/** A label of a flash tiling, e.g. "64x64 L16 subgroup". */
export function flashName(t: FlashTiles): string {
  const f = t.flash!;
  return `${t.BQ}x${t.BKV} L${f.lanes} ${f.reduce}${f.prefetch === false ? " noprefetch" : ""}`;
}

/** One timed kernel sequence. */
interface Row {
  pass: "forward" | "backward";
  kernels: string;
  median_ms: number;
  min_ms: number;
  reps: number;
  tflops: number;
  /** Against today's kernels; null for them. */
  rel_err: { y?: number; lse?: number; dqkv?: number } | null;
  ok: boolean;
  error?: string;
  /** One kernel of the pass timed alone (not a candidate for the pass's best). */
  alone?: boolean;
}

/** Buffers of one problem, filled with values in [-0.5, 0.5) (f16 where the spec stores f16). */
async function buffers(ctx: GpuContext, s: AttentionSpec, scratchBytes: number) {
  const C = s.H * s.D, BT = s.B * s.T;
  const e16 = (t?: StorageDtype) => (t === "f16" ? 2 : 4);
  const mk = async (label: string, n: number, dtype: StorageDtype | undefined, fill: boolean) => {
    const b = await createStorage(ctx, label, n * e16(dtype));
    if (fill) {
      const a = dtype === "f16" ? new Float16Array(n) : new Float32Array(n);
      let seed = label.length * 97 + n;
      for (let i = 0; i < n; i++) {
        seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
        a[i] = (seed >>> 8) / 16777216 - 0.5;
      }
      ctx.device.queue.writeBuffer(b, 0, a.buffer, 0, a.byteLength);
    }
    return b;
  };
  return {
    qkv: await mk("qkv", BT * 3 * C, s.dtype, true),
    dy: await mk("dy", BT * C, s.gradDtype, true),
    y: await mk("y", BT * C, s.dtype, false),
    y2: await mk("y2", BT * C, s.dtype, false),
    lse: await mk("lse", s.B * s.H * s.T, "f32", false),
    lse2: await mk("lse2", s.B * s.H * s.T, "f32", false),
    delta: await mk("delta", s.B * s.H * s.T, "f32", false),
    dqkv: await mk("dqkv", BT * 3 * C, s.gradDtype, false),
    dqkv2: await mk("dqkv2", BT * 3 * C, s.gradDtype, false),
    dst: await mk("dst", Math.max(4, scratchBytes / 4), "f32", false),
  };
}

async function main(args: string[]): Promise<void> {
  const ctx = await openDevice();
  const device = describeDevice(ctx);
  console.log(device);
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: "high-performance" });
  const info = adapter?.info as (GPUAdapterInfo & { subgroupMinSize?: number }) | undefined;
  const lim: FlashLimits = {
    maxWorkgroupBytes: ctx.limits.maxComputeWorkgroupStorageSize,
    maxThreads: ctx.limits.maxComputeInvocationsPerWorkgroup,
    subgroupMinSize: ctx.hasSubgroups ? info?.subgroupMinSize ?? 0 : 0,
    maxBindingBytes: ctx.limits.maxStorageBufferBindingSize,
  };
  console.log(
    `subgroup min size ${
      lim.subgroupMinSize || "n/a (no subgroups: flash row maxima through workgroup memory)"
    }`,
  );
  const tiny = args.includes("--tiny"), quick = args.includes("--quick");
  const minReps = +arg(args, "reps", tiny ? "5" : "20");
  const jsonPath = arg(args, "json", "");
  const precisions = arg(args, "precision", ctx.hasF16 && !tiny ? "fp32,fp16" : "fp32").split(",");
  // --tiny (a CPU adapter compiles each kernel for seconds): the first few tilings only.
  const fwdCands = flashForwardCandidates().filter((t) => flashForwardFits({ T: 128, D: 64 }, t, lim));
  const bc = flashBackwardCandidates();
  const cands = tiny
    ? { fwd: fwdCands.slice(0, 3), kv: bc.kv.slice(-2), q: bc.q.slice(-2) }
    : { fwd: flashForwardCandidates(), kv: bc.kv, q: bc.q };
  const problems: Array<{ name: string; B: number; T: number; H: number; D: number }> = tiny
    ? [{ name: "tiny", B: 1, T: 128, H: 2, D: 64 }]
    : arg(args, "models", "gpt2-124M,gpt2-345M").split(",").map((m) => {
      const c = presetConfig(m);
      return { name: m, B: 8, T: 1024, H: c.n_head, D: c.n_embd / c.n_head };
    });
  const cache = new PipelineCache(ctx);
  const timer = new GpuTimer(ctx);
  const diff = new GpuDiff(ctx, cache);
  const policy = { minReps, maxReps: 400, targetMs: tiny ? 20 : 80, warmup: 2 };
  const report = {
    device,
    date: new Date().toISOString(),
    timing: timer.method,
    args,
    problems: [] as unknown[],
  };
  console.log(
    `${"problem".padEnd(22)} ${"pass".padEnd(8)} ${"kernels".padEnd(44)} ${"med ms".padStart(8)} ${
      "min ms".padStart(8)
    } ${"TF/s".padStart(6)} ${"vs now".padStart(6)}  check`,
  );
  for (const precision of precisions) {
    for (const p of problems) {
      const half = precision === "fp16";
      const base: AttentionSpec = {
        ...p,
        BQ: 0,
        BKV: 0,
        dtype: half ? "f16" : "f32",
        gradDtype: half ? "f16" : "f32",
      };
      // Today's choice, as engine/graph/ makes it.
      const split = chooseAttentionSplit(p.D, ctx.hasSubgroups);
      const now: AttentionSpec = {
        ...base,
        split,
        ...(split > 1
          ? chooseSplitAttentionTiles(p, lim.maxWorkgroupBytes, split, lim.maxThreads)
          : chooseAttentionTiles(p, lim.maxWorkgroupBytes)),
      };
      const scratch = flashScratchBytes(p);
      const bufs = await buffers(
        ctx,
        base,
        scratch <= Math.min(lim.maxBindingBytes!, ctx.limits.maxBufferSize) ? scratch : 0,
      );
      const V = (b: GPUBuffer): View => ({ buffer: b });
      const op = async (label: string, code: string, views: GPUBuffer[], grid: [number, number, number]) =>
        makeOp(ctx, await cache.get(label, code), {
          label,
          phase: "forward",
          kind: "attention_fwd",
          views: views.map(V),
          grid,
        });
      const fwdGrid = (s: AttentionSpec): [number, number, number] => [Math.ceil(p.T / s.BQ), p.H, p.B];
      const name = `${p.name} ${precision}`;
      const flops = attentionFlops(p);
      // Without room for the dS scratch there is no flash backward.
      const blim = scratch > ctx.limits.maxBufferSize ? { ...lim, maxBindingBytes: 0 } : lim;
      const rows: Row[] = [];
      const print = (r: Row, nowMs?: number) => {
        const err = r.rel_err
          ? Object.entries(r.rel_err).map(([k, v]) => `${k} ${v!.toExponential(1)}`).join(" ")
          : "";
        const status = r.error ? `ERROR ${r.error}` : r.ok ? err : `MISMATCH ${err}`;
        console.log(
          `${name.padEnd(22)} ${r.pass.padEnd(8)} ${r.kernels.padEnd(44)} ${
            r.median_ms.toFixed(3).padStart(8)
          } ${r.min_ms.toFixed(3).padStart(8)} ${r.tflops.toFixed(1).padStart(6)} ${
            nowMs ? `${(nowMs / r.median_ms).toFixed(2)}x`.padStart(6) : "".padStart(6)
          }  ${status}`,
        );
        rows.push(r);
      };
      const row = (
        pass: Row["pass"],
        kernels: string,
        t: Timing,
        useful: number,
        rel: Row["rel_err"],
        ok: boolean,
      ) => ({
        pass,
        kernels,
        median_ms: t.median_ms,
        min_ms: t.min_ms,
        reps: t.reps,
        tflops: useful / (t.median_ms / 1000) / 1e12,
        rel_err: rel,
        ok,
      });
      const failed = (pass: Row["pass"], kernels: string, e: unknown): Row => ({
        pass,
        kernels,
        median_ms: NaN,
        min_ms: NaN,
        reps: 0,
        tflops: 0,
        rel_err: null,
        ok: false,
        error: String((e as Error).message ?? e).split("\n")[0],
      });
      const n4y = (p.B * p.T * p.H * p.D) / 4, n4q = 3 * n4y, n4l = (p.B * p.H * p.T) / 4;
      const tol = half ? 2e-2 : 1e-4;

      // Forward: today's kernel, then each flash tiling against it.
      const fwdNow = await op(
        "fwd.now",
        attentionForwardWgsl(now),
        [bufs.qkv, bufs.y, bufs.lse],
        fwdGrid(now),
      );
      const tNow = await timer.timeAdaptive([fwdNow], policy);
      const fwdLabel = split > 1 ? `split ${split} ${now.BQ}x${now.BKV}` : `plain ${now.BQ}x${now.BKV}`;
      print(row("forward", `now: ${fwdLabel}`, tNow, flops, null, true));
      for (const t of quick ? [] : cands.fwd) {
        if (!flashForwardFits(p, t, lim)) continue;
        const s = { ...base, ...t };
        try {
          const o = await op(
            `fwd ${flashName(t)}`,
            attentionForwardWgsl(s),
            [bufs.qkv, bufs.y2, bufs.lse2],
            fwdGrid(s),
          );
          const tm = await timer.timeAdaptive([o], policy);
          const rel = {
            y: await diff.rel(V(bufs.y2), V(bufs.y), n4y, base.dtype),
            lse: await diff.rel(V(bufs.lse2), V(bufs.lse), n4l),
          };
          print(
            row("forward", `flash ${flashName(t)}`, tm, flops, rel, rel.y <= tol && rel.lse <= tol),
            tNow.median_ms,
          );
        } catch (e) {
          print(failed("forward", `flash ${flashName(t)}`, e));
        }
      }

      // Backward: delta + today's dK/dV and dQ, then delta + each flash pair.
      const bviews = [bufs.qkv, bufs.dy, bufs.lse, bufs.delta];
      const delta = await op("delta", attentionDeltaWgsl(now), [bufs.y, bufs.dy, bufs.delta], [
        ...grid1d(Math.ceil((p.B * p.T * p.H) / 64), ctx.limits.maxComputeWorkgroupsPerDimension),
      ] as [number, number, number]);
      const dkvNow = await op("dkv.now", attentionBackwardKVWgsl(now), [...bviews, bufs.dqkv], [
        Math.ceil(p.T / now.BKV),
        p.H,
        p.B,
      ]);
      const dqNow = await op("dq.now", attentionBackwardQWgsl(now), [...bviews, bufs.dqkv], fwdGrid(now));
      const tbNow = await timer.timeAdaptive([delta, dkvNow, dqNow], policy);
      print(row("backward", `now: delta + dK/dV + dQ (${fwdLabel})`, tbNow, 2.5 * flops, null, true));
      // Each split backward kernel on tilings of its own (BackwardTiling), timed alone against
      // today's (TF/s of the work it executes, recomputed products included, as the engine's profile), checked as delta + the candidate + today's other kernel; then chooseBackwardTilings's
      // pick as a whole.
      const dkvAlone = await timer.timeAdaptive([dkvNow], policy);
      const dqAlone = await timer.timeAdaptive([dqNow], policy);
      console.log(
        `  now alone: dK/dV ${dkvAlone.median_ms.toFixed(3)} ms, dQ ${dqAlone.median_ms.toFixed(3)} ms`,
      );
      const tilings: BackwardTiling[] = [];
      for (const split of [4, 8] as const) {
        for (const BQ of [16, 32, 64, 128]) {
          for (const BKV of [16, 32, 64, 128]) {
            for (const rows of [1, 2, 4] as const) tilings.push({ split, BQ, BKV, rows });
          }
        }
      }
      const tname = (t: BackwardTiling) => `S${t.split} ${t.BQ}x${t.BKV} r${t.rows}`;
      for (const which of quick ? [] : ["dK/dV", "dQ"] as const) {
        const kv = which === "dK/dV";
        for (const t of tilings) {
          const one = chooseBackwardTilings(p, { ...lim, subgroupMinSize: lim.subgroupMinSize ?? 0 }, {
            kv: kv ? [t] : [],
            q: kv ? [] : [t],
          });
          if (kv ? !one.bwdKV : !one.bwdQ) continue;
          if (kv ? t.BQ > 64 : t.BKV > 64) continue; // the looped-over tile: larger never won
          const label = `${which} ${tname(t)}`;
          try {
            const sr: AttentionSpec = { ...now, ...one };
            const o = kv
              ? await op(label, attentionBackwardKVWgsl(sr), [...bviews, bufs.dqkv2], [
                Math.ceil(p.T / t.BKV),
                p.H,
                p.B,
              ])
              : await op(label, attentionBackwardQWgsl(sr), [...bviews, bufs.dqkv2], [
                Math.ceil(p.T / t.BQ),
                p.H,
                p.B,
              ]);
            const other = kv
              ? await op("dq.now2", attentionBackwardQWgsl(now), [...bviews, bufs.dqkv2], fwdGrid(now))
              : await op("dkv.now2", attentionBackwardKVWgsl(now), [...bviews, bufs.dqkv2], [
                Math.ceil(p.T / now.BKV),
                p.H,
                p.B,
              ]);
            await timer.timeAdaptive([delta, o, other], { ...policy, minReps: 2, maxReps: 2 });
            const rel = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            const tm = await timer.timeAdaptive([o], policy);
            const alone = kv ? dkvAlone : dqAlone;
            print(
              { ...row("backward", label, tm, (kv ? 2 : 1.5) * flops, rel, rel.dqkv <= tol), alone: true },
              alone.median_ms,
            );
          } catch (e) {
            print(failed("backward", label, e));
          }
        }
      }
      {
        const pick = chooseBackwardTilings(p, { ...lim, subgroupMinSize: lim.subgroupMinSize ?? 0 });
        const sp: AttentionSpec = { ...now, ...pick };
        const okv = await op("dkv.pick", attentionBackwardKVWgsl(sp), [...bviews, bufs.dqkv2], [
          Math.ceil(p.T / backwardKVSpec(sp).BKV),
          p.H,
          p.B,
        ]);
        const oq = await op("dq.pick", attentionBackwardQWgsl(sp), [...bviews, bufs.dqkv2], [
          Math.ceil(p.T / backwardQSpec(sp).BQ),
          p.H,
          p.B,
        ]);
        const tm = await timer.timeAdaptive([delta, okv, oq], policy);
        const rel = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
        const label = `pick: delta + dK/dV ${pick.bwdKV ? tname(pick.bwdKV) : "shared"} + dQ ${
          pick.bwdQ ? tname(pick.bwdQ) : "shared"
        }`;
        print(row("backward", label, tm, 2.5 * flops, rel, rel.dqkv <= tol), tbNow.median_ms);
        // The pick with its loops written out 1, 2 and 4 rows per trip (BackwardTiling.unroll), but its own.
        for (const unroll of ([1, 2, 4] as const).filter((u) => u !== (pick.bwdKV?.unroll ?? 1))) {
          if (!pick.bwdKV || !pick.bwdQ) break;
          const su: AttentionSpec = {
            ...now,
            bwdKV: { ...pick.bwdKV, unroll },
            bwdQ: { ...pick.bwdQ, unroll },
          };
          const ulabel = `pick, unroll ${unroll}`;
          try {
            const ukv = await op(`dkv.u${unroll}`, attentionBackwardKVWgsl(su), [...bviews, bufs.dqkv2], [
              Math.ceil(p.T / backwardKVSpec(su).BKV),
              p.H,
              p.B,
            ]);
            const uq = await op(`dq.u${unroll}`, attentionBackwardQWgsl(su), [...bviews, bufs.dqkv2], [
              Math.ceil(p.T / backwardQSpec(su).BQ),
              p.H,
              p.B,
            ]);
            const tu = await timer.timeAdaptive([delta, ukv, uq], policy);
            const urel = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            print(row("backward", ulabel, tu, 2.5 * flops, urel, urel.dqkv <= tol), tm.median_ms);
            const a = async (o: Op) => (await timer.timeAdaptive([o], policy)).median_ms.toFixed(3);
            console.log(
              `  alone, ms: dK/dV ${await a(ukv)} (pick ${await a(okv)}), dQ ${await a(uq)} (pick ${await a(
                oq,
              )})`,
            );
          } catch (e) {
            print(failed("backward", ulabel, e));
          }
        }
        // The pick's dK/dV kernel storing dS, and dQ as the matmul over it (attention_dq.ts),
        // against the pick: the pair, and each kernel alone against its counterpart alone.
        if (scoresPathError(backwardKVSpec(sp)) === null && bufs.dst.size >= scoresScratchBytes(p)) {
          const label = "stored dS: delta + dK/dV (pick, writeDS) + dQ = dS·K";
          try {
            const okvS = await op("dkv.ds", attentionBackwardKVWgsl({ ...sp, writeDS: true }), [
              ...bviews,
              bufs.dqkv2,
              bufs.dst,
            ], [Math.ceil(p.T / backwardKVSpec(sp).BKV), p.H, p.B]);
            const dqLim = { maxWorkgroupBytes: lim.maxWorkgroupBytes, maxThreads: lim.maxThreads };
            const tiles = DQ_SCORES_TILES.filter((t) => dqScoresTileError(t, p.D, dqLim) === null);
            const oqs: Op[] = [];
            for (const t of tiles) {
              oqs.push(
                await op(`dq.ds ${dqName(t)}`, attentionBackwardQScoresWgsl(sp, t), [
                  bufs.qkv,
                  bufs.dst,
                  bufs.dqkv2,
                ], [Math.ceil(p.T / t.BQ), p.H, p.B]),
              );
            }
            const alone = async (o: Op) => (await timer.timeAdaptive([o], policy)).median_ms;
            // The pair writes dS once; then each dQ tiling alone, and the pair with the fastest.
            await timer.timeAdaptive([delta, okvS, oqs[0]], { ...policy, minReps: 2, maxReps: 2 });
            const dqMs: number[] = [];
            for (const [i, t] of tiles.entries()) {
              dqMs.push(await alone(oqs[i]));
              console.log(`  dQ = dS·K ${dqName(t)} alone: ${dqMs[i].toFixed(3)} ms`);
            }
            const bi = dqMs.indexOf(Math.min(...dqMs)), t = tiles[bi];
            const tS = await timer.timeAdaptive([delta, okvS, oqs[bi]], policy);
            const relS = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            print(
              row("backward", `${label} ${dqName(t)}`, tS, 2.5 * flops, relS, relS.dqkv <= tol),
              tm.median_ms,
            );
            console.log(
              `  alone, ms: dK/dV pick ${(await alone(okv)).toFixed(3)}, with writeDS ${
                (await alone(okvS)).toFixed(3)
              }; dQ pick ${(await alone(oq)).toFixed(3)}`,
            );
            // The same kernels with their tile fills written out (AttentionSpec.writtenFills): the
            // same values, each thread's fill loads in flight together.
            const sw: AttentionSpec = { ...sp, writtenFills: true };
            const okvW = await op("dkv.ds.fills", attentionBackwardKVWgsl({ ...sw, writeDS: true }), [
              ...bviews,
              bufs.dqkv2,
              bufs.dst,
            ], [Math.ceil(p.T / backwardKVSpec(sw).BKV), p.H, p.B]);
            const oqW = await op(`dq.ds.fills ${dqName(t)}`, attentionBackwardQScoresWgsl(sw, t), [
              bufs.qkv,
              bufs.dst,
              bufs.dqkv2,
            ], [Math.ceil(p.T / t.BQ), p.H, p.B]);
            const tW = await timer.timeAdaptive([delta, okvW, oqW], policy);
            const relW = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            print(
              row(
                "backward",
                `${label} ${dqName(t)}, fills written out`,
                tW,
                2.5 * flops,
                relW,
                relW.dqkv <= tol,
              ),
              tS.median_ms,
            );
            console.log(
              `  alone, ms: dK/dV with writeDS, fills written out ${(await alone(okvW)).toFixed(3)} (loops ${
                (await alone(okvS)).toFixed(3)
              }); dQ = dS·K ${(await alone(oqW)).toFixed(3)} (loops ${dqMs[bi].toFixed(3)})`,
            );
            // The dK/dV kernel with its sums reduce-scattered (AttentionSpec.scatterSums): the same
            // values, fewer shuffles and one exp per thread instead of one per key.
            const sc: AttentionSpec = { ...sp, scatterSums: true };
            const okvC = await op("dkv.ds.scatter", attentionBackwardKVWgsl({ ...sc, writeDS: true }), [
              ...bviews,
              bufs.dqkv2,
              bufs.dst,
            ], [Math.ceil(p.T / backwardKVSpec(sc).BKV), p.H, p.B]);
            const tC = await timer.timeAdaptive([delta, okvC, oqs[bi]], policy);
            const relC = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            print(
              row(
                "backward",
                `${label} ${dqName(t)}, sums reduce-scattered`,
                tC,
                2.5 * flops,
                relC,
                relC.dqkv <= tol,
              ),
              tS.median_ms,
            );
            console.log(
              `  alone, ms: dK/dV with writeDS, sums reduce-scattered ${
                (await alone(okvC)).toFixed(3)
              } (butterfly ${(await alone(okvS)).toFixed(3)})`,
            );
            // With fewer shuffles and exps a row, another tiling may be fastest: a few near the
            // pick, each storing dS with its sums reduce-scattered, alone and checked by the pair.
            for (const kt of SCATTER_KV_TILINGS) {
              const one = chooseBackwardTilings(p, { ...lim, subgroupMinSize: lim.subgroupMinSize ?? 0 }, {
                kv: [kt],
                q: [],
              });
              if (!one.bwdKV) continue;
              const st: AttentionSpec = { ...sp, bwdKV: one.bwdKV, scatterSums: true, writeDS: true };
              const klabel = `dK/dV ${tname(kt)} u${kt.unroll ?? 1}, writeDS, sums reduce-scattered`;
              try {
                const ok = await op(klabel, attentionBackwardKVWgsl(st), [...bviews, bufs.dqkv2, bufs.dst], [
                  Math.ceil(p.T / backwardKVSpec(st).BKV),
                  p.H,
                  p.B,
                ]);
                await timer.timeAdaptive([delta, ok, oqs[bi]], { ...policy, minReps: 2, maxReps: 2 });
                const r = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
                print(
                  {
                    ...row(
                      "backward",
                      klabel,
                      await timer.timeAdaptive([ok], policy),
                      2 * flops,
                      r,
                      r.dqkv <= tol,
                    ),
                    alone: true,
                  },
                  (await timer.timeAdaptive([okvS], policy)).median_ms,
                );
              } catch (e) {
                print(failed("backward", klabel, e));
              }
            }
          } catch (e) {
            print(failed("backward", label, e));
          }
        }
      }
      for (const kv of args.includes("--no-flash-bwd") || quick ? [] : cands.kv) {
        for (const q of cands.q) {
          if (!flashBackwardFits(p, kv, q, blim)) continue;
          const label = `flash kv ${flashName(kv)} | q ${flashName(q)}`;
          try {
            const sk = { ...base, ...kv }, sq = { ...base, ...q };
            const okv = await op(`kv ${flashName(kv)}`, flashBackwardKVWgsl(sk), [
              ...bviews,
              bufs.dqkv2,
              bufs.dst,
            ], [
              Math.ceil(p.T / kv.BKV),
              p.H,
              p.B,
            ]);
            const oq = await op(
              `q ${flashName(q)}`,
              flashBackwardQWgsl(sq),
              [bufs.qkv, bufs.dst, bufs.dqkv2],
              [
                Math.ceil(p.T / q.BQ),
                p.H,
                p.B,
              ],
            );
            const seq: Op[] = [delta, okv, oq];
            const tm = await timer.timeAdaptive(seq, policy);
            const rel = { dqkv: await diff.rel(V(bufs.dqkv2), V(bufs.dqkv), n4q, base.gradDtype) };
            print(row("backward", label, tm, 2.5 * flops, rel, rel.dqkv <= tol), tbNow.median_ms);
          } catch (e) {
            print(failed("backward", label, e));
          }
        }
      }
      const best = (pass: Row["pass"]) =>
        rows.filter((r) => r.pass === pass && r.ok && !r.alone).sort((a, b) => a.median_ms - b.median_ms)[0];
      const bf = best("forward"), bb = best("backward");
      console.log(
        `  best: forward ${bf.kernels} ${bf.tflops.toFixed(1)} TF/s (${
          (tNow.median_ms / bf.median_ms).toFixed(2)
        }x), ` +
          `backward ${bb.kernels} ${bb.tflops.toFixed(1)} TF/s (${
            (tbNow.median_ms / bb.median_ms).toFixed(2)
          }x)`,
      );
      report.problems.push({
        ...p,
        precision,
        now: { forward: fwdLabel },
        rows,
        best: { forward: bf, backward: bb },
      });
      for (const b of Object.values(bufs)) b.destroy();
      if (jsonPath) await Deno.writeTextFile(jsonPath, JSON.stringify(report, null, 1));
    }
  }
  if (jsonPath) console.log(`Wrote ${jsonPath}`);
  timer.destroy();
  diff.destroy();
  ctx.device.destroy();
}

if (import.meta.main) {
  await main(Deno.args);
  Deno.exit(0);
}
