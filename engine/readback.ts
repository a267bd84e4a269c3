/**
 * Small readbacks off the 10 ms floor (issue 26). Deno 2.9.6 resolves `mapAsync` (and
 * `onSubmittedWorkDone`) from a poll loop that sleeps 10 ms between polls, so every read through a
 * staging buffer costs about 10 ms however small it is. An OffscreenCanvas "webgpu" context reads
 * its texture back with a blocking wait instead: copy the buffer range into the canvas texture
 * (64·k texels a row, rgba8unorm, one byte per channel), call `convertToBlob({ type: "image/bmp" })`
 * and undo the BMP layout (pixel-data offset from the header, bottom-up rows unless the height is
 * negative, channel order from the header's bit masks: BGRA).
 *
 * On an H200 (bench/readback_probe.ts, medians of 31 reads, each after a small write, three runs):
 * 4 B and 4 KB 0.14–0.26 ms, 64 KB 0.5–0.8, 256 KB 1.1–1.8, 1 MB 5.3–6.3, against 11.4–12.2 ms for
 * mapAsync. The canvas path's cost grows with the bytes (at 1 MB: 2.4 ms in convertToBlob, which
 * waits, copies and encodes; 0.3 reading the Blob; 1.7 undoing the layout here), so it about breaks
 * even at 2 MB (10.5–11.9 against 12.6–13.1 ms, with wider spread) and loses beyond (4 MB 19–27
 * against 14–15, 16 MB 85–106 against 24–27): hence {@link CANVAS_MAX_BYTES}. A size's first read
 * also makes its canvas, up to about 1 ms more; {@link Readback.prepare} does that ahead.
 *
 * Runtime facts this relies on (Deno 2.9.6, ext/canvas and ext/webgpu canvas.rs): `convertToBlob`
 * is synchronous up to the Blob; it submits a texture-to-buffer copy after the work already queued
 * and waits for it with a blocking device poll, so the JavaScript thread stalls until the GPU has
 * reached the copy (meant for a latency path, or a Worker that owns the GPU). The canvas keeps the
 * texture bytes as they are (alphaMode only matters for window surfaces), so the alpha byte
 * survives: no 3-bytes-a-texel packing is needed. The first use checks all of this with a round
 * trip of a known pattern (random bytes in every channel, alpha 0 under non-zero colour included);
 * if anything throws or a byte differs, the canvas path is off for good and `fallbackReason` says
 * why. Growing a canvas by its width/height setters does not grow the texture in 2.9.6, so each
 * texture geometry gets its own canvas (a few are kept). Deno unwraps the result of that poll, so a
 * device lost during the wait may abort the process rather than raise: reads check the device first.
 * Seen exact on NVIDIA's Vulkan driver (H200) and on lavapipe (llvmpipe), where it also beats mapAsync.
 *
 * Meant for the reads a step or a user waits on: the first token after prefill, batch-1 decode
 * chunks, and the per-step flags a training or parallel step waits on. Large reads go through
 * `mapAsync` (engine/device.ts readBuffers) either way.
 *
 * Nothing here reads the environment: the caller turns the canvas path off with `{ canvas: false }`,
 * e.g. `createReadback(ctx, { canvas: parseFastReadback(Deno.env.get("GPT2_FAST_READBACK")) })`.
 */

import { checkDevice, type GpuContext, readBuffers, type ReadRange, stagingFor } from "./device.ts";

/** Largest read served by the canvas path by default: on an H200 it is twice as fast at 1 MB, even at 2 MB. */
export const CANVAS_MAX_BYTES = 1 << 20;

/** Which way a read went. */
export type ReadbackPath = "canvas" | "mapAsync";

/** What the canvas path needs of an OffscreenCanvas (tests substitute failing ones). */
export interface ReadbackCanvas {
  getContext(contextId: "webgpu"): GPUCanvasContext | null;
  convertToBlob(options: { type: string }): Promise<Blob>;
}

/** Options of {@link createReadback}. */
export interface ReadbackOptions {
  /** Use the canvas path where it works (default true); false reads everything through mapAsync. */
  canvas?: boolean;
  /** Largest read sent through the canvas path (default {@link CANVAS_MAX_BYTES}). */
  maxCanvasBytes?: number;
  /** Makes a canvas of `width` × `height` texels (default `new OffscreenCanvas`). */
  createCanvas?: (width: number, height: number) => ReadbackCanvas;
}

/**
 * Parses GPT2_FAST_READBACK for the caller: unset, "", "1", "true", "on" or "yes" → true (canvas
 * path on); "0", "false", "off" or "no" → false. Anything else is an error naming the value.
 */
export function parseFastReadback(value: string | undefined): boolean {
  const v = (value ?? "").trim().toLowerCase();
  if (["", "1", "true", "on", "yes"].includes(v)) return true;
  if (["0", "false", "off", "no"].includes(v)) return false;
  throw new Error(`Invalid GPT2_FAST_READBACK "${value}": expected 0 or 1`);
}

/** Opens a reader for `ctx` and, unless turned off, checks the canvas path once with a known pattern. */
export async function createReadback(ctx: GpuContext, opts: ReadbackOptions = {}): Promise<Readback> {
  const rb = new Readback(ctx, opts);
  await rb.detect();
  return rb;
}

interface Slot {
  canvas: ReadbackCanvas;
  context: GPUCanvasContext;
}

const KEEP_CANVASES = 8;

/** Reads buffer ranges back, through the canvas path where it serves and mapAsync otherwise. */
export class Readback {
  readonly ctx: GpuContext;
  /** Reads taken by each path so far. */
  readonly counts: Record<ReadbackPath, number> = { canvas: 0, mapAsync: 0 };
  /** The path of the latest read, null before the first. */
  lastPath: ReadbackPath | null = null;
  #canvas: boolean;
  #reason: string | null;
  #maxCanvasBytes: number;
  #create: (width: number, height: number) => ReadbackCanvas;
  #slots = new Map<string, Slot>();
  #detection: Promise<void> | null = null;

  constructor(ctx: GpuContext, opts: ReadbackOptions = {}) {
    this.ctx = ctx;
    this.#canvas = opts.canvas ?? true;
    this.#reason = this.#canvas ? null : "turned off by the caller";
    this.#maxCanvasBytes = opts.maxCanvasBytes ?? CANVAS_MAX_BYTES;
    this.#create = opts.createCanvas ?? ((w, h) => new OffscreenCanvas(w, h));
  }

  /** Whether the canvas path is on (it was not turned off and its round trip was exact). */
  get canvas(): boolean {
    return this.#canvas;
  }

  /** Why the canvas path is off, or null while it is on. */
  get fallbackReason(): string | null {
    return this.#reason;
  }

  /** The path a read of `bytes` bytes takes now. */
  pathFor(bytes: number): ReadbackPath {
    return this.#canvas && bytes > 0 && bytes <= this.#maxCanvasBytes && this.#geometry(bytes) !== null
      ? "canvas"
      : "mapAsync";
  }

  /** Checks the canvas path once (createReadback calls it, else the first read); later calls wait for that check. */
  detect(): Promise<void> {
    return this.#detection ??= this.#canvas ? this.#roundTrip() : Promise.resolve();
  }

  async #roundTrip(): Promise<void> {
    const bytes = 3 * 256 + 20; // several rows and a partial one
    const want = new Uint8Array(bytes);
    let s = 0x9e3779b9;
    for (let i = 0; i < bytes; i++) {
      s ^= s << 13;
      s ^= s >>> 17;
      s ^= s << 5;
      want[i] = s & 255;
    }
    want.set([255, 255, 255, 0, 0, 0, 0, 0, 1, 2, 3, 0, 255, 0, 128, 1, 0, 0, 0, 255]);
    const buf = this.ctx.device.createBuffer({
      label: "readback probe",
      size: bytes,
      usage: GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    });
    this.ctx.device.queue.writeBuffer(buf, 0, want);
    // A scope, so that a canvas the runtime rejects turns the path off instead of poisoning ctx. Its
    // GPU calls all run before #readCanvas first awaits, so the scope closes before anything else runs.
    this.ctx.device.pushErrorScope("validation");
    const pending = this.#readCanvas(buf, 0, bytes);
    const scope = this.ctx.device.popErrorScope();
    let got: Uint8Array | null = null, failure = "";
    try {
      got = new Uint8Array(await pending);
    } catch (e) {
      failure = e instanceof Error ? e.message : String(e);
    }
    const err = await scope;
    buf.destroy();
    checkDevice(this.ctx);
    const bad = got ? want.findIndex((b, i) => got[i] !== b) : -1;
    if (err || !got) this.#off(`canvas path failed: ${err ? err.message : failure}`);
    else if (got.length !== bytes || bad >= 0) {
      this.#off(`round trip of a known pattern differs at byte ${bad < 0 ? got.length : bad} of ${bytes}`);
    }
  }

  /**
   * Reads `bytes` bytes of `buffer` from `offset` (both multiples of 4; the buffer needs COPY_SRC,
   * as createStorage's buffers have) after all work submitted so far. Returns exactly those bytes.
   */
  async read(buffer: GPUBuffer, offset = 0, bytes = buffer.size - offset): Promise<ArrayBuffer> {
    const what = `Cannot read back ${bytes} bytes at offset ${offset} of buffer "${buffer.label}"`;
    if (offset % 4 || bytes % 4 || offset < 0 || bytes < 0) {
      throw new RangeError(`${what}: offset and size must be non-negative multiples of 4`);
    }
    if (offset + bytes > buffer.size) throw new RangeError(`${what}: the buffer has ${buffer.size} bytes`);
    if (!(buffer.usage & GPUBufferUsage.COPY_SRC)) throw new TypeError(`${what}: it lacks COPY_SRC usage`);
    checkDevice(this.ctx);
    if (bytes === 0) return new ArrayBuffer(0);
    await this.detect();
    if (this.pathFor(bytes) === "canvas") {
      try {
        const out = await this.#readCanvas(buffer, offset, bytes);
        checkDevice(this.ctx);
        this.#count("canvas");
        return out;
      } catch (e) {
        checkDevice(this.ctx);
        this.#off(`canvas read of ${bytes} bytes failed: ${e instanceof Error ? e.message : String(e)}`);
      }
    }
    const [out] = await readBuffers(this.ctx, [{ buffer, offset, bytes }]);
    this.#count("mapAsync");
    return out;
  }

  /**
   * Reads several buffer ranges after all work submitted so far, copied into one staging buffer
   * and read at once: through the canvas path when their total serves, else through one mapAsync
   * (engine/device.ts readBuffers). `before`, when given, records work into the same submission,
   * ahead of the copies. Returns one ArrayBuffer per range, exactly its bytes.
   */
  async readRanges(ranges: ReadRange[], before?: (enc: GPUCommandEncoder) => void): Promise<ArrayBuffer[]> {
    checkDevice(this.ctx);
    await this.detect();
    const total = ranges.reduce((a, r) => a + (r.bytes ?? r.buffer.size - (r.offset ?? 0)), 0);
    const canvas = this.pathFor(total) === "canvas";
    if (!canvas && !before) return this.#mapped(ranges);
    if (!canvas) {
      const enc = this.ctx.device.createCommandEncoder();
      before!(enc);
      this.ctx.device.queue.submit([enc.finish()]);
      return this.#mapped(ranges);
    }
    const staged = stagingFor(this.ctx, ranges, GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST);
    try {
      const enc = this.ctx.device.createCommandEncoder();
      before?.(enc);
      staged.copy(enc);
      this.ctx.device.queue.submit([enc.finish()]);
      const all = await this.read(staged.buffer);
      return staged.offsets.map((o, i) => all.slice(o, o + staged.bytes[i]));
    } finally {
      staged.buffer.destroy();
    }
  }

  async #mapped(ranges: ReadRange[]): Promise<ArrayBuffer[]> {
    const out = await readBuffers(this.ctx, ranges);
    this.#count("mapAsync");
    return out;
  }

  /**
   * Makes the canvas that reads of `bytes` bytes use, so that the first such read does not pay for
   * it (e.g. from a generator's warm-up). Does nothing where such reads go through mapAsync.
   */
  prepare(bytes: number): void {
    if (this.pathFor(bytes) !== "canvas") return;
    const { width, height } = this.#geometry(bytes)!;
    try {
      this.#slot(width, height);
    } catch (e) {
      this.#off(`canvas for ${bytes} bytes failed: ${e instanceof Error ? e.message : String(e)}`);
    }
  }

  /** Frees the canvases' textures; later reads make new ones. */
  destroy(): void {
    for (const slot of this.#slots.values()) slot.context.getCurrentTexture().destroy();
    this.#slots.clear();
  }

  #count(path: ReadbackPath): void {
    this.counts[path]++;
    this.lastPath = path;
  }

  #off(reason: string): void {
    this.#canvas = false;
    this.#reason = reason;
    this.destroy();
  }

  /** Texture width (a multiple of 64 texels, so rows are 256-byte aligned) and height for `bytes`. */
  #geometry(bytes: number): { width: number; height: number } | null {
    const maxDim = this.ctx.device.limits.maxTextureDimension2D;
    const width = 64 * Math.ceil(Math.ceil(bytes / 256) / maxDim);
    if (width > maxDim) return null;
    return { width, height: Math.ceil(bytes / (width * 4)) };
  }

  #slot(width: number, height: number): Slot {
    const key = `${width}x${height}`;
    let slot = this.#slots.get(key);
    if (slot) {
      this.#slots.delete(key); // re-inserted below: most recently used last
    } else {
      const canvas = this.#create(width, height);
      const context = canvas.getContext("webgpu");
      if (!context) throw new Error(`OffscreenCanvas.getContext("webgpu") returned null`);
      context.configure({
        device: this.ctx.device,
        format: "rgba8unorm",
        usage: GPUTextureUsage.COPY_DST,
        alphaMode: "premultiplied",
      });
      const texture = context.getCurrentTexture();
      if (texture.width !== width || texture.height !== height) {
        throw new Error(`canvas texture is ${texture.width}×${texture.height}, asked for ${width}×${height}`);
      }
      slot = { canvas, context };
      if (this.#slots.size >= KEEP_CANVASES) {
        const [oldKey, old] = this.#slots.entries().next().value!;
        old.context.getCurrentTexture().destroy();
        this.#slots.delete(oldKey);
      }
    }
    this.#slots.set(key, slot);
    return slot;
  }

  async #readCanvas(buffer: GPUBuffer, offset: number, bytes: number): Promise<ArrayBuffer> {
    const geo = this.#geometry(bytes);
    if (!geo) throw new Error(`${bytes} bytes exceed the largest canvas texture`);
    const { width, height } = geo;
    const slot = this.#slot(width, height);
    const texture = slot.context.getCurrentTexture(); // the same texture each time, unless the runtime replaced it
    const rowBytes = width * 4, full = Math.floor(bytes / rowBytes), rest = bytes - full * rowBytes;
    const enc = this.ctx.device.createCommandEncoder({ label: "readback to canvas" });
    if (full > 0) {
      enc.copyBufferToTexture({ buffer, offset, bytesPerRow: rowBytes }, { texture }, [
        width,
        full,
      ]);
    }
    if (rest > 0) {
      enc.copyBufferToTexture(
        { buffer, offset: offset + full * rowBytes, bytesPerRow: rowBytes },
        { texture, origin: [0, full] },
        [rest / 4, 1],
      );
    }
    this.ctx.device.queue.submit([enc.finish()]);
    // No await between the submit and convertToBlob: the canvas is snapshotted before another read can copy.
    const blob = await slot.canvas.convertToBlob({ type: "image/bmp" });
    return decodeBmp(new Uint8Array(await blob.arrayBuffer()), width, height, bytes);
  }
}

/**
 * The first `bytes` bytes of a `width` × `height` rgba8 image, in texture order (rows top to
 * bottom, R G B A), from a 32-bit BMP file.
 */
export function decodeBmp(file: Uint8Array, width: number, height: number, bytes: number): ArrayBuffer {
  const dv = new DataView(file.buffer, file.byteOffset, file.byteLength);
  if (file.length < 54 || dv.getUint16(0) !== 0x424d) throw new Error("canvas blob is not a BMP file");
  const dataAt = dv.getUint32(10, true), w = dv.getInt32(18, true), h = dv.getInt32(22, true);
  const bpp = dv.getUint16(28, true), compression = dv.getUint32(30, true);
  if (bpp !== 32 || w !== width || Math.abs(h) !== height) {
    throw new Error(`BMP is ${w}×${h} at ${bpp} bits, expected ${width}×${height} at 32`);
  }
  // Byte position (within a little-endian pixel) of R, G, B and A.
  let pos = [2, 1, 0, 3]; // BI_RGB: B G R X
  if (compression === 3 || compression === 6) {
    // Masks R, G, B (and A in a V3+ header or BI_ALPHABITFIELDS) follow the 40-byte header part.
    const masks = dv.getUint32(14, true) >= 56 || compression === 6 ? 4 : 3;
    pos = [54, 58, 62, 66].slice(0, masks)
      .map((at) => [0xff, 0xff00, 0xff0000, 0xff000000].indexOf(dv.getUint32(at, true)));
    if (masks === 3) pos.push([0, 1, 2, 3].find((p) => !pos.includes(p)) ?? -1);
  } else if (compression !== 0) {
    throw new Error(`BMP compression ${compression} is not supported`);
  }
  if ([...pos].sort().join() !== "0,1,2,3") throw new Error(`BMP channel masks are not whole bytes: ${pos}`);
  if (dataAt + width * height * 4 > file.length) throw new Error("BMP pixel data is truncated");
  if (bytes % 4 || bytes > width * height * 4) {
    throw new RangeError(
      `Cannot take ${bytes} bytes from a ${width}×${height} image: a multiple of 4 that fits`,
    );
  }
  // Rows into texture order by memcpy, then the channels in place (one flat loop, which V8 optimises well).
  const out = new Uint8Array(bytes), rowBytes = width * 4;
  for (let y = 0; y * rowBytes < bytes; y++) {
    const at = dataAt + (h > 0 ? height - 1 - y : y) * rowBytes;
    out.set(file.subarray(at, at + Math.min(rowBytes, bytes - y * rowBytes)), y * rowBytes);
  }
  if (pos.join() !== "0,1,2,3") {
    const [r, g, b, a] = pos.map((p) => 8 * p);
    const texels = new Uint32Array(out.buffer);
    for (let i = 0; i < texels.length; i++) {
      const p = texels[i];
      texels[i] = ((p >>> r) & 255) | (((p >>> g) & 255) << 8) | (((p >>> b) & 255) << 16) |
        (((p >>> a) & 255) << 24);
    }
  }
  return out.buffer;
}
