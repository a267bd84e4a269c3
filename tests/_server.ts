/**
 * Test helpers for the real server: start main.ts as a subprocess on a free loopback port, and
 * follow a job's server-sent events.
 */

import assert from "node:assert/strict";

/** A running server subprocess. */
export interface Server {
  url: string;
  child: Deno.ChildProcess;
  /** Everything it printed after the listening line (stdout and stderr). */
  output: string[];
}

/** Starts main.ts with PORT=0 and waits for the line that names the port it got. */
export async function startServer(home: string, env: Record<string, string> = {}): Promise<Server> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts"],
    cwd: new URL("..", import.meta.url).pathname,
    env: { PORT: "0", HOST: "127.0.0.1", GPT2_HOME: home, DENO_WEBGPU_BACKEND: "vulkan", ...env },
    stdout: "piped",
    stderr: "piped",
  }).spawn();
  const output: string[] = [];
  const decoder = new TextDecoderStream();
  child.stdout.pipeTo(decoder.writable).catch(() => {});
  child.stderr.pipeTo(new WritableStream({ write: (b) => void output.push(new TextDecoder().decode(b)) }))
    .catch(() => {});
  const reader = decoder.readable.getReader();
  let buffered = "";
  const deadline = Date.now() + 60_000;
  while (Date.now() < deadline) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value;
    const m = buffered.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
    if (m) {
      // Keep draining stdout so the child never blocks on a full pipe.
      (async () => {
        for (;;) {
          const r = await reader.read().catch(() => ({ done: true, value: "" }));
          if (r.done) return;
          output.push(r.value!);
        }
      })();
      return { url: m[1], child, output };
    }
  }
  child.kill("SIGKILL");
  throw new Error(`Server did not start: ${buffered}${output.join("")}`);
}

/** One server-sent event. */
export interface SseEvent {
  id: number;
  event: string;
  data: Record<string, unknown>;
}

/**
 * Follows a job's events, calling `onEvent` for each (return false to stop); resolves when the
 * stream ends or breaks.
 */
export async function follow(
  url: string,
  lastId: number,
  onEvent: (e: SseEvent) => boolean | void,
): Promise<void> {
  const res = await fetch(url, { headers: lastId ? { "Last-Event-ID": String(lastId) } : {} });
  assert.equal(res.status, 200);
  const reader = res.body!.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    let chunk: ReadableStreamReadResult<string>;
    try {
      chunk = await reader.read();
    } catch {
      return; // the server was killed mid-stream
    }
    if (chunk.done) return;
    buf += chunk.value;
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (block.startsWith(":")) continue;
      const f: Record<string, string> = {};
      for (const line of block.split("\n")) {
        const c = line.indexOf(":");
        f[line.slice(0, c)] = line.slice(c + 1).trimStart();
      }
      if (onEvent({ id: Number(f.id ?? 0), event: f.event, data: JSON.parse(f.data) }) === false) {
        await reader.cancel();
        return;
      }
    }
  }
}

/** POSTs a training job and returns its id. */
export async function submit(url: string, body: Record<string, unknown>): Promise<string> {
  const res = await fetch(`${url}/train`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  const json = await res.json();
  assert.equal(res.status, 202, JSON.stringify(json));
  return json.id;
}
