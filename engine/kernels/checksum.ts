/**
 * A checksum of a flat f32 array, to check that data-parallel ranks hold the same weights without
 * reading them back: every element's bits are hashed with its index and the hashes summed modulo
 * 2^32 (order-free, so the partial sums may be combined in any order). Grid (NORM_GROUPS)
 * workgroups per segment, each writing one u32 partial; the host adds the partials.
 */

import { treeReduce } from "./common.ts";
import { NORM_GROUPS } from "./adamw.ts";

const WG = 256;

/** part[g] = Σ mix(bits[i] ^ mix(base + i)) over a grid-stride share of `n4` vec4 words. */
export function checksumPartialWgsl(n4: number, base: number): string {
  return `
@group(0) @binding(0) var<storage, read> p: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> part: array<u32>;
var<workgroup> ss: array<u32, ${WG}>;
fn mix(x: u32) -> u32 {
  var z = x * 0x9e3779b1u;
  z = z ^ (z >> 15u);
  z = z * 0x85ebca77u;
  return z ^ (z >> 13u);
}
@compute @workgroup_size(${WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  var acc = 0u;
  for (var i = wg.x * ${WG}u + tid; i < ${n4}u; i = i + ${NORM_GROUPS * WG}u) {
    let w = p[i];
    let b = ${base >>> 0}u + i * 4u;
    acc = acc + mix(w.x ^ mix(b)) + mix(w.y ^ mix(b + 1u)) + mix(w.z ^ mix(b + 2u)) + mix(w.w ^ mix(b + 3u));
  }
  ss[tid] = acc;
  workgroupBarrier();
  ${treeReduce("ss", WG, "+")}
  if (tid == 0u) { part[wg.x] = ss[0]; }
}
`;
}

/** CPU twin of the kernel's element hash, for tests. */
export function checksumOf(data: Float32Array, base = 0): number {
  const bits = new Uint32Array(data.buffer, data.byteOffset, data.length);
  const mix = (x: number) => {
    let z = Math.imul(x >>> 0, 0x9e3779b1) >>> 0;
    z = (z ^ (z >>> 15)) >>> 0;
    z = Math.imul(z, 0x85ebca77) >>> 0;
    return (z ^ (z >>> 13)) >>> 0;
  };
  let acc = 0;
  for (let i = 0; i < bits.length; i++) acc = (acc + mix((bits[i] ^ mix((base + i) >>> 0)) >>> 0)) >>> 0;
  return acc;
}
