/**
 * Flat parameter-shaped arrays (parameters, gradients, AdamW moments) split over GPU buffers.
 *
 * A GPT-2 XL flat buffer is 6.2 GB in fp32, past the 2 GiB storage-binding limit and possibly past
 * the device's largest buffer. The layout is cut at tensor boundaries into segments no larger than
 * either limit; each segment is its own GPU buffer, a tensor lives in exactly one segment, and
 * kernels over the whole array (gradient norm, AdamW) run once per segment. Small models have one
 * segment, exactly the old single buffer.
 */

import { planSegments, type SegmentRange } from "../model/segments.ts";
import type { View } from "./ops.ts";
import { type GpuContext, readFloats } from "./device.ts";

export { planSegments, type SegmentRange };

/** One GPU buffer holding a segment. */
export interface Segment extends SegmentRange {
  buffer: GPUBuffer;
}

/** A flat array over one or more GPU buffers. */
export interface FlatBuffer {
  segments: Segment[];
  /** Elements of the whole layout. */
  totalSize: number;
  /** 4 for f32, 2 for f16. */
  bytesPerElement: number;
}

/** The segment holding elements [offset, offset + size), and the view of them. */
export function flatView(f: FlatBuffer, offset: number, size: number): View {
  const s = f.segments.find((s) => offset >= s.start && offset + size <= s.start + s.size);
  if (!s) throw new RangeError(`Range ${offset}+${size} of a flat buffer crosses a segment boundary`);
  const bpe = f.bytesPerElement;
  return { buffer: s.buffer, offset: (offset - s.start) * bpe, size: size * bpe };
}

/** Writes a whole flat array (length totalSize) into its segments. */
export function writeFlat(q: GPUQueue, f: FlatBuffer, data: Float32Array): void {
  if (data.length !== f.totalSize) {
    throw new RangeError(`Flat write of ${data.length} elements, the layout has ${f.totalSize}`);
  }
  for (const s of f.segments) {
    const part = data.subarray(s.start, s.start + s.size);
    q.writeBuffer(s.buffer, 0, part.buffer as ArrayBuffer, part.byteOffset, part.byteLength);
  }
}

/** Reads a whole flat f32 array back, one segment at a time. */
export async function readFlat(ctx: GpuContext, f: FlatBuffer): Promise<Float32Array> {
  const out = new Float32Array(f.totalSize);
  for (const s of f.segments) out.set(await readFloats(ctx, s.buffer, 0, s.size), s.start);
  return out;
}
