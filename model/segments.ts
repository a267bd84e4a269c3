/**
 * Where a flat parameter-shaped array (parameters, gradients, AdamW moments) is cut into GPU
 * buffers: at tensor boundaries, each piece no larger than the device's binding limit. Pure
 * arithmetic, so the memory plan (plan.ts) and the estimate can count the buffers without a
 * device; engine/flat.ts allocates them.
 */

import { ConfigError, type ParamLayout } from "./config.ts";

/** A range [start, start + size) of the flat layout, in elements. */
export interface SegmentRange {
  start: number;
  size: number;
}

/**
 * Cuts the layout into segments of at most `maxBytes` (bytes per element `bpe`), at tensor
 * boundaries; every segment start is a tensor offset, so 256-byte binding alignment holds.
 */
export function planSegments(layout: ParamLayout, maxBytes: number, bpe = 4): SegmentRange[] {
  const maxElems = Math.floor(maxBytes / bpe);
  const tensors = [...layout.tensors].sort((a, b) => a.offset - b.offset);
  const out: SegmentRange[] = [];
  let start = 0;
  for (let i = 0; i < tensors.length; i++) {
    const t = tensors[i];
    const end = i + 1 < tensors.length ? tensors[i + 1].offset : layout.totalSize;
    if (end - t.offset > maxElems) {
      throw new ConfigError(
        "model",
        `tensor "${t.name}" of ${
          t.size * bpe
        } bytes exceeds the device's buffer binding limit of ${maxBytes} bytes`,
      );
    }
    if (end - start > maxElems) {
      out.push({ start, size: t.offset - start });
      start = t.offset;
    }
  }
  out.push({ start, size: layout.totalSize - start });
  return out;
}
