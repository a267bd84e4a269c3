/**
 * WGSL snippets and dispatch helpers shared by the kernel generators.
 */

import { PCG_WGSL } from "../../model/rng.ts";

/** GELU, tanh form, and its derivative, on vec4. */
export const GELU_WGSL = /* wgsl */ `
const GELU_K: f32 = 0.7978845608028654; // sqrt(2/pi)
fn gelu4(x: vec4<f32>) -> vec4<f32> {
  let u = GELU_K * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + tanh(clamp(u, vec4<f32>(-15.0), vec4<f32>(15.0))));
}
fn gelu_grad4(x: vec4<f32>) -> vec4<f32> {
  let u = GELU_K * (x + 0.044715 * x * x * x);
  let t = tanh(clamp(u, vec4<f32>(-15.0), vec4<f32>(15.0)));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * 0.044715 * x * x);
}`;

/**
 * Per-step dropout parameters of one site (key, threshold, bitcast scale, unused), bound as a
 * uniform at group 1: the op binds its site's slot of the plan's dropout uniform (one slot of
 * DROPOUT_SLOT_BYTES per site, model/rng.ts), so the site is not in the kernel's text and every
 * layer shares one pipeline. `keep(i)` returns the multiplier of element i: 0 or 1/(1-p).
 */
export function dropWgsl(): string {
  return `${PCG_WGSL}
@group(1) @binding(0) var<uniform> drop: vec4<u32>;
fn keep(i: u32) -> f32 {
  return select(0.0, bitcast<f32>(drop.z), pcg(pcg(i) ^ drop.x) >= drop.y);
}`;
}

/** Splits `n` workgroups into an (x, y) grid within the per-dimension limit. */
export function grid1d(n: number, maxPerDim = 65535): [number, number, number] {
  if (n <= maxPerDim) return [Math.max(1, n), 1, 1];
  const y = Math.ceil(n / maxPerDim);
  return [Math.ceil(n / y), y, 1];
}

/** WGSL expression of the linear workgroup id for a {@link grid1d} dispatch. */
export const LINEAR_WG = "(wg.x + wg.y * nwg.x)";

/** Words of 4 bytes that one workgroup of {@link zeroWordsWgsl} clears (256 threads, 4 each). */
export const ZERO_WORDS_PER_GROUP = 1024;

/**
 * Sets the first `n` 32-bit words of a buffer binding to zero, whatever they hold (f32, f16 pairs):
 * a dispatch of grid1d(ceil(n / ZERO_WORDS_PER_GROUP)). A kernel this small compiles in a few
 * milliseconds, so it is cheaper than a second variant of a large kernel that stores instead of
 * accumulating.
 */
export function zeroWordsWgsl(n: number): string {
  return `@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let base = ${LINEAR_WG} * ${ZERO_WORDS_PER_GROUP}u + tid;
  for (var j = 0u; j < 4u; j = j + 1u) {
    let i = base + j * 256u;
    if (i < ${n}u) { out[i] = 0u; }
  }
}
`;
}

/** Bytes of one uniform binding every WebGPU device allows (the minimum maxUniformBufferBindingSize). */
export const UNIFORM_BINDING_BYTES = 65536;

/** out = src ∘ dropout mask of the site bound at group 1 (the backward of a dropout). Grid1d(n4 / 64). */
export function dropoutMaskWgsl(n4: number): string {
  return `
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;
${dropWgsl()}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let g = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (g >= ${n4}u) { return; }
  let e = g * 4u;
  out[g] = src[g] * vec4<f32>(keep(e), keep(e + 1u), keep(e + 2u), keep(e + 3u));
}
`;
}

/** out = gelu(src), elementwise over n4 vec4s (element types per {@link withStorageDtypes}). Grid1d(n4 / 64). */
export function geluWgsl(n4: number, dtype: StorageDtype = "f32"): string {
  return withStorageDtypes(
    `
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> out: array<vec4<f32>>;
${GELU_WGSL}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let g = (wg.x + wg.y * nwg.x) * 64u + tid;
  if (g >= ${n4}u) { return; }
  out[g] = gelu4(src[g]);
}
`,
    { src: dtype, out: dtype },
  );
}

/**
 * WGSL that tree-reduces workgroup array `arr[0..size)` into `arr[0]` with `op`, ending on a
 * barrier. Every invocation (`tid`) of the workgroup must run it, after storing its value.
 */
export function treeReduce(arr: string, size: number, op: "+" | "max" | "min"): string {
  const combine = op === "+" ? `${arr}[tid] + ${arr}[tid + k]` : `${op}(${arr}[tid], ${arr}[tid + k])`;
  return `for (var k = ${size / 2}u; k > 0u; k = k >> 1u) {
    if (tid < k) { ${arr}[tid] = ${combine}; }
    workgroupBarrier();
  }`;
}

/** Element types a storage binding can hold. */
export type StorageDtype = "f32" | "f16";

/**
 * Gives `array<vec4<f32>>` storage bindings of a generated kernel another element type without a
 * second copy of the kernel: the binding's declaration becomes `array<vec4<f16>>`, every read
 * `name[i]` becomes `vec4<f32>(name[i])` and every store `name[i] = e;` becomes
 * `name[i] = vec4<f16>(e);`, so the arithmetic stays f32 (LayerNorm statistics, softmax, matmul
 * accumulation) and only memory is f16. Adds `enable f16;` when any binding is f16. Indices must not
 * contain brackets, which holds for every kernel here.
 */
export function withStorageDtypes(code: string, dtypes: Record<string, StorageDtype | undefined>): string {
  const f16 = Object.entries(dtypes).filter(([, t]) => t === "f16").map(([name]) => name);
  if (f16.length === 0) return code;
  let out = code;
  for (const name of f16) {
    const decl = new RegExp(`(var<storage,[^>]*>\\s+${name}\\s*:\\s*array<)vec4<f32>>`);
    if (!decl.test(out)) throw new Error(`Kernel has no vec4<f32> storage binding "${name}"`);
    out = out.replace(decl, "$1vec4<f16>>");
    out = out.replace(
      new RegExp(`\\b${name}\\[([^\\[\\]]*)\\]\\s*=(?!=)\\s*([^;]*);`, "g"),
      (_m, idx, rhs) => `${name}@@[${idx}] = vec4<f16>(${rhs});`,
    );
    out = out.replace(new RegExp(`\\b${name}\\[([^\\[\\]]*)\\]`, "g"), `vec4<f32>(${name}[$1])`);
    out = out.replaceAll(`${name}@@[`, `${name}[`);
  }
  return `enable f16;\n${out}`;
}
