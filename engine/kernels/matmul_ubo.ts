/**
 * A matmul for CPU adapters (llvmpipe, lavapipe) that reads one operand through a uniform buffer.
 *
 * Measured on lavapipe (Mesa 22.3, LLVM 15, AVX2; bench/RESULTS.md): a vec4 read from a storage
 * buffer or from workgroup memory costs about 120 ns per 8 invocations whatever its index (each
 * is a loop over the lanes with a bounds check per component), a vec4 read from a uniform buffer
 * about 12 ns, and a vec4 fused multiply-add about 3 ns. The tiled kernels of matmul.ts, whose
 * every multiply-add waits on workgroup-memory reads, run the LM head's shapes at 0.6-1.6 GFLOP/s
 * there. Here the operand that every invocation reads in full (the "uniform operand": up to 64 KiB
 * of it per dispatch) is bound as a uniform buffer, and each invocation reads its own 4 rows or
 * columns of the other operand (the "lane operand") from storage once per k, so a storage read
 * feeds as many multiply-adds as the uniform operand has rows or columns.
 *
 * Two forms, by which output dimension the invocations run along:
 *   lanes over N: the uniform operand is A ([M, K], not transposed), in chunks of rows (one dispatch
 *     each, at most 128 rows); each invocation computes 4 columns of every row of the chunk.
 *   lanes over M: the uniform operand is B ([K, N], not transposed, N ≤ 128), in chunks of K (one
 *     dispatch each, in order); each invocation computes 4 rows, all N columns. A chunk after the
 *     first continues the sums the previous one left in `out`; the last applies the epilogue.
 * Every output element is one fused multiply-add chain over k in order starting from 0 (from the
 * prior value of `out` with the accumulate epilogue over several K chunks), as in the tiled kernels
 * (fmaLines in matmul.ts), so without that case the results are bit-identical to theirs.
 *
 * f32 storage only; the uniform operand's buffer needs GPUBufferUsage.UNIFORM.
 */

import { dropWgsl, GELU_WGSL } from "./common.ts";
import { matmulBindings, type MatmulSpec } from "./matmul.ts";

/** The device's limits that shape the dispatches. */
export interface UboMatmulLimits {
  /** maxUniformBufferBindingSize (WebGPU's minimum: 65536). */
  maxUniformBytes: number;
  /** minUniformBufferOffsetAlignment. */
  uniformAlign: number;
  /** minStorageBufferOffsetAlignment. */
  storageAlign: number;
}

/** One dispatch: bindings in order, the byte range of each binding within the caller's view of it. */
export interface UboMatmulDispatch {
  code: string;
  bindings: string[];
  /** Byte offset and size within the caller's view, for bindings that take only part of it. */
  ranges: Record<string, { offset: number; size: number }>;
  grid: [number, number, number];
  /** Binds the dropout uniform at group 1. */
  uniform: boolean;
  /** The operand bound as a uniform buffer (its buffer needs GPUBufferUsage.UNIFORM). */
  operand: "A" | "B";
}

/**
 * Rows per dispatch (lanes over N) and columns per invocation (lanes over M). Longer kernels
 * compile for seconds on llvmpipe; fewer columns per invocation read the lane operand more often
 * (measured on lavapipe for the LM head's shapes of gpt2-tiny: rows 128 → 32 took the forward from
 * 124 to 151-223 ms and its compilation from 4 to 0.7 s; 64 → 32 columns took its weight gradient
 * from 126-139 to 251-271 ms).
 */
const ROWS_PER_DISPATCH = 32;
const COLS_PER_LANE = 64;

/** Invocations per workgroup: 64, fewer (down to 8) so that there are at least 4 workgroups. */
function threadsFor(lanes: number): number {
  let wg = 64;
  while (wg > 8 && Math.ceil(lanes / wg) < 4) wg /= 2;
  return wg;
}

/** The dispatches of `spec` on a CPU adapter, or why this kernel cannot compute it. */
export function uboMatmulPlan(spec: MatmulSpec, lim: UboMatmulLimits): UboMatmulDispatch[] | string {
  const { M, N, K } = spec;
  if (Object.values(spec.dtypes ?? {}).some((d) => d === "f16")) return "f16 storage";
  if (N % 4 !== 0 || K % 4 !== 0 || M % 4 !== 0) return "M, N and K must be multiples of 4";
  if (!spec.transA) {
    const r = lanesOverN(spec, lim);
    if (typeof r !== "string") return r;
  }
  if (!spec.transB) return lanesOverM(spec, lim);
  return "needs A or B not transposed, with a uniform chunk that fits";
}

const aligned = (bytes: number, align: number) => bytes % align === 0;

function lanesOverN(spec: MatmulSpec, lim: UboMatmulLimits): UboMatmulDispatch[] | string {
  const { M, N, K } = spec;
  let Jc = Math.min(ROWS_PER_DISPATCH, M, Math.floor(lim.maxUniformBytes / (K * 4)));
  while (
    Jc > 0 && Jc < M &&
    !(aligned(Jc * K * 4, lim.uniformAlign) && aligned(Jc * N * 4, lim.storageAlign))
  ) Jc--;
  if (Jc < 1) return "a row of A exceeds the uniform binding";
  const lanes = N / 4, WG = threadsFor(lanes);
  const out: UboMatmulDispatch[] = [];
  const rowBound = ["out", "res", "aux", "out2"];
  for (let m0 = 0; m0 < M; m0 += Jc) {
    const J = Math.min(Jc, M - m0);
    const ranges: UboMatmulDispatch["ranges"] = { A: { offset: m0 * K * 4, size: J * K * 4 } };
    for (const n of matmulBindings(spec)) {
      if (rowBound.includes(n)) ranges[n] = { offset: m0 * N * 4, size: J * N * 4 };
    }
    out.push({
      code: lanesOverNWgsl(spec, J, m0, WG),
      bindings: matmulBindings(spec),
      ranges,
      grid: [Math.ceil(lanes / WG), 1, 1],
      uniform: !!spec.dropout,
      operand: "A",
    });
  }
  return out;
}

function lanesOverM(spec: MatmulSpec, lim: UboMatmulLimits): UboMatmulDispatch[] | string {
  const { M, N, K } = spec;
  const NC = Math.min(N, COLS_PER_LANE);
  if (N % NC !== 0) return `N ${N} is not a multiple of ${NC}`;
  const laneOffset = (k0: number) => spec.transA ? k0 * M * 4 : k0 * 4;
  let Kc = Math.min(K, Math.floor(lim.maxUniformBytes / (N * 4 * 4)) * 4);
  while (
    Kc > 0 && Kc < K &&
    !(aligned(Kc * N * 4, lim.uniformAlign) && aligned(laneOffset(Kc), lim.storageAlign))
  ) Kc -= 4;
  if (Kc < 4) return "4 rows of B exceed the uniform binding";
  const lanes = (M / 4) * (N / NC), WG = threadsFor(lanes);
  const out: UboMatmulDispatch[] = [];
  const nChunks = Math.ceil(K / Kc);
  for (let c = 0; c < nChunks; c++) {
    const k0 = c * Kc, kn = Math.min(Kc, K - k0);
    const lane = spec.transA
      ? { offset: k0 * M * 4, size: kn * M * 4 }
      : { offset: k0 * 4, size: (M * K - k0) * 4 };
    out.push({
      code: lanesOverMWgsl(spec, kn, NC, c === 0, c === nChunks - 1, WG),
      // Only the last chunk applies the epilogue (bindings a kernel does not use must not be bound).
      bindings: c === nChunks - 1 ? matmulBindings(spec) : ["A", "B", "out"],
      ranges: { B: { offset: k0 * N * 4, size: kn * N * 4 }, A: lane },
      grid: [Math.ceil(lanes / WG), 1, 1],
      uniform: !!spec.dropout && c === nChunks - 1,
      operand: "B",
    });
  }
  return out;
}

/** Declarations: `uni` is the uniform operand (fixed length `uniVec4` vec4). */
function decls(spec: MatmulSpec, uni: string, uniVec4: number, withEpilogue: boolean): string[] {
  const L = (withEpilogue ? matmulBindings(spec) : ["A", "B", "out"]).map((name, i) =>
    name === uni
      ? `@group(0) @binding(${i}) var<uniform> ${name}: array<vec4<f32>, ${uniVec4}>;`
      : `@group(0) @binding(${i}) var<storage, ${
        name === "out" || name === "out2" ? "read_write" : "read"
      }> ${name}: array<vec4<f32>>;`
  );
  if (withEpilogue && spec.dropout) L.push(dropWgsl());
  const geluEpi = withEpilogue && (spec.epilogue === "gelu" || spec.epilogue === "gelu_grad");
  if (geluEpi || spec.prologueA === "gelu") L.push(GELU_WGSL);
  return L;
}

/** The epilogue of one output vec4 `v` at local index `q` (element index in the whole output: `e0 + q * 4`). */
function epilogue(spec: MatmulSpec, q: string, v: string, e0: number, biasIdx: string): string {
  const lines: string[] = [`var v = ${v};`];
  if (spec.bias) lines.push(`v = v + bias[${biasIdx}];`);
  switch (spec.epilogue) {
    case "store":
      lines.push(`out[${q}] = v;`);
      break;
    case "accumulate":
      lines.push(`out[${q}] = out[${q}] + v;`);
      break;
    case "residual":
      if (spec.dropout) {
        lines.push(`let e = ${e0}u + (${q}) * 4u;`);
        lines.push(
          `v = v * vec4<f32>(keep(e), keep(e + 1u), keep(e + 2u), keep(e + 3u));`,
        );
      }
      lines.push(`out[${q}] = res[${q}] + v;`);
      break;
    case "gelu":
      lines.push(`out[${q}] = v;`, `out2[${q}] = gelu4(v);`);
      break;
    case "gelu_grad":
      lines.push(`out[${q}] = v * gelu_grad4(aux[${q}]);`);
      break;
  }
  return `{ ${lines.join(" ")} }`;
}

/** Lanes over N: rows m0 … m0+J-1 of A uniform, invocation nq computes columns 4nq … 4nq+3 of each. */
function lanesOverNWgsl(spec: MatmulSpec, J: number, m0: number, WG: number): string {
  const { N, K, transB } = spec;
  const N4 = N / 4, K4 = K / 4;
  const pro = (r: string) => spec.prologueA === "gelu" ? `gelu4(${r})` : r;
  const rows = [...Array(J).keys()], k4 = [0, 1, 2, 3];
  const body: string[] = [];
  if (transB) {
    // B [N, K]: column c's 4 values at k … k+3, regrouped by k.
    for (const c of k4) body.push(`let c${c} = B[(nq * 4u + ${c}u) * ${K4}u + kq];`);
    for (const j of k4) body.push(`let b${j} = vec4<f32>(c0[${j}], c1[${j}], c2[${j}], c3[${j}]);`);
  } else {
    for (const j of k4) body.push(`let b${j} = B[(kq * 4u + ${j}u) * ${N4}u + nq];`);
  }
  for (const i of rows) {
    body.push(`{ let a = ${pro(`A[${i * K4}u + kq]`)};`);
    for (const j of k4) body.push(`  acc${i} = fma(vec4<f32>(a[${j}]), b${j}, acc${i});`);
    body.push(`}`);
  }
  return `${decls(spec, "A", J * K4, true).join("\n")}

@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let nq = wg.x * ${WG}u + tid;
  if (nq >= ${N4}u) { return; }
  ${rows.map((i) => `var acc${i} = vec4<f32>(0.0);`).join(" ")}
  for (var kq = 0u; kq < ${K4}u; kq = kq + 1u) {
    ${body.join("\n    ")}
  }
  ${rows.map((i) => epilogue(spec, `${i * N4}u + nq`, `acc${i}`, m0 * N, "nq")).join("\n  ")}
}
`;
}

/**
 * Lanes over M: one chunk of Kc values of k (rows of B, uniform); invocation mq computes rows
 * 4mq … 4mq+3, all N columns. `first` starts from 0 (or from out's prior value with accumulate);
 * a later chunk continues from out; `last` applies the epilogue, earlier chunks store raw sums.
 */
function lanesOverMWgsl(
  spec: MatmulSpec,
  Kc: number,
  NC: number,
  first: boolean,
  last: boolean,
  WG: number,
): string {
  const { M, N, K, transA } = spec;
  const N4 = N / 4, M4 = M / 4, K4 = K / 4, G = N / NC;
  const pro = (r: string) => spec.prologueA === "gelu" ? `gelu4(${r})` : r;
  const rr = [0, 1, 2, 3], cols = [...Array(NC / 4).keys()];
  const acc = (r: number, c: number) => `acc${r}_${c}`;
  const q = (r: number, c: number) => `(mq * 4u + ${r}u) * ${N4}u + c0 + ${c}u`;
  const body: string[] = [];
  if (transA) {
    // A [K, M]: the 4 rows' values at k + j (vec4 over rows).
    for (const j of rr) body.push(`let t${j} = ${pro(`A[(kq * 4u + ${j}u) * ${M4}u + mq]`)};`);
    for (const r of rr) body.push(`let a${r} = vec4<f32>(t0[${r}], t1[${r}], t2[${r}], t3[${r}]);`);
  } else {
    // A [M, K] viewed from k0: row r's 4 values at k … k+3.
    for (const r of rr) body.push(`let a${r} = ${pro(`A[(mq * 4u + ${r}u) * ${K4}u + kq]`)};`);
  }
  for (const j of rr) {
    for (const c of cols) {
      body.push(`{ let u = B[(kq * 4u + ${j}u) * ${N4}u + c0 + ${c}u];`);
      for (const r of rr) body.push(`  ${acc(r, c)} = fma(vec4<f32>(a${r}[${j}]), u, ${acc(r, c)});`);
      body.push(`}`);
    }
  }
  // Over several chunks the accumulate epilogue starts the chain from out's prior value.
  const fromOut = !first || (spec.epilogue === "accumulate" && !last);
  const init = rr.flatMap((r) =>
    cols.map((c) => `var ${acc(r, c)} = ${fromOut ? `out[${q(r, c)}]` : "vec4<f32>(0.0)"};`)
  );
  const tail = rr.flatMap((r) =>
    cols.map((c) => {
      if (!last) return `out[${q(r, c)}] = ${acc(r, c)};`;
      if (spec.epilogue === "accumulate" && fromOut) {
        return `{ var v = ${acc(r, c)};${spec.bias ? ` v = v + bias[c0 + ${c}u];` : ""} out[${
          q(r, c)
        }] = v; }`;
      }
      return epilogue(spec, q(r, c), acc(r, c), 0, `c0 + ${c}u`);
    })
  );
  return `${decls(spec, "B", Kc * N4, last).join("\n")}

@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let lane = wg.x * ${WG}u + tid;
  if (lane >= ${M4 * G}u) { return; }
  let mq = lane / ${G}u;
  let c0 = (lane % ${G}u) * ${NC / 4}u;
  ${init.join("\n  ")}
  for (var kq = 0u; kq < ${Kc / 4}u; kq = kq + 1u) {
    ${body.join("\n    ")}
  }
  ${tail.join("\n  ")}
}
`;
}
