/**
 * Tiled matrix multiply, generated per shape: out[M,N] = A[M,K] · B[K,N] (+ bias) with an epilogue.
 *
 * Each workgroup computes a BM×BN block; each thread a TM×TN register tile held in named vec4
 * variables (fully unrolled: WGSL arrays indexed in loops end up in slow local memory). Tiles of
 * A and B go through workgroup memory, transposed on load so that one inner loop serves every
 * layout: `transA` reads A stored [K,M], `transB` reads B stored [N,K] (the forms backward needs).
 * The next tile is prefetched into registers while the current one is multiplied.
 *
 * Two generations of the kernel share that scheme and every epilogue, prologue and dtype:
 *   gen 1 (the default) one flat workgroup buffer per operand, two barriers per k-tile, and a
 *         transposing store in which four consecutive threads share a row (a 4-way bank conflict).
 *   gen 2 workgroup tiles indexed [buffer][k][group][thread] so that the only index that varies
 *         per thread is the last (the bounds clamp WGSL adds to every dynamic index is then the
 *         same value for the whole loop); and, chosen per tile: double buffering (`buffers: 2`,
 *         one barrier per k-tile), a transposing load in which consecutive threads take
 *         consecutive rows (`transposeLoad: "mn"`, conflict-free scalar stores), 32-lane warp tiles
 *         (`warpN`: a warp covers (32/warpN)×warpN threads, so it reads fewer distinct vectors),
 *         and split-K (`splitK`: slices of K in grid z write partial sums to a scratch buffer that
 *         a second kernel adds up, applying the epilogue; see matmulKernels).
 * The spec, the tiles and `chooseTile`, the one place that picks a tile (measured rules first, from
 * matmul_tiles.json, then built-in ones), live in matmul_spec.ts, re-exported here.
 *
 * Element types: any binding may be f16 in memory (`dtypes`, converted on load and store). With
 * `math: "f16"` (A and B both f16) the tiles stay f16 and each BK-long stretch of K is multiplied
 * and summed in f16 (twice the f32 rate where the GPU has packed f16), then flushed into the f32
 * accumulators, so long K keeps fp32 accuracy between stretches.
 *
 * A prologue can apply GELU to A as it is loaded (`prologueA: "gelu"`), so the MLP keeps only its
 * pre-activation and its projection reads gelu(fch) without a stored copy (the tiled weight gradient
 * stages gelu(fch) once instead: applied on every load it ran at half rate; engine/graph/matmul_steps.ts).
 *
 * Epilogues fuse the elementwise work that follows a matmul in GPT-2:
 *   store      out = acc (+ bias)
 *   accumulate out += acc (+ bias)
 *   residual   out = res + dropout(acc + bias)            (attention / MLP output + residual add)
 *   gelu       out = acc + bias, out2 = gelu(out)         (MLP up-projection keeps pre-activation)
 *   gelu_grad  out = acc * gelu'(aux)                     (backward through GELU)
 */

import { dropWgsl, GELU_WGSL, grid1d, LINEAR_WG, withStorageDtypes } from "./common.ts";
import {
  checkTile,
  matmulBindings,
  matmulGrid,
  type MatmulKernel,
  type MatmulSpec,
  type MatmulTile,
  splitSlices,
  tileName,
  uniformDimsError,
} from "./matmul_spec.ts";

export * from "./matmul_spec.ts";

/**
 * Generates the WGSL of one matmul (a single kernel: a split-K tile needs matmulKernels, which
 * adds the reduction).
 */
export function matmulWgsl(spec: MatmulSpec, tile: MatmulTile): string {
  checkTile(spec, tile);
  if ((tile.gen ?? 1) === 1) return gen1Wgsl(spec, tile);
  if (splitSlices(spec, tile).S > 1) {
    throw new RangeError(`Matmul tile ${tileName(tile)} splits K: build it with matmulKernels`);
  }
  return gen2Wgsl(spec, tile, false);
}

/**
 * The kernels of one matmul in dispatch order: the matmul itself, or with split-K a partial
 * product per K slice into `part` (matmulScratchBytes) and a reduction that applies the epilogue.
 */
export function matmulKernels(spec: MatmulSpec, tile: MatmulTile): MatmulKernel[] {
  checkTile(spec, tile);
  const { S } = splitSlices(spec, tile);
  if ((tile.gen ?? 1) === 1 || S === 1) {
    const [x, y] = matmulGrid(spec, tile);
    return [{
      suffix: "",
      code: matmulWgsl(spec, tile),
      bindings: matmulBindings(spec),
      grid: [x, y, 1],
      uniform: !!spec.dropout,
      ...kernelDims(spec, tile),
    }];
  }
  const [x, y] = matmulGrid(spec, tile);
  return [
    {
      suffix: ".part",
      code: gen2Wgsl(spec, tile, true),
      bindings: ["A", "B", "part"],
      grid: [x, y, S],
      uniform: false,
      ...kernelDims(spec, tile),
    },
    {
      suffix: ".sum",
      code: splitReduceWgsl(spec, S),
      bindings: ["part", ...matmulBindings(spec).filter((n) => n !== "A" && n !== "B")],
      grid: grid1d(Math.ceil((spec.M * spec.N) / 4 / 64)),
      uniform: !!spec.dropout,
    },
  ];
}

/** Epilogue statements for one vec4 of output, with `q` (its vec4 index) and `var v` in scope. */
export function epilogueLines(spec: MatmulSpec, col: string): string[] {
  const body: string[] = [];
  if (spec.bias) body.push(`v = v + bias[${col} / 4u];`);
  switch (spec.epilogue) {
    case "store":
      body.push(`out[q] = v;`);
      break;
    case "accumulate":
      body.push(`out[q] = out[q] + v;`);
      break;
    case "residual":
      if (spec.dropout) {
        body.push(`let e = q * 4u;`);
        body.push(
          `v = v * vec4<f32>(keep(e), keep(e + 1u), keep(e + 2u), keep(e + 3u));`,
        );
      }
      body.push(`out[q] = res[q] + v;`);
      break;
    case "gelu":
      body.push(`out[q] = v;`, `out2[q] = gelu4(v);`);
      break;
    case "gelu_grad":
      body.push(`out[q] = v * gelu_grad4(aux[q]);`);
      break;
  }
  return body;
}

/** Storage binding declarations: f16 tiles declare A and B f16 directly. */
export function bindingDecls(bindings: string[], h16: boolean, written = ["out", "out2", "part"]): string[] {
  const rw = new Set(written);
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  return bindings.map((name, i) =>
    `@group(0) @binding(${i}) var<storage, ${rw.has(name) ? "read_write" : "read"}> ${name}: array<${
      h16 && (name === "A" || name === "B") ? tv : "vec4<f32>"
    }>;`
  );
}

/**
 * Applies the storage dtypes of the declared bindings (with f16 math A and B are declared f16
 * already) and `enable f16`.
 */
export function finish(code: string, spec: MatmulSpec, h16: boolean, bindings: string[]): string {
  const dtypes = Object.fromEntries(
    Object.entries(spec.dtypes ?? {}).filter(([n]) =>
      bindings.includes(n) && !(h16 && (n === "A" || n === "B"))
    ),
  );
  const out = withStorageDtypes(code, dtypes);
  return h16 && !out.startsWith("enable f16;") ? `enable f16;\n${out}` : out;
}

/** A kernel's sizes as its code reads them (see sizeExprs). */
interface SizeExprs {
  /** Read from the uniform `dims` (MatmulSpec.uniformDims) rather than written in. */
  dyn: boolean;
  M: string;
  N: string;
  K: string;
  /** The split-K slice (K without split-K). */
  Kc: string;
  /** The uniform's declaration where the sizes are read from it. */
  decl: string[];
}

/** M, N, K and the split-K slice as WGSL expressions: literals, or with uniformDims the uniform's fields. */
function sizeExprs(spec: MatmulSpec, tile: MatmulTile): SizeExprs {
  if (spec.uniformDims && uniformDimsError(spec, tile) === null) {
    const decl = ["@group(1) @binding(0) var<uniform> dims: vec4<u32>;"];
    return { dyn: true, M: "dims.x", N: "dims.y", K: "dims.z", Kc: "dims.w", decl };
  }
  const { Kc } = splitSlices(spec, tile);
  return { dyn: false, M: `${spec.M}u`, N: `${spec.N}u`, K: `${spec.K}u`, Kc: `${Kc}u`, decl: [] };
}

/** The values a kernel's `dims` uniform holds, where it reads one. */
function kernelDims(spec: MatmulSpec, tile: MatmulTile): { dims?: [number, number, number, number] } {
  if (!sizeExprs(spec, tile).dyn) return {};
  return { dims: [spec.M, spec.N, spec.K, splitSlices(spec, tile).Kc] };
}

/** Generation 1: one flat workgroup buffer per operand, two barriers per k-tile. */
function gen1Wgsl(spec: MatmulSpec, tile: MatmulTile): string {
  const { M, N, K, transA, transB } = spec;
  const { BM, BN, BK, TM, TN } = tile;
  const TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
  const gM = TM / 4, gN = TN / 4; // groups of 4 rows / 4 columns per thread
  const guardM = M % BM !== 0, guardN = N % BN !== 0, guardK = K % BK !== 0;
  const aVec4s = (BM * BK) / 4, bVec4s = (BN * BK) / 4;
  const aSlots = aVec4s / THREADS, bSlots = bVec4s / THREADS;
  const h16 = spec.math === "f16";
  /** The tile element type: f16 tiles with f16 math, else f32. */
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  const d = sizeExprs(spec, tile);
  const L: string[] = [...bindingDecls(matmulBindings(spec), h16), ...d.decl];
  L.push(`var<workgroup> As: array<${tv}, ${aVec4s}>;`);
  L.push(`var<workgroup> Bs: array<${tv}, ${bVec4s}>;`);
  if (spec.dropout) L.push(dropWgsl());
  if (spec.epilogue === "gelu" || spec.epilogue === "gelu_grad" || spec.prologueA === "gelu") {
    L.push(GELU_WGSL);
  }

  // Global → register loads for one k-tile starting at k0.
  const loadA: string[] = [], storeA: string[] = [], loadB: string[] = [], storeB: string[] = [];
  const pro = (read: string) =>
    spec.prologueA !== "gelu" ? read : h16 ? `vec4<f16>(gelu4(vec4<f32>(${read})))` : `gelu4(${read})`;
  for (let s = 0; s < aSlots; s++) {
    const lin = `(${s * THREADS}u + tid)`;
    if (!transA) {
      // A [M,K]: vec4 along k. Tile = BM rows × BK/4 vec4.
      loadA.push(`{ let row = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`);
      const cond = [guardM ? `m0 + row < ${d.M}` : "", guardK ? `k0 + kq * 4u < ${d.K}` : ""].filter(Boolean);
      const read = pro(`A[((m0 + row) * ${d.K} + k0 + kq * 4u) / 4u]`);
      loadA.push(
        `  ra${s} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`,
      );
      storeA.push(`{ let row = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`);
      for (let c = 0; c < 4; c++) {
        storeA.push(`  As[(kq * 4u + ${c}u) * ${BM / 4}u + row / 4u][row % 4u] = ra${s}[${c}];`);
      }
      storeA.push(`}`);
    } else {
      // A stored [K,M]: vec4 along m. Tile = BK rows × BM/4 vec4.
      loadA.push(`{ let kr = ${lin} / ${BM / 4}u; let mq = ${lin} % ${BM / 4}u;`);
      const cond = [guardM ? `m0 + mq * 4u < ${d.M}` : "", guardK ? `k0 + kr < ${d.K}` : ""].filter(Boolean);
      const read = pro(`A[((k0 + kr) * ${d.M} + m0) / 4u + mq]`);
      loadA.push(
        `  ra${s} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`,
      );
      storeA.push(`As[${lin}] = ra${s};`);
    }
  }
  for (let s = 0; s < bSlots; s++) {
    const lin = `(${s * THREADS}u + tid)`;
    if (!transB) {
      // B [K,N]: vec4 along n. Tile = BK rows × BN/4 vec4.
      loadB.push(`{ let kr = ${lin} / ${BN / 4}u; let nq = ${lin} % ${BN / 4}u;`);
      const cond = [guardN ? `n0 + nq * 4u < ${d.N}` : "", guardK ? `k0 + kr < ${d.K}` : ""].filter(Boolean);
      const read = `B[((k0 + kr) * ${d.N} + n0) / 4u + nq]`;
      loadB.push(
        `  rb${s} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`,
      );
      storeB.push(`Bs[${lin}] = rb${s};`);
    } else {
      // B stored [N,K]: vec4 along k. Tile = BN rows × BK/4 vec4.
      loadB.push(`{ let col = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`);
      const cond = [guardN ? `n0 + col < ${d.N}` : "", guardK ? `k0 + kq * 4u < ${d.K}` : ""].filter(Boolean);
      const read = `B[((n0 + col) * ${d.K} + k0 + kq * 4u) / 4u]`;
      loadB.push(
        `  rb${s} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`,
      );
      storeB.push(`{ let col = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`);
      for (let c = 0; c < 4; c++) {
        storeB.push(`  Bs[(kq * 4u + ${c}u) * ${BN / 4}u + col / 4u][col % 4u] = rb${s}[${c}];`);
      }
      storeB.push(`}`);
    }
  }

  // Register-tile multiply for one kk.
  const fma: string[] = [];
  for (let kk = 0; kk < BK; kk++) {
    for (let g = 0; g < gM; g++) fma.push(`a${g} = As[${kk * (BM / 4) + g * (BM / gM / 4)}u + ty];`);
    for (let h = 0; h < gN; h++) fma.push(`b${h} = Bs[${kk * (BN / 4) + h * (BN / gN / 4)}u + tx];`);
    fma.push(...fmaLines(gM, gN, h16));
  }
  const { decl, flush: flushLines } = registerDecls(gM, gN, aSlots, bSlots, h16);
  const F = tile.flushEvery ?? 1;
  const flush = F > 1 && flushLines.length
    ? [`if ((t + 1u) % ${F}u == 0u || !more) {`, ...flushLines, `}`]
    : flushLines;

  // Epilogue per accumulator vec4.
  const epi = epilogue(spec, tile, guardM, guardN, d);
  const nTiles = d.dyn ? `(${d.K} / ${BK}u)` : `${Math.ceil(K / BK)}u`;
  return finish(matmulCode(), spec, h16, matmulBindings(spec));
  function matmulCode(): string {
    return `${L.join("\n")}

@compute @workgroup_size(${THREADS})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let tx = tid % ${TX}u;
  let ty = tid / ${TX}u;
  let n0 = wg.x * ${BN}u;
  let m0 = wg.y * ${BM}u;
  ${decl.join("\n  ")}
  var k0 = 0u;
  ${loadA.join("\n  ")}
  ${loadB.join("\n  ")}
  ${storeA.join("\n  ")}
  ${storeB.join("\n  ")}
  workgroupBarrier();
  for (var t = 0u; t < ${nTiles}; t = t + 1u) {
    k0 = (t + 1u) * ${BK}u;
    let more = t + 1u < ${nTiles};
    if (more) {
      ${loadA.join("\n      ")}
      ${loadB.join("\n      ")}
    }
    ${fma.join("\n    ")}
    ${flush.join("\n    ")}
    workgroupBarrier();
    if (more) {
      ${storeA.join("\n      ")}
      ${storeB.join("\n      ")}
    }
    workgroupBarrier();
  }
  ${epi.join("\n  ")}
}
`;
  }
}

/** The multiply-adds of one kk from a0…, b0… into the accumulators (f16 partial sums with f16 math). */
function fmaLines(gM: number, gN: number, h16: boolean): string[] {
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  const out: string[] = [];
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) {
        const acc = h16 ? `p${g}_${i}_${h}` : `acc${g}_${i}_${h}`;
        out.push(`${acc} = fma(${tv}(a${g}[${i}]), b${h}, ${acc});`);
      }
    }
  }
  return out;
}

/** Register declarations, and with f16 math the flush of a k-tile's f16 sums into the f32 accumulators. */
function registerDecls(gM: number, gN: number, aSlots: number, bSlots: number, h16: boolean) {
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  const flush: string[] = [];
  const decl: string[] = [];
  for (let g = 0; g < gM && h16; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) {
        decl.push(`var p${g}_${i}_${h} = vec4<f16>(0.0);`);
        flush.push(
          `acc${g}_${i}_${h} = acc${g}_${i}_${h} + vec4<f32>(p${g}_${i}_${h}); p${g}_${i}_${h} = vec4<f16>(0.0);`,
        );
      }
    }
  }
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) decl.push(`var acc${g}_${i}_${h} = vec4<f32>(0.0);`);
    }
  }
  for (let g = 0; g < gM; g++) decl.push(`var a${g}: ${tv};`);
  for (let h = 0; h < gN; h++) decl.push(`var b${h}: ${tv};`);
  for (let s = 0; s < aSlots; s++) decl.push(`var ra${s}: ${tv};`);
  for (let s = 0; s < bSlots; s++) decl.push(`var rb${s}: ${tv};`);
  return { decl, flush };
}

/**
 * kPairs: the stores of one register vec4 along k (pairs kq·2 and kq·2 + 1 of row or column `idx`,
 * in group `q` of T) into workgroup tile `tile`.
 */
function pairStores(tile: string, q: string, T: number, idx: string, reg: string): string[] {
  return [[0, 0], [0, 1], [1, 0], [1, 1]].map(([c, r]) =>
    `  ${tile}[kq * 2u + ${c}u][${q} / ${T}u][${q} % ${T}u][(${idx} % 4u) / 2u][(${idx} % 2u) * 2u + ${r}u] = ${reg}[${
      2 * c + r
    }];`
  );
}

/** WGSL helper of kPairs tiles: rows k (r0) and k+1 (r1) of four columns as one workgroup element. */
const PACK_WGSL = `fn pk4(r0: vec4<f16>, r1: vec4<f16>) -> array<vec4<f16>, 2> {
  return array<vec4<f16>, 2>(vec4<f16>(r0.x, r1.x, r0.y, r1.y), vec4<f16>(r0.z, r1.z, r0.w, r1.w));
}`;

/**
 * The packed multiply-adds of one k pair (kPairs): p{g}_{i}_{h}_{j} accumulates rows' and
 * columns' even k in .x and odd k in .y.
 */
function pairFmaLines(gM: number, gN: number): string[] {
  const out: string[] = [];
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      out.push(`{ let x = a${g}[${i >> 1}].${i % 2 ? "zw" : "xy"};`);
      for (let h = 0; h < gN; h++) {
        for (let j = 0; j < 4; j++) {
          const p = `p${g}_${i}_${h}_${j}`;
          out.push(`  ${p} = fma(x, b${h}[${j >> 1}].${j % 2 ? "zw" : "xy"}, ${p});`);
        }
      }
      out.push(`}`);
    }
  }
  return out;
}

/** Register declarations of kPairs tiles, and the flush adding each output's two halves into f32. */
function pairRegisterDecls(gM: number, gN: number, aSlots: number, bSlots: number) {
  const flush: string[] = [];
  const decl: string[] = [];
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) {
        const p = (j: number) => `p${g}_${i}_${h}_${j}`;
        const js = [0, 1, 2, 3];
        for (const j of js) decl.push(`var ${p(j)} = vec2<f16>(0.0);`);
        decl.push(`var acc${g}_${i}_${h} = vec4<f32>(0.0);`);
        flush.push(
          `acc${g}_${i}_${h} = acc${g}_${i}_${h} + vec4<f32>(vec4<f16>(${
            js.map((j) => `${p(j)}.x + ${p(j)}.y`).join(", ")
          }));`,
          js.map((j) => `${p(j)} = vec2<f16>(0.0);`).join(" "),
        );
      }
    }
  }
  for (let g = 0; g < gM; g++) decl.push(`var a${g}: array<vec4<f16>, 2>;`);
  for (let h = 0; h < gN; h++) decl.push(`var b${h}: array<vec4<f16>, 2>;`);
  for (let s = 0; s < aSlots; s++) decl.push(`var ra${s}: vec4<f16>;`);
  for (let s = 0; s < bSlots; s++) decl.push(`var rb${s}: vec4<f16>;`);
  return { decl, flush };
}

/**
 * The epilogue of every accumulator vec4 (thread rows g·BM/gM + ty·4 + i, columns h·BN/gN + tx·4),
 * or with `part` the raw sums into slice wg.z of the split-K scratch.
 */
function epilogue(
  spec: MatmulSpec,
  tile: MatmulTile,
  guardM: boolean,
  guardN: boolean,
  d: SizeExprs,
  part = false,
): string[] {
  const { BM, BN, TM, TN } = tile;
  const gM = TM / 4, gN = TN / 4;
  const epi: string[] = [];
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) {
        const row = `(m0 + ${g * (BM / gM)}u + ty * 4u + ${i}u)`;
        const col = `(n0 + ${h * (BN / gN)}u + tx * 4u)`;
        const conds = [guardM ? `${row} < ${d.M}` : "", guardN ? `${col} < ${d.N}` : ""].filter(Boolean);
        const body = part
          ? [`part[((wg.z * ${d.M} + ${row}) * ${d.N} + ${col}) / 4u] = acc${g}_${i}_${h};`]
          : [
            `let q = (${row} * ${d.N} + ${col}) / 4u;`,
            `var v = acc${g}_${i}_${h};`,
            ...epilogueLines(spec, col),
          ];
        epi.push(conds.length ? `if (${conds.join(" && ")}) { ${body.join(" ")} }` : `{ ${body.join(" ")} }`);
      }
    }
  }
  return epi;
}

/**
 * Generation 2 (see the file header). Workgroup tiles are As[buffer][k][g][ty] = the 4 rows
 * g·BM/gM + ty·4 … +3 of A at k (and Bs likewise over columns and tx), so the unrolled inner loop
 * indexes with constants and one thread index. With `partial` it is the first kernel of split-K:
 * slice wg.z of K, raw sums into `part`.
 */
function gen2Wgsl(spec: MatmulSpec, tile: MatmulTile, partial: boolean): string {
  const { M, N, K, transA, transB } = spec;
  const { BM, BN, BK, TM, TN } = tile;
  const NB = tile.buffers ?? 1, warpN = tile.warpN ?? 0, byRows = (tile.transposeLoad ?? "mn") === "mn";
  const TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
  const gM = TM / 4, gN = TN / 4;
  const guardM = M % BM !== 0, guardN = N % BN !== 0, guardK = K % BK !== 0;
  const aSlots = (BM * BK) / 4 / THREADS, bSlots = (BN * BK) / 4 / THREADS;
  const h16 = spec.math === "f16";
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  // With kPairs a workgroup element is 4 rows (or columns) × one pair of k: two vec4<f16>, each
  // (row r at k, r at k+1, r+1 at k, r+1 at k+1), so a row's pair is a swizzle.
  const kp = !!tile.kPairs, KR = kp ? BK / 2 : BK, wv = kp ? "array<vec4<f16>, 2>" : tv;
  const bindings = partial ? ["A", "B", "part"] : matmulBindings(spec);
  const d = sizeExprs(spec, tile);
  const L: string[] = [...bindingDecls(bindings, h16), ...d.decl];
  L.push(`var<workgroup> As: array<array<array<array<${wv}, ${TY}>, ${gM}>, ${KR}>, ${NB}>;`);
  L.push(`var<workgroup> Bs: array<array<array<array<${wv}, ${TX}>, ${gN}>, ${KR}>, ${NB}>;`);
  if (kp) L.push(PACK_WGSL);
  if (!partial && spec.dropout) L.push(dropWgsl());
  const geluEpi = !partial && (spec.epilogue === "gelu" || spec.epilogue === "gelu_grad");
  if (geluEpi || spec.prologueA === "gelu") L.push(GELU_WGSL);

  const pro = (read: string) =>
    spec.prologueA !== "gelu" ? read : h16 ? `vec4<f16>(gelu4(vec4<f32>(${read})))` : `gelu4(${read})`;
  const guarded = (reg: string, read: string, cond: string[]) =>
    `  ${reg} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`;
  // Global → register loads of one k-tile at k0, and register → workgroup stores into buffer b.
  const loadA: string[] = [], loadB: string[] = [];
  const storeA: Array<(b: number) => string[]> = [], storeB: Array<(b: number) => string[]> = [];
  for (let s = 0; s < aSlots; s++) {
    const lin = `(${s * THREADS}u + tid)`;
    if (kp && transA) {
      // A stored [K,M] with k pairs: slot pair (2q, 2q+1) reads rows 2kp and 2kp+1 of one vec4 along m.
      if (s % 2) continue;
      const linP = `(${(s / 2) * THREADS}u + tid)`;
      const at = `let kp = ${linP} / ${BM / 4}u; let mq = ${linP} % ${BM / 4}u;`;
      const cond = [guardM ? `m0 + mq * 4u < ${d.M}` : "", guardK ? `k0 + kp * 2u < ${d.K}` : ""].filter(
        Boolean,
      );
      for (const r of [0, 1]) {
        loadA.push(
          `{ ${at}`,
          guarded(`ra${s + r}`, pro(`A[((k0 + kp * 2u + ${r}u) * ${d.M} + m0) / 4u + mq]`), cond),
        );
      }
      storeA.push((b) => [`{ ${at} As[${b}][kp][mq / ${TY}u][mq % ${TY}u] = pk4(ra${s}, ra${s + 1}); }`]);
      continue;
    }
    if (!transA) {
      // A [M,K]: vec4 along k, stored transposed as 4 scalars (with k pairs: as two pairs of one row).
      const at = byRows
        ? `let row = ${lin} % ${BM}u; let kq = ${lin} / ${BM}u;`
        : `let row = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`;
      const cond = [guardM ? `m0 + row < ${d.M}` : "", guardK ? `k0 + kq * 4u < ${d.K}` : ""].filter(Boolean);
      loadA.push(`{ ${at}`, guarded(`ra${s}`, pro(`A[((m0 + row) * ${d.K} + k0) / 4u + kq]`), cond));
      storeA.push((b) => [
        `{ ${at} let mq = row / 4u;`,
        ...(kp
          ? pairStores(`As[${b}]`, "mq", TY, "row", `ra${s}`)
          : [0, 1, 2, 3].map((c) =>
            `  As[${b}][kq * 4u + ${c}u][mq / ${TY}u][mq % ${TY}u][row % 4u] = ra${s}[${c}];`
          )),
        `}`,
      ]);
    } else {
      // A stored [K,M]: vec4 along m.
      const at = `let kr = ${lin} / ${BM / 4}u; let mq = ${lin} % ${BM / 4}u;`;
      const cond = [guardM ? `m0 + mq * 4u < ${d.M}` : "", guardK ? `k0 + kr < ${d.K}` : ""].filter(Boolean);
      loadA.push(`{ ${at}`, guarded(`ra${s}`, pro(`A[((k0 + kr) * ${d.M} + m0) / 4u + mq]`), cond));
      storeA.push((b) => [`{ ${at} As[${b}][kr][mq / ${TY}u][mq % ${TY}u] = ra${s}; }`]);
    }
  }
  for (let s = 0; s < bSlots; s++) {
    const lin = `(${s * THREADS}u + tid)`;
    if (kp && !transB) {
      // B [K,N] with k pairs: slot pair (2q, 2q+1) reads rows 2kp and 2kp+1 of one vec4 along n.
      if (s % 2) continue;
      const linP = `(${(s / 2) * THREADS}u + tid)`;
      const at = `let kp = ${linP} / ${BN / 4}u; let nq = ${linP} % ${BN / 4}u;`;
      const cond = [guardN ? `n0 + nq * 4u < ${d.N}` : "", guardK ? `k0 + kp * 2u < ${d.K}` : ""].filter(
        Boolean,
      );
      for (const r of [0, 1]) {
        loadB.push(
          `{ ${at}`,
          guarded(`rb${s + r}`, `B[((k0 + kp * 2u + ${r}u) * ${d.N} + n0) / 4u + nq]`, cond),
        );
      }
      storeB.push((b) => [`{ ${at} Bs[${b}][kp][nq / ${TX}u][nq % ${TX}u] = pk4(rb${s}, rb${s + 1}); }`]);
      continue;
    }
    if (!transB) {
      // B [K,N]: vec4 along n.
      const at = `let kr = ${lin} / ${BN / 4}u; let nq = ${lin} % ${BN / 4}u;`;
      const cond = [guardN ? `n0 + nq * 4u < ${d.N}` : "", guardK ? `k0 + kr < ${d.K}` : ""].filter(Boolean);
      loadB.push(`{ ${at}`, guarded(`rb${s}`, `B[((k0 + kr) * ${d.N} + n0) / 4u + nq]`, cond));
      storeB.push((b) => [`{ ${at} Bs[${b}][kr][nq / ${TX}u][nq % ${TX}u] = rb${s}; }`]);
    } else {
      // B stored [N,K]: vec4 along k, stored transposed as 4 scalars (with k pairs: as two pairs of one column).
      const at = byRows
        ? `let col = ${lin} % ${BN}u; let kq = ${lin} / ${BN}u;`
        : `let col = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`;
      const cond = [guardN ? `n0 + col < ${d.N}` : "", guardK ? `k0 + kq * 4u < ${d.K}` : ""].filter(Boolean);
      loadB.push(`{ ${at}`, guarded(`rb${s}`, `B[((n0 + col) * ${d.K} + k0) / 4u + kq]`, cond));
      storeB.push((b) => [
        `{ ${at} let nq = col / 4u;`,
        ...(kp
          ? pairStores(`Bs[${b}]`, "nq", TX, "col", `rb${s}`)
          : [0, 1, 2, 3].map((c) =>
            `  Bs[${b}][kq * 4u + ${c}u][nq / ${TX}u][nq % ${TX}u][col % 4u] = rb${s}[${c}];`
          )),
        `}`,
      ]);
    }
  }
  const loads = [...loadA, ...loadB];
  const stores = (b: number) => [...storeA.flatMap((f) => f(b)), ...storeB.flatMap((f) => f(b))];
  const compute = (b: number) => {
    const out: string[] = [];
    for (let kk = 0; kk < KR; kk++) {
      for (let g = 0; g < gM; g++) out.push(`a${g} = As[${b}][${kk}][${g}][ty];`);
      for (let h = 0; h < gN; h++) out.push(`b${h} = Bs[${b}][${kk}][${h}][tx];`);
      out.push(...(kp ? pairFmaLines(gM, gN) : fmaLines(gM, gN, h16)));
    }
    return out;
  };
  const { decl, flush: flushLines } = kp
    ? pairRegisterDecls(gM, gN, aSlots, bSlots)
    : registerDecls(gM, gN, aSlots, bSlots, h16);
  // With flushEvery F > 1 the f16 sums are flushed after every F-th k-tile and after the last.
  const F = tile.flushEvery ?? 1;
  const flushAt = (next: string) =>
    F > 1 && flushLines.length
      ? [`if (${next} % ${F}u == 0u || ${next} >= nT) {`, ...flushLines, `}`]
      : flushLines;
  const threadIds = warpN
    ? [
      `let wid = tid / 32u;`,
      `let lane = tid % 32u;`,
      `let tx = (wid % ${TX / warpN}u) * ${warpN}u + lane % ${warpN}u;`,
      `let ty = (wid / ${TX / warpN}u) * ${32 / warpN}u + lane / ${warpN}u;`,
    ]
    : [`let tx = tid % ${TX}u;`, `let ty = tid / ${TX}u;`];
  const kRange = partial
    ? [`let kBeg = wg.z * ${d.Kc};`, `let nT = (min(${d.K}, kBeg + ${d.Kc}) - kBeg + ${BK - 1}u) / ${BK}u;`]
    : [`let kBeg = 0u;`, `let nT = ${d.dyn ? `${d.K} / ${BK}u` : `${Math.ceil(K / BK)}u`};`];
  const ind = (lines: string[], n: number) => lines.join("\n" + " ".repeat(n));
  const loop = NB === 1
    ? `for (var t = 0u; t < nT; t = t + 1u) {
    let more = t + 1u < nT;
    if (more) {
      k0 = kBeg + (t + 1u) * ${BK}u;
      ${ind(loads, 6)}
    }
    ${ind(compute(0), 4)}
    ${ind(flushAt("t + 1u"), 4)}
    workgroupBarrier();
    if (more) {
      ${ind(stores(0), 6)}
    }
    workgroupBarrier();
  }`
    : `for (var t = 0u; t < nT; t = t + 2u) {
    if (t + 1u < nT) {
      k0 = kBeg + (t + 1u) * ${BK}u;
      ${ind(loads, 6)}
    }
    ${ind(compute(0), 4)}
    ${ind(flushAt("t + 1u"), 4)}
    if (t + 1u < nT) {
      ${ind(stores(1), 6)}
    }
    workgroupBarrier();
    if (t + 1u >= nT) { break; }
    if (t + 2u < nT) {
      k0 = kBeg + (t + 2u) * ${BK}u;
      ${ind(loads, 6)}
    }
    ${ind(compute(1), 4)}
    ${ind(flushAt("t + 2u"), 4)}
    if (t + 2u < nT) {
      ${ind(stores(0), 6)}
    }
    workgroupBarrier();
  }`;
  const code = `${L.join("\n")}

@compute @workgroup_size(${THREADS})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  ${ind(threadIds, 2)}
  let n0 = wg.x * ${BN}u;
  let m0 = wg.y * ${BM}u;
  ${ind(kRange, 2)}
  ${ind(decl, 2)}
  var k0 = kBeg;
  ${ind(loads, 2)}
  ${ind(stores(0), 2)}
  workgroupBarrier();
  ${loop}
  ${ind(epilogue(spec, tile, guardM, guardN, d, partial), 2)}
}
`;
  return finish(code, spec, h16, bindings);
}

/** Second kernel of split-K: out = epilogue(Σ_s part[s]) per vec4. Grid1d over M·N/4/64. */
function splitReduceWgsl(spec: MatmulSpec, S: number): string {
  const MN4 = (spec.M * spec.N) / 4, N4 = spec.N / 4;
  const bindings = ["part", ...matmulBindings(spec).filter((n) => n !== "A" && n !== "B")];
  const L = bindingDecls(bindings, false, ["out", "out2"]);
  if (spec.dropout) L.push(dropWgsl());
  if (spec.epilogue === "gelu" || spec.epilogue === "gelu_grad") L.push(GELU_WGSL);
  const sum = Array.from({ length: S }, (_, s) => `part[${s ? `q + ${s * MN4}u` : "q"}]`).join(" + ");
  const code = `${L.join("\n")}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let q = ${LINEAR_WG} * 64u + tid;
  if (q >= ${MN4}u) { return; }
  let col = (q % ${N4}u) * 4u;
  var v = ${sum};
  ${epilogueLines(spec, "col").join("\n  ")}
}
`;
  return finish(code, spec, false, bindings);
}
