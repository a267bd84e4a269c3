/**
 * engine/readback.ts: every size the canvas path serves comes back byte-exact (random bytes in every
 * channel, alpha included), larger reads and `canvas: false` go through mapAsync, and the fallback
 * is taken, and exact, when the canvas cannot be made, when its round trip is not exact, and when a
 * later canvas read fails. Each test asserts the path it took, so a canvas path that silently never
 * runs fails here wherever the runtime has OffscreenCanvas.
 */

import assert from "node:assert/strict";
import { createStorage, type GpuContext } from "../../engine/device.ts";
import {
  CANVAS_MAX_BYTES,
  createReadback,
  decodeBmp,
  parseFastReadback,
  type ReadbackCanvas,
  type ReadbackOptions,
} from "../../engine/readback.ts";
import { noGpu, testContext } from "../_helpers.ts";

/** Whether this runtime offers OffscreenCanvas; where it does, the canvas path must be taken. */
const hasCanvas = typeof OffscreenCanvas === "function";

/** The sizes the canvas path serves, and one just past them. */
const SIZES = [4, 12, 256, 4096, 4100, 65536, CANVAS_MAX_BYTES];
const PAST = CANVAS_MAX_BYTES + 4;

function randomBytes(n: number, seed: number): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(n);
  let s = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    out[i] = s >>> 24;
  }
  return out;
}

/** A storage buffer holding `pad` bytes of other data, then `data`, then `pad` more. */
async function bufferWith(ctx: GpuContext, data: Uint8Array, pad = 0): Promise<GPUBuffer> {
  const buf = await createStorage(ctx, `readback ${data.length}`, data.length + 2 * pad);
  const all = randomBytes(data.length + 2 * pad, data.length + 7);
  all.set(data, pad);
  ctx.device.queue.writeBuffer(buf, 0, all);
  return buf;
}

function assertBytes(got: ArrayBuffer, want: Uint8Array, what: string): void {
  const g = new Uint8Array(got);
  assert.equal(g.length, want.length, `${what}: length`);
  const bad = want.findIndex((b, i) => g[i] !== b);
  assert.equal(bad, -1, `${what}: first wrong byte at ${bad} (got ${g[bad]}, want ${want[bad]})`);
}

/** Reads each size (at offset 0 and at offset 260) and checks bytes and the path taken. */
async function checkSizes(ctx: GpuContext, opts: ReadbackOptions, sizes: number[], canvasUpTo: number) {
  const rb = await createReadback(ctx, opts);
  for (const [k, bytes] of sizes.entries()) {
    const want = randomBytes(bytes, 1000 + k);
    for (const pad of [0, 260]) {
      const buf = await bufferWith(ctx, want, pad);
      const got = await rb.read(buf, pad, bytes);
      const path = bytes <= canvasUpTo ? "canvas" : "mapAsync";
      assert.equal(rb.lastPath, path, `${bytes} bytes at ${pad}: path (${rb.fallbackReason})`);
      assertBytes(got, want, `${bytes} bytes at offset ${pad} through ${path}`);
      buf.destroy();
    }
  }
  rb.destroy();
  return rb;
}

Deno.test("parseFastReadback() reads GPT2_FAST_READBACK and rejects other values", () => {
  for (const v of [undefined, "", "1", "true", "on", "yes", " YES "]) {
    assert.equal(parseFastReadback(v), true);
  }
  for (const v of ["0", "false", "off", "no"]) assert.equal(parseFastReadback(v), false);
  assert.throws(() => parseFastReadback("2"), /Invalid GPT2_FAST_READBACK "2": expected 0 or 1/);
});

Deno.test("decodeBmp() undoes bottom-up and top-down rows, bit-field and BI_RGB channel orders", () => {
  const width = 2, height = 2, rgba = randomBytes(16, 5);
  // A BMP with a 40-byte header, optionally three BI_BITFIELDS masks (R, G, B) after it.
  const bmp = (topDown: boolean, masks: number[] | null, order: number[]) => {
    const at = 54 + (masks ? 12 : 0);
    const file = new Uint8Array(at + 16);
    const dv = new DataView(file.buffer);
    dv.setUint16(0, 0x424d);
    dv.setUint32(10, at, true);
    dv.setUint32(14, 40, true);
    dv.setInt32(18, width, true);
    dv.setInt32(22, topDown ? -height : height, true);
    dv.setUint16(28, 32, true);
    dv.setUint32(30, masks ? 3 : 0, true);
    masks?.forEach((m, i) => dv.setUint32(54 + 4 * i, m, true));
    for (let t = 0; t < 4; t++) {
      const row = Math.floor(t / width), fileRow = topDown ? row : height - 1 - row;
      for (let c = 0; c < 4; c++) file[at + (fileRow * width + (t % width)) * 4 + order[c]] = rgba[t * 4 + c];
    }
    return file;
  };
  assertBytes(decodeBmp(bmp(false, null, [2, 1, 0, 3]), width, height, 16), rgba, "bottom-up BI_RGB");
  assertBytes(decodeBmp(bmp(true, null, [2, 1, 0, 3]), width, height, 16), rgba, "top-down BI_RGB");
  const rgbaMasks = [0xff, 0xff00, 0xff0000];
  assertBytes(
    decodeBmp(bmp(true, rgbaMasks, [0, 1, 2, 3]), width, height, 16),
    rgba,
    "RGB masks, A left over",
  );
  assertBytes(
    decodeBmp(bmp(false, null, [2, 1, 0, 3]), width, height, 12),
    rgba.slice(0, 12),
    "a partial image",
  );
  assert.throws(() => decodeBmp(bmp(false, null, [2, 1, 0, 3]), 4, 1, 16), /BMP is 2×2 at 32 bits/);
  assert.throws(() => decodeBmp(bmp(false, [0xff, 0xf0f0, 0xff0000], [0, 1, 2, 3]), 2, 2, 16), /whole bytes/);
});

Deno.test({
  name: "createReadback() takes the canvas path wherever the runtime has OffscreenCanvas",
  ignore: noGpu,
  fn: async () => {
    const rb = await createReadback((await testContext())!);
    assert.equal(rb.canvas, hasCanvas, `canvas path: ${rb.fallbackReason}`);
    assert.equal(rb.pathFor(4096), hasCanvas ? "canvas" : "mapAsync");
    assert.equal(rb.pathFor(PAST), "mapAsync");
    rb.destroy();
  },
});

Deno.test({
  name: "Readback.read() is byte-exact through the canvas path up to CANVAS_MAX_BYTES and mapAsync past it",
  ignore: noGpu,
  fn: async () => {
    const rb = await checkSizes(
      (await testContext())!,
      {},
      [...SIZES, PAST],
      hasCanvas ? CANVAS_MAX_BYTES : 0,
    );
    assert.equal(rb.counts.canvas, hasCanvas ? 2 * SIZES.length : 0);
    assert.equal(rb.counts.mapAsync, hasCanvas ? 2 : 2 * SIZES.length + 2);
  },
});

Deno.test({
  name: "Readback.read() widens the canvas texture for a read taller than maxTextureDimension2D rows",
  ignore: noGpu || !hasCanvas,
  fn: async () => {
    const ctx = (await testContext())!;
    const bytes = ctx.device.limits.maxTextureDimension2D * 256 + 260; // two texture rows a 256-byte row
    await checkSizes(ctx, { maxCanvasBytes: Infinity }, [bytes], Infinity);
  },
});

Deno.test({
  name: "Readback.read() with { canvas: false } reads every size exactly through mapAsync",
  ignore: noGpu,
  fn: async () => {
    const rb = await checkSizes((await testContext())!, { canvas: false }, SIZES, 0);
    assert.equal(rb.canvas, false);
    assert.equal(rb.fallbackReason, "turned off by the caller");
    assert.equal(rb.counts.canvas, 0);
  },
});

Deno.test({
  name: "Readback falls back to mapAsync for good when no canvas can be made",
  ignore: noGpu,
  fn: async () => {
    const createCanvas = (): ReadbackCanvas => {
      throw new ReferenceError("OffscreenCanvas is not defined");
    };
    const rb = await checkSizes((await testContext())!, { createCanvas }, SIZES, 0);
    assert.equal(rb.canvas, false);
    assert.match(rb.fallbackReason!, /canvas path failed: OffscreenCanvas is not defined/);
    assert.equal(rb.counts.canvas, 0);
  },
});

/** An OffscreenCanvas whose BMP comes back with one pixel byte flipped. */
class CorruptingCanvas implements ReadbackCanvas {
  #inner: OffscreenCanvas;
  constructor(width: number, height: number) {
    this.#inner = new OffscreenCanvas(width, height);
  }
  getContext(id: "webgpu"): GPUCanvasContext | null {
    return this.#inner.getContext(id);
  }
  async convertToBlob(options: { type: string }): Promise<Blob> {
    const bytes = new Uint8Array(await (await this.#inner.convertToBlob(options)).arrayBuffer());
    bytes[bytes.length - 1] ^= 1;
    return new Blob([bytes], { type: options.type });
  }
}

Deno.test({
  name: "Readback falls back to mapAsync when the canvas round trip is not exact",
  ignore: noGpu || !hasCanvas,
  fn: async () => {
    const createCanvas = (w: number, h: number) => new CorruptingCanvas(w, h);
    const rb = await checkSizes((await testContext())!, { createCanvas }, [4096], 0);
    assert.match(rb.fallbackReason!, /round trip of a known pattern differs at byte \d+ of 788/);
  },
});

Deno.test({
  name: "Readback falls back for good, still exact, when a canvas read fails after detection",
  ignore: noGpu || !hasCanvas,
  fn: async () => {
    const ctx = (await testContext())!;
    let made = 0;
    const createCanvas = (w: number, h: number): ReadbackCanvas => {
      if (made++ > 0) throw new Error("no more canvases");
      return new OffscreenCanvas(w, h);
    };
    const rb = await createReadback(ctx, { createCanvas });
    assert.equal(rb.canvas, true, `${rb.fallbackReason}`);
    const want = randomBytes(4096, 3);
    const buf = await bufferWith(ctx, want);
    assertBytes(await rb.read(buf), want, "after a failed canvas read");
    assert.equal(rb.lastPath, "mapAsync");
    assert.match(rb.fallbackReason!, /canvas read of 4096 bytes failed: no more canvases/);
    assert.equal(rb.pathFor(4), "mapAsync");
    buf.destroy();
  },
});

Deno.test({
  name: "Readback.read() keeps concurrent reads of one prepared size apart",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const rb = await createReadback(ctx);
    rb.prepare(4096);
    assert.equal(rb.canvas, hasCanvas, `prepare(): ${rb.fallbackReason}`);
    const wants = [0, 1, 2, 3].map((k) => randomBytes(4096, 50 + k));
    const bufs = await Promise.all(wants.map((w) => bufferWith(ctx, w)));
    const got = await Promise.all(bufs.map((b) => rb.read(b)));
    got.forEach((g, k) => assertBytes(g, wants[k], `read ${k}`));
    assert.equal(rb.counts.canvas, hasCanvas ? 4 : 0);
    bufs.forEach((b) => b.destroy());
    rb.destroy();
  },
});

Deno.test({
  name: "Readback.read() rejects unaligned ranges, ranges past the end and buffers without COPY_SRC",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    const rb = await createReadback(ctx);
    const buf = await createStorage(ctx, "small", 64);
    await assert.rejects(() => rb.read(buf, 2, 8), /Cannot read back 8 bytes at offset 2 of buffer "small"/);
    await assert.rejects(() => rb.read(buf, 0, 6), /multiples of 4/);
    await assert.rejects(() => rb.read(buf, 32, 64), /the buffer has 64 bytes/);
    const noSrc = ctx.device.createBuffer({ label: "no src", size: 64, usage: GPUBufferUsage.STORAGE });
    await assert.rejects(() => rb.read(noSrc), /lacks COPY_SRC/);
    assert.equal((await rb.read(buf, 16, 0)).byteLength, 0);
    assert.equal(rb.canvas, hasCanvas, "a caller's mistake does not turn the canvas path off");
    buf.destroy();
    noSrc.destroy();
    rb.destroy();
  },
});

Deno.test({
  name:
    "Readback.readRanges() returns each range exactly, after work recorded before the copies, through the canvas path and through mapAsync",
  ignore: noGpu,
  fn: async () => {
    const ctx = (await testContext())!;
    for (const canvas of [true, false]) {
      const rb = await createReadback(ctx, { canvas });
      // Ranges of several sizes, at offsets, from two buffers; the last one is written by `before`.
      const a = randomBytes(4096 + 520, 11), b = randomBytes(300, 12), late = randomBytes(64, 13);
      const bufA = await bufferWith(ctx, a), bufB = await bufferWith(ctx, b);
      const src = await bufferWith(ctx, late), dst = await bufferWith(ctx, new Uint8Array(64));
      const ranges = [
        { buffer: bufA, offset: 260, bytes: 4096 },
        { buffer: bufB, offset: 0, bytes: 300 },
        { buffer: bufA, offset: 0, bytes: 4 },
        { buffer: dst, offset: 0, bytes: 64 },
      ];
      const got = await rb.readRanges(ranges, (enc) => enc.copyBufferToBuffer(src, 0, dst, 0, 64));
      const path = canvas && hasCanvas ? "canvas" : "mapAsync";
      assert.equal(rb.lastPath, path, `path (${rb.fallbackReason})`);
      assertBytes(got[0], a.subarray(260, 260 + 4096), `range 0 through ${path}`);
      assertBytes(got[1], b, `range 1 through ${path}`);
      assertBytes(got[2], a.subarray(0, 4), `range 2 through ${path}`);
      assertBytes(got[3], late, `range 3, written by the work recorded before, through ${path}`);
      // Past the canvas path's limit: mapAsync, still exact.
      const big = randomBytes(PAST, 14), bufBig = await bufferWith(ctx, big);
      const [g] = await rb.readRanges([{ buffer: bufBig, bytes: PAST }]);
      assert.equal(rb.lastPath, "mapAsync");
      assertBytes(g, big, "a read past CANVAS_MAX_BYTES");
      for (const x of [bufA, bufB, src, dst, bufBig]) x.destroy();
      rb.destroy();
    }
  },
});
