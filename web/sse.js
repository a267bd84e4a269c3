/**
 * Server-sent events read from a fetch() body, since EventSource cannot send the bearer token.
 * `SseParser` is pure (unit-tested in Deno); `readSse` drives it over a Response's stream.
 */

/** Splits an SSE byte stream (as text) into events `{id, event, data}`; comments are skipped. */
export class SseParser {
  #buf = "";

  /** Feeds `text` and returns the events it completed. */
  push(text) {
    this.#buf += text.replace(/\r\n?/g, "\n");
    const out = [];
    let i;
    while ((i = this.#buf.indexOf("\n\n")) >= 0) {
      const block = this.#buf.slice(0, i);
      this.#buf = this.#buf.slice(i + 2);
      const e = { id: null, event: "message", data: "" };
      const data = [];
      for (const line of block.split("\n")) {
        if (line === "" || line.startsWith(":")) continue;
        const c = line.indexOf(":");
        const field = c < 0 ? line : line.slice(0, c);
        const value = c < 0 ? "" : line.slice(c + 1).replace(/^ /, "");
        if (field === "data") data.push(value);
        else if (field === "event") e.event = value;
        else if (field === "id") e.id = value;
      }
      if (data.length === 0 && e.id === null) continue;
      e.data = data.join("\n");
      out.push(e);
    }
    return out;
  }
}

/**
 * Reads events from `res` until the stream ends or `onEvent` returns true (then the stream is
 * cancelled). Resolves to whether `onEvent` asked to stop.
 */
export async function readSse(res, onEvent) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new SseParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      for (const e of parser.push(value)) {
        if (onEvent(e)) {
          await reader.cancel().catch(() => {});
          return true;
        }
      }
    }
  } finally {
    reader.releaseLock();
  }
}
