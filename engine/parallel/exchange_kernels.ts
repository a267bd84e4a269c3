/**
 * WGSL of the bucket exchange's GPU side (engine/parallel/exchange.ts). Every kernel walks the
 * bucket as 32-bit words (one fp32 value, or two 16-bit values) with a grid-stride loop, and
 * reads its sizes from one uniform:
 *   words  words of payload in the bucket
 *   shift  fp32 elements (or words) from the 256-byte aligned binding start to the bucket
 *   me     this rank's position; ranks: the group size
 * Bindings: 0 the bucket's buffer, 1 the peers' uploaded slots (rank order, own skipped),
 * 2 the uniform, 3 the packed 16-bit copy of an fp32 bucket.
 *
 *  - peerAddWgsl(dtype): own = Σ over ranks q in order of rank q's value, fp32 sums, in place.
 *  - peerAddCastWgsl(dtype): the same for an fp32 bucket sent as 16-bit: the sum of every rank's
 *    rounded values, own included (rounded again from the bucket, the same bits as its packed
 *    copy), lands in fp32 (no rounding of the sum).
 *  - packWgsl / unpackWgsl: fp32 bucket <-> its packed 16-bit copy (round to nearest even for
 *    bf16; f16 by pack2x16float).
 */

import type { CommDtype } from "./allreduce.ts";

/** Workgroup size of every exchange kernel. */
export const EXCHANGE_WG = 256;

const HEADER = `struct Params { words: u32, shift: u32, me: u32, ranks: u32 }
@group(0) @binding(2) var<uniform> p: Params;`;

/** dec(word) -> two values (the second 0 for fp32), enc(two values) -> word. */
function codec(dtype: CommDtype): string {
  switch (dtype) {
    case "f32":
      return `fn dec(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w), 0.0); }
fn enc(s: vec2<f32>) -> u32 { return bitcast<u32>(s.x); }`;
    case "f16":
      return `fn dec(w: u32) -> vec2<f32> { return unpack2x16float(w); }
fn enc(s: vec2<f32>) -> u32 { return pack2x16float(s); }`;
    case "bf16":
      return `fn dec(w: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u)); }
fn rne(x: f32) -> u32 { let b = bitcast<u32>(x); return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u; }
fn enc(s: vec2<f32>) -> u32 { return rne(s.x) | (rne(s.y) << 16u); }`;
  }
}

const LOOP = `@compute @workgroup_size(${EXCHANGE_WG})
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
  for (var i = gid.x; i < p.words; i += nw.x * ${EXCHANGE_WG}u) {`;

const PEER = `fn peer(q: u32, i: u32) -> u32 { return peers[select(q - 1u, q, q < p.me) * p.words + i]; }`;

/** In-place sum of a bucket in the communicator's dtype with the peers' uploaded slots. */
export function peerAddWgsl(dtype: CommDtype): string {
  return `${codec(dtype)}
${HEADER}
@group(0) @binding(0) var<storage, read_write> own: array<u32>;
@group(0) @binding(1) var<storage, read> peers: array<u32>;
${PEER}
${LOOP}
    var s = vec2<f32>(0.0);
    for (var q = 0u; q < p.ranks; q++) {
      if (q == p.me) { s += dec(own[p.shift + i]); } else { s += dec(peer(q, i)); }
    }
    own[p.shift + i] = enc(s);
  }
}`;
}

/**
 * Sum into an fp32 bucket of every rank's 16-bit values; its own are rounded from the bucket as
 * `packWgsl` rounds them, so the packed copy may already hold another bucket.
 */
export function peerAddCastWgsl(dtype: "f16" | "bf16"): string {
  return `${codec(dtype)}
${HEADER}
@group(0) @binding(0) var<storage, read_write> grad: array<f32>;
@group(0) @binding(1) var<storage, read> peers: array<u32>;
${PEER}
${LOOP}
    let mine = enc(vec2<f32>(grad[p.shift + 2u * i], grad[p.shift + 2u * i + 1u]));
    var s = vec2<f32>(0.0);
    for (var q = 0u; q < p.ranks; q++) {
      if (q == p.me) { s += dec(mine); } else { s += dec(peer(q, i)); }
    }
    grad[p.shift + 2u * i] = s.x;
    grad[p.shift + 2u * i + 1u] = s.y;
  }
}`;
}

/** fp32 bucket -> packed 16-bit copy. */
export function packWgsl(dtype: "f16" | "bf16"): string {
  return `${codec(dtype)}
${HEADER}
@group(0) @binding(0) var<storage, read> grad: array<f32>;
@group(0) @binding(3) var<storage, read_write> packed: array<u32>;
${LOOP}
    packed[i] = enc(vec2<f32>(grad[p.shift + 2u * i], grad[p.shift + 2u * i + 1u]));
  }
}`;
}

/** Packed 16-bit copy -> fp32 bucket. */
export function unpackWgsl(dtype: "f16" | "bf16"): string {
  return `${codec(dtype)}
${HEADER}
@group(0) @binding(0) var<storage, read_write> grad: array<f32>;
@group(0) @binding(3) var<storage, read> packed: array<u32>;
${LOOP}
    let v = dec(packed[i]);
    grad[p.shift + 2u * i] = v.x;
    grad[p.shift + 2u * i + 1u] = v.y;
  }
}`;
}
