/**
 * Tiled matrix multiply, generated per shape: out[M,N] = A[M,K] · B[K,N] (+ bias) with an epilogue.
 *
 * Each workgroup computes a BM×BN block; each thread a TM×TN register tile held in named vec4
 * variables (fully unrolled: WGSL arrays indexed in loops end up in slow local memory). Tiles of
 * A and B go through workgroup memory, transposed on load so that one inner loop serves every
 * layout: `transA` reads A stored [K,M], `transB` reads B stored [N,K] (the forms backward needs).
 * The next tile is prefetched into registers while the current one is multiplied.
 *
 * Element types: any binding may be f16 in memory (`dtypes`, converted on load and store). With
 * `math: "f16"` (A and B both f16) the tiles stay f16 and each BK-long stretch of K is multiplied
 * and summed in f16 (twice the f32 rate where the GPU has packed f16), then flushed into the f32
 * accumulators, so long K keeps fp32 accuracy between stretches.
 *
 * A prologue can apply GELU to A as it is loaded (`prologueA: "gelu"`), so the MLP keeps only its
 * pre-activation and the projection and its weight gradient read gelu(fch) for free.
 *
 * Epilogues fuse the elementwise work that follows a matmul in GPT-2:
 *   store      out = acc (+ bias)
 *   accumulate out += acc (+ bias)
 *   residual   out = res + dropout(acc + bias)            (attention / MLP output + residual add)
 *   gelu       out = acc + bias, out2 = gelu(out)         (MLP up-projection keeps pre-activation)
 *   gelu_grad  out = acc * gelu'(aux)                     (backward through GELU)
 */

import { dropWgsl, GELU_WGSL, type StorageDtype, withStorageDtypes } from "./common.ts";

/** Fused work after the multiply. */
export type MatmulEpilogue = "store" | "accumulate" | "residual" | "gelu" | "gelu_grad";

/** A matmul shape and its fused epilogue. */
export interface MatmulSpec {
  M: number;
  N: number;
  K: number;
  /** A is stored [K, M] (row-major) instead of [M, K]. */
  transA: boolean;
  /** B is stored [N, K] instead of [K, N]. */
  transB: boolean;
  /** Add bias[N]. */
  bias: boolean;
  epilogue: MatmulEpilogue;
  /** For the residual epilogue: apply seeded dropout of this site (uniform at group 1, see dropWgsl). */
  dropout?: { site: number; nSites: number };
  /** Element types in memory of bindings that are not f32 (accumulation is always f32). */
  dtypes?: Partial<Record<MatmulBinding, StorageDtype>>;
  /** "f16": f16 products and sums within each k-tile, flushed to f32 (needs A and B in f16). */
  math?: "f32" | "f16";
  /** Apply GELU to every element of A as it is loaded. */
  prologueA?: "gelu";
}

/** Names of a matmul's storage bindings. */
export type MatmulBinding = "A" | "B" | "out" | "bias" | "res" | "out2" | "aux";

/** Block and thread tiling. */
export interface MatmulTile {
  BM: number;
  BN: number;
  BK: number;
  /** Rows per thread: 4 or 8. */
  TM: number;
  /** Columns per thread: 4 or 8. */
  TN: number;
}

/** Picks a tiling: large blocks when they still fill the GPU, smaller ones otherwise. */
export function chooseTile(spec: Pick<MatmulSpec, "M" | "N" | "K">, maxInvocations = 256): MatmulTile {
  const { M, N } = spec;
  const big = Math.ceil(M / 128) * Math.ceil(N / 128);
  // Measured on the H200 (bench/matmul_bench.ts): 128×128 tiles run 37–41 TFLOP/s on GPT-2's
  // shapes; when they would leave SMs idle (e.g. a 1024×1024 weight gradient), 128×64 runs 35
  // against 20.
  if (M >= 128 && N >= 128 && big >= 160) return { BM: 128, BN: 128, BK: 16, TM: 8, TN: 8 };
  if (M >= 128 && N >= 64 && maxInvocations >= 128) return { BM: 128, BN: 64, BK: 16, TM: 8, TN: 4 };
  if (M >= 64 && N >= 64 && maxInvocations >= 256) return { BM: 64, BN: 64, BK: 16, TM: 4, TN: 4 };
  return { BM: 32, BN: 32, BK: 16, TM: 4, TN: 4 };
}

/** Names of the storage bindings, in binding order, that a spec's kernel declares. */
export function matmulBindings(spec: MatmulSpec): string[] {
  const b = ["A", "B", "out"];
  if (spec.bias) b.push("bias");
  if (spec.epilogue === "residual") b.push("res");
  if (spec.epilogue === "gelu") b.push("out2");
  if (spec.epilogue === "gelu_grad") b.push("aux");
  return b;
}

/** Generates the WGSL of one matmul. */
export function matmulWgsl(spec: MatmulSpec, tile: MatmulTile): string {
  const { M, N, K, transA, transB } = spec;
  const { BM, BN, BK, TM, TN } = tile;
  if (![4, 8].includes(TM) || ![4, 8].includes(TN)) throw new RangeError(`Matmul tile TM/TN must be 4 or 8`);
  if (BK % 4 !== 0) throw new RangeError(`Matmul tile BK ${BK} must be a multiple of 4`);
  if ((transA ? M : K) % 4 !== 0) {
    throw new RangeError(`Matmul A's contiguous dimension must be a multiple of 4`);
  }
  if ((transB ? K : N) % 4 !== 0) {
    throw new RangeError(`Matmul B's contiguous dimension must be a multiple of 4`);
  }
  if (N % 4 !== 0) throw new RangeError(`Matmul N ${N} must be a multiple of 4`);
  const TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
  const gM = TM / 4, gN = TN / 4; // groups of 4 rows / 4 columns per thread
  const guardM = M % BM !== 0, guardN = N % BN !== 0, guardK = K % BK !== 0;
  const aVec4s = (BM * BK) / 4, bVec4s = (BN * BK) / 4;
  if (aVec4s % THREADS !== 0 || bVec4s % THREADS !== 0) {
    throw new RangeError(`Matmul tile ${BM}x${BN}x${BK} does not divide among ${THREADS} threads`);
  }
  const aSlots = aVec4s / THREADS, bSlots = bVec4s / THREADS;
  const h16 = spec.math === "f16";
  if (h16 && (spec.dtypes?.A !== "f16" || spec.dtypes?.B !== "f16")) {
    throw new RangeError(`Matmul math "f16" needs A and B in f16`);
  }
  /** The tile element type: f16 tiles with f16 math, else f32. */
  const tv = h16 ? "vec4<f16>" : "vec4<f32>";
  const L: string[] = [];
  const bindings = matmulBindings(spec);
  const rw = new Set(["out", "out2"]);
  bindings.forEach((name, i) => {
    L.push(
      `@group(0) @binding(${i}) var<storage, ${rw.has(name) ? "read_write" : "read"}> ${name}: array<${
        h16 && (name === "A" || name === "B") ? tv : "vec4<f32>"
      }>;`,
    );
  });
  L.push(`var<workgroup> As: array<${tv}, ${aVec4s}>;`);
  L.push(`var<workgroup> Bs: array<${tv}, ${bVec4s}>;`);
  if (spec.dropout) L.push(dropWgsl(spec.dropout.nSites));
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
      const cond = [guardM ? `m0 + row < ${M}u` : "", guardK ? `k0 + kq * 4u < ${K}u` : ""].filter(Boolean);
      const read = pro(`A[((m0 + row) * ${K}u + k0 + kq * 4u) / 4u]`);
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
      const cond = [guardM ? `m0 + mq * 4u < ${M}u` : "", guardK ? `k0 + kr < ${K}u` : ""].filter(Boolean);
      const read = pro(`A[((k0 + kr) * ${M}u + m0) / 4u + mq]`);
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
      const cond = [guardN ? `n0 + nq * 4u < ${N}u` : "", guardK ? `k0 + kr < ${K}u` : ""].filter(Boolean);
      const read = `B[((k0 + kr) * ${N}u + n0) / 4u + nq]`;
      loadB.push(
        `  rb${s} = ${cond.length ? `select(${tv}(0.0), ${read}, ${cond.join(" && ")})` : read}; }`,
      );
      storeB.push(`Bs[${lin}] = rb${s};`);
    } else {
      // B stored [N,K]: vec4 along k. Tile = BN rows × BK/4 vec4.
      loadB.push(`{ let col = ${lin} / ${BK / 4}u; let kq = ${lin} % ${BK / 4}u;`);
      const cond = [guardN ? `n0 + col < ${N}u` : "", guardK ? `k0 + kq * 4u < ${K}u` : ""].filter(Boolean);
      const read = `B[((n0 + col) * ${K}u + k0 + kq * 4u) / 4u]`;
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
    for (let g = 0; g < gM; g++) {
      for (let i = 0; i < 4; i++) {
        for (let h = 0; h < gN; h++) {
          const acc = h16 ? `p${g}_${i}_${h}` : `acc${g}_${i}_${h}`;
          fma.push(`${acc} = fma(${tv}(a${g}[${i}]), b${h}, ${acc});`);
        }
      }
    }
  }
  // f16 math: the k-tile's f16 partial sums flushed into the f32 accumulators.
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

  // Epilogue per accumulator vec4.
  const epi: string[] = [];
  for (let g = 0; g < gM; g++) {
    for (let i = 0; i < 4; i++) {
      for (let h = 0; h < gN; h++) {
        const row = `(m0 + ${g * (BM / gM)}u + ty * 4u + ${i}u)`;
        const col = `(n0 + ${h * (BN / gN)}u + tx * 4u)`;
        const conds = [guardM ? `${row} < ${M}u` : "", guardN ? `${col} < ${N}u` : ""].filter(Boolean);
        const body: string[] = [];
        body.push(`let q = (${row} * ${N}u + ${col}) / 4u;`);
        body.push(`var v = acc${g}_${i}_${h};`);
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
              const st = `${spec.dropout.site}u`;
              body.push(`let e = q * 4u;`);
              body.push(
                `v = v * vec4<f32>(keep(e, ${st}), keep(e + 1u, ${st}), keep(e + 2u, ${st}), keep(e + 3u, ${st}));`,
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
        epi.push(conds.length ? `if (${conds.join(" && ")}) { ${body.join(" ")} }` : `{ ${body.join(" ")} }`);
      }
    }
  }
  const nTiles = Math.ceil(K / BK);
  // With f16 math A and B are declared f16 above; the rewrite handles the other bindings.
  const { A: _a, B: _b, ...rest } = spec.dtypes ?? {};
  const code = withStorageDtypes(matmulCode(), h16 ? rest : spec.dtypes ?? {});
  return h16 && !code.startsWith("enable f16;") ? `enable f16;\n${code}` : code;
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
  for (var t = 0u; t < ${nTiles}u; t = t + 1u) {
    k0 = (t + 1u) * ${BK}u;
    let more = t + 1u < ${nTiles}u;
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

/** Workgroup counts (x over N, y over M). */
export function matmulGrid(spec: MatmulSpec, tile: MatmulTile): [number, number] {
  return [Math.ceil(spec.N / tile.BN), Math.ceil(spec.M / tile.BM)];
}

/** FLOPs of one matmul (2·M·N·K). */
export function matmulFlops(spec: MatmulSpec): number {
  return 2 * spec.M * spec.N * spec.K;
}
