/**
 * The file work of a dataset preparation (data/prepare.ts): buffered appends, atomic journal
 * writes, reopening a work file at its committed length, checksums, copying a split out of the
 * token file, the document index, and the size and fingerprint of a source tree.
 */
import { createHash } from "node:crypto";
import { join } from "node:path";

/** Bytes buffered before a write to disk. */
const WRITE_BUFFER = 1 << 22;

/** An async buffered file writer. */
export class Writer {
  #file: Deno.FsFile;
  #buf = new Uint8Array(WRITE_BUFFER);
  #len = 0;
  constructor(file: Deno.FsFile) {
    this.#file = file;
  }
  async write(bytes: Uint8Array): Promise<void> {
    if (this.#len + bytes.length > this.#buf.length) await this.flush();
    if (bytes.length > this.#buf.length) return void (await this.#writeAll(bytes));
    this.#buf.set(bytes, this.#len);
    this.#len += bytes.length;
  }
  async flush(): Promise<void> {
    await this.#writeAll(this.#buf.subarray(0, this.#len));
    this.#len = 0;
  }
  async #writeAll(b: Uint8Array) {
    for (let off = 0; off < b.length;) off += await this.#file.write(b.subarray(off));
  }
}

/** SHA-256 of a file, also fed to `also` (for the combined checksum). */
export async function hashFile(
  path: string,
  also: ReturnType<typeof createHash>,
): Promise<{ bytes: number; sha256: string }> {
  const h = createHash("sha256");
  using f = await Deno.open(path, { read: true });
  const buf = new Uint8Array(1 << 22);
  let bytes = 0;
  while (true) {
    const n = await f.read(buf);
    if (n === null) break;
    h.update(buf.subarray(0, n));
    also.update(buf.subarray(0, n));
    bytes += n;
  }
  return { bytes, sha256: h.digest("hex") };
}

/** Copy `count` uint16 tokens from token offset `start` of `src` into a new file `dst`. */
export async function copyRange(src: Deno.FsFile, start: number, count: number, dst: string): Promise<void> {
  using out = await Deno.open(dst, { write: true, create: true, truncate: true });
  await src.seek(start * 2, Deno.SeekMode.Start);
  const buf = new Uint8Array(1 << 22);
  let left = count * 2;
  while (left > 0) {
    const n = await src.read(buf.subarray(0, Math.min(buf.length, left)));
    if (n === null) throw new Error(`Cannot copy split: token file ended ${left} bytes early`);
    for (let off = 0; off < n;) off += await out.write(buf.subarray(off, n));
    left -= n;
  }
}

/** Whether an error means the disk is full (the work is kept, to resume once there is room). */
export function diskFull(e: unknown): boolean {
  return (e as { code?: string })?.code === "ENOSPC" || /os error 28\b/.test(String((e as Error)?.message));
}

/** Write `data` to `path` through a temporary file and a rename, so a kill leaves old or new. */
export async function writeAtomic(path: string, data: string): Promise<void> {
  await Deno.writeTextFile(`${path}.part`, data);
  await Deno.rename(`${path}.part`, path);
}

/** Open `path` for appending after truncating it to `bytes` (what the journal committed). */
export async function openAt(path: string, bytes: number): Promise<Deno.FsFile> {
  const f = await Deno.open(path, { read: true, write: true, create: true });
  await f.truncate(bytes);
  await f.seek(bytes, Deno.SeekMode.Start);
  return f;
}

/** Write `documents.idx` (uint64 token offsets, one per document plus the end) from token counts. */
export async function writeDocumentIndex(
  lengthsPath: string,
  documents: number,
  outPath: string,
): Promise<void> {
  using src = await Deno.open(lengthsPath, { read: true });
  using dst = await Deno.open(outPath, { write: true, create: true, truncate: true });
  const lengths = new Uint32Array(1 << 16), offsets = new BigUint64Array(1 << 16);
  const lengthBytes = new Uint8Array(lengths.buffer);
  let offset = 0;
  const writeAll = async (b: Uint8Array) => {
    for (let off = 0; off < b.length;) off += await dst.write(b.subarray(off));
  };
  for (let done = 0; done < documents;) {
    const n = Math.min(lengths.length, documents - done);
    for (let off = 0; off < n * 4;) {
      const r = await src.read(lengthBytes.subarray(off, n * 4));
      if (r === null) throw new Error(`Cannot write the document index: "${lengthsPath}" ended early`);
      off += r;
    }
    for (let i = 0; i < n; i++) {
      offsets[i] = BigInt(offset);
      offset += lengths[i];
    }
    await writeAll(new Uint8Array(offsets.buffer, 0, n * 8));
    done += n;
  }
  await writeAll(new Uint8Array(new BigUint64Array([BigInt(offset)]).buffer));
}

/** Files, bytes and newest modification time (ms) of the regular files under `path`. */
export async function treeFingerprint(
  path: string,
): Promise<{ files: number; bytes: number; mtime: number }> {
  const fp = { files: 0, bytes: 0, mtime: 0 };
  const walk = async (p: string) => {
    const info = await Deno.lstat(p);
    if (info.isFile) {
      fp.files++;
      fp.bytes += info.size;
      fp.mtime = Math.max(fp.mtime, info.mtime?.getTime() ?? 0);
    } else if (info.isDirectory) {
      for await (const e of Deno.readDir(p)) if (!e.name.startsWith(".")) await walk(join(p, e.name));
    }
  };
  await walk(path);
  return fp;
}

/** Total size in bytes of the regular files under `path` (for progress). */
export async function treeSize(path: string): Promise<number> {
  const info = await Deno.lstat(path);
  if (info.isFile) return info.size;
  if (!info.isDirectory) return 0;
  let total = 0;
  for await (const e of Deno.readDir(path)) {
    if (!e.name.startsWith(".")) total += await treeSize(join(path, e.name));
  }
  return total;
}
