/**
 * A minimal safetensors reader and writer (float32 only): an 8-byte little-endian header length,
 * a JSON header naming each tensor's dtype, shape and byte range, then the raw data. The header
 * is padded with spaces to a multiple of 8 so every tensor can be viewed in place as a
 * Float32Array. Files are streamed tensor by tensor to keep peak memory near one model copy.
 */

import { createHash } from "node:crypto";

/** One float32 tensor. `data.length` must equal the product of `shape`. */
export interface NamedTensor {
  name: string;
  shape: number[];
  data: Float32Array;
}

interface HeaderEntry {
  dtype: string;
  shape: number[];
  data_offsets: [number, number];
}

/** Builds the padded header bytes for `tensors` in the given order. */
function encodeHeader(tensors: NamedTensor[], metadata: Record<string, string>): Uint8Array {
  const header: Record<string, unknown> = { __metadata__: metadata };
  let offset = 0;
  for (const t of tensors) {
    const n = t.shape.reduce((a, b) => a * b, 1);
    if (n !== t.data.length) {
      throw new Error(
        `Cannot write tensor "${t.name}": shape [${t.shape}] holds ${n} values, data has ${t.data.length}`,
      );
    }
    header[t.name] = { dtype: "F32", shape: t.shape, data_offsets: [offset, offset + n * 4] };
    offset += n * 4;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(json.length / 8) * 8;
  const out = new Uint8Array(8 + padded).fill(0x20);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.set(json, 8);
  return out;
}

function tensorBytes(t: NamedTensor): Uint8Array {
  return new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength);
}

/** Encodes tensors as one safetensors byte array (for small files and tests). */
export function encodeSafetensors(tensors: NamedTensor[], metadata: Record<string, string> = {}): Uint8Array {
  const header = encodeHeader(tensors, metadata);
  const total = header.length + tensors.reduce((a, t) => a + t.data.byteLength, 0);
  const out = new Uint8Array(total);
  out.set(header, 0);
  let at = header.length;
  for (const t of tensors) {
    out.set(tensorBytes(t), at);
    at += t.data.byteLength;
  }
  return out;
}

/** A file open for writing: the part of Deno.FsFile that checkpoint writers use. */
export interface WritableFile extends Disposable {
  write(bytes: Uint8Array): Promise<number>;
  sync(): Promise<void>;
}

/**
 * Opens a file for writing, created or truncated. Deno.open by default; a test passes one whose
 * files fail part-way (a full disk: see SaveOptions.openFile in checkpoint.ts).
 */
export type OpenForWrite = (path: string) => Promise<WritableFile>;

/** The default OpenForWrite: Deno.open. */
export const openForWrite: OpenForWrite = (path) =>
  Deno.open(path, { write: true, create: true, truncate: true });

/** A written file's size and SHA-256 (hex), as a checkpoint manifest records them. */
export interface FileDigest {
  bytes: number;
  sha256: string;
}

/** SHA-256 of `bytes` in hex (node:crypto: several times faster than crypto.subtle here, and incremental). */
export function sha256Hex(bytes: Uint8Array): string {
  return createHash("sha256").update(bytes).digest("hex");
}

/**
 * Writes `chunks` to `path` in order and fsyncs it; returns its size and SHA-256, each chunk
 * hashed while its write is in flight.
 */
export async function writeChunks(
  path: string,
  chunks: Iterable<Uint8Array>,
  open: OpenForWrite = openForWrite,
): Promise<FileDigest> {
  using file = await open(path);
  const hash = createHash("sha256");
  let total = 0;
  for (const bytes of chunks) {
    const written = (async () => {
      let done = 0;
      while (done < bytes.length) done += await file.write(bytes.subarray(done));
    })();
    hash.update(bytes);
    await written;
    total += bytes.length;
  }
  await file.sync();
  return { bytes: total, sha256: hash.digest("hex") };
}

/** Writes tensors to `path`, streaming each tensor's bytes; returns the file's size and SHA-256. */
export async function writeSafetensors(
  path: string,
  tensors: NamedTensor[],
  metadata: Record<string, string> = {},
  open: OpenForWrite = openForWrite,
): Promise<FileDigest> {
  return await writeChunks(path, [encodeHeader(tensors, metadata), ...tensors.map(tensorBytes)], open);
}

/** Decoded safetensors contents: tensors by name (views into one buffer) and the metadata. */
export interface SafetensorsFile {
  tensors: Map<string, { shape: number[]; data: Float32Array }>;
  metadata: Record<string, string>;
}

/** Bytes per element of the dtypes this reader widens to float32. */
const DTYPE_BYTES: Record<string, number> = { F32: 4, F16: 2, BF16: 2 };

/** IEEE half-precision bits to a number. */
function halfToFloat(h: number): number {
  const sign = h & 0x8000 ? -1 : 1, exp = (h >> 10) & 0x1f, frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

/** Widens F16 or BF16 little-endian data to float32. */
function widen(dtype: string, raw: Uint8Array, n: number): Float32Array {
  const out = new Float32Array(n);
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  if (dtype === "BF16") {
    const bits = new Uint32Array(out.buffer);
    for (let i = 0; i < n; i++) bits[i] = view.getUint16(2 * i, true) << 16;
  } else {
    for (let i = 0; i < n; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
  }
  return out;
}

/**
 * Decodes safetensors bytes. F32 tensors are viewed in place where aligned; F16 and BF16 tensors
 * (as Hugging Face often ships them) are widened to float32. `what` names the source in errors.
 */
export function decodeSafetensors(bytes: Uint8Array, what = "safetensors"): SafetensorsFile {
  if (bytes.length < 8) {
    throw new Error(`Cannot read "${what}": ${bytes.length} bytes is too short for a header`);
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLen = Number(view.getBigUint64(0, true));
  if (8 + headerLen > bytes.length) {
    throw new Error(
      `Cannot read "${what}": header length ${headerLen} runs past the file (${bytes.length} bytes)`,
    );
  }
  let header: Record<string, unknown>;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLen)));
  } catch (e) {
    throw new Error(`Cannot read "${what}": its header is not valid JSON (${(e as Error).message})`);
  }
  if (header === null || typeof header !== "object" || Array.isArray(header)) {
    throw new Error(`Cannot read "${what}": its header is not a JSON object`);
  }
  const dataStart = 8 + headerLen;
  const tensors = new Map<string, { shape: number[]; data: Float32Array }>();
  let metadata: Record<string, string> = {};
  for (const [name, value] of Object.entries(header)) {
    if (name === "__metadata__") {
      metadata = value as Record<string, string>;
      continue;
    }
    const e = value as HeaderEntry;
    if (!Array.isArray(e?.shape) || !Array.isArray(e.data_offsets)) {
      throw new Error(`Cannot read "${what}": tensor "${name}" has no shape or data_offsets`);
    }
    const size = DTYPE_BYTES[e.dtype];
    if (!size) {
      throw new Error(
        `Cannot read "${what}": tensor "${name}" has dtype "${e.dtype}", expected F32, F16 or BF16`,
      );
    }
    const [start, end] = e.data_offsets;
    const n = e.shape.reduce((a, b) => a * b, 1);
    if (end - start !== n * size || dataStart + end > bytes.length) {
      throw new Error(`Cannot read "${what}": tensor "${name}" has a bad byte range [${start}, ${end}]`);
    }
    const abs = bytes.byteOffset + dataStart + start;
    let data: Float32Array;
    if (size === 2) data = widen(e.dtype, bytes.subarray(dataStart + start, dataStart + end), n);
    // Copy only when the range is misaligned for a Float32Array view.
    else if (abs % 4 === 0) data = new Float32Array(bytes.buffer, abs, n);
    else data = new Float32Array(bytes.slice(dataStart + start, dataStart + end).buffer);
    tensors.set(name, { shape: e.shape, data });
  }
  return { tensors, metadata };
}

/** Reads a safetensors file. */
export async function readSafetensors(path: string): Promise<SafetensorsFile> {
  return decodeSafetensors(await Deno.readFile(path), path);
}
