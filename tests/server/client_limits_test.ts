/**
 * The per-client stream limit as a server behind a proxy meets it, through `app.request()` with
 * the scripted GPU Worker standing in for generation (no GPU): a client is its API token when
 * auth is on, else its address, forwarded (`X-Forwarded-For`, `Forwarded`) only by a trusted
 * proxy; a 429 names the limit; by default one client may fill an engine's batch. Also the
 * address parsing behind it and GPT2_TRUSTED_PROXIES in the settings.
 */

import { deepStrictEqual as assertEquals, ok as assert, throws as assertThrows } from "node:assert/strict";
import { GenerationManager } from "../../server/generate/mod.ts";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { type Limits } from "../../server/settings.ts";
import { ScriptedWorker } from "../fakes/fake_worker.ts";
import {
  AddressRanges,
  formatAddress,
  forwardedClient,
  forwardedFor,
  parseAddress,
  parseRange,
  xForwardedFor,
} from "../../server/addresses.ts";
import { defaultLimits, ENGINE_MAX_STREAMS, readServerConfig } from "../../server/settings.ts";
import { DEFAULT_GENERATION_OPTIONS } from "../../worker/serving.ts";
import { type AppOptions, createApp } from "../../server/routes/mod.ts";
import { apiError } from "../_api.ts";

const PER_CLIENT = "Too many open streams from this client: 1 (limit GPT2_MAX_STREAMS_PER_CLIENT=1)";

/**
 * Asserts a refusal in the one error shape (see _api.ts); a stream (200) fails at once, since
 * reading its body would wait for a generation that never ends.
 */
function refused(
  res: Response,
  status = 429,
  expect: Parameters<typeof apiError>[2] = { message: PER_CLIENT },
) {
  if (res.status === 200) throw new Error(`Expected ${status}, got 200: the stream was admitted`);
  return apiError(res, status, expect);
}

/** An app serving generation from a scripted Worker and a tiny model directory. */
async function setup(opts: Partial<AppOptions> & { limits?: Partial<Limits> } = {}) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_limits_" });
  await Deno.mkdir(`${root}/models/tiny`, { recursive: true });
  await Deno.writeTextFile(
    `${root}/models/tiny/config.json`,
    JSON.stringify({ n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64, vocab_size: 50257 }),
  );
  await Deno.writeFile(`${root}/models/tiny/model.safetensors`, new Uint8Array(8));
  const store = new JobStore(":memory:");
  const runner = new JobRunner(store, {
    root,
    gpus: 1,
    spawn: () => new ScriptedWorker(),
    datasetExists: () => Promise.resolve(true),
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const app = createApp({
    token: null,
    ...opts,
    runner,
    generation: new GenerationManager(runner.pool, root),
  });
  const open: Response[] = [];
  /** `GET /generate` from socket address `from` with `headers`; a 200 stays open until cleanup. */
  const generate = async (from: string, headers: Record<string, string> = {}) => {
    const res = await app.request("/generate?model=tiny&prompt=Hi", { headers }, {
      remoteAddr: { hostname: from, port: 40000, transport: "tcp" },
    });
    if (res.status === 200) open.push(res);
    return res;
  };
  const cleanup = async () => {
    for (const r of open) await r.body!.cancel();
    runner.shutdown();
    store.close();
    await Deno.remove(root, { recursive: true });
  };
  return { app, generate, cleanup };
}

const one = { limits: { maxStreamsPerClient: 1, maxStreams: 100 } };
const bearer = (token: string) => ({ Authorization: `Bearer ${token}` });

Deno.test("streamLimit() keys a client by its API token: two tokens each get a quota, one token from two addresses shares one", async () => {
  const t = await setup({ ...one, token: ["token-of-ann", "token-of-bob"] });
  try {
    assertEquals((await t.generate("192.0.2.1", bearer("token-of-ann"))).status, 200);
    await refused(await t.generate("192.0.2.2", bearer("token-of-ann")));
    assertEquals((await t.generate("192.0.2.1", bearer("token-of-bob"))).status, 200);
    await refused(await t.generate("198.51.100.9", bearer("token-of-bob")));
    // A token that is not one of them never reaches the limit.
    await refused(await t.generate("192.0.2.3", bearer("token-of-eve")), 401, {});
  } finally {
    await t.cleanup();
  }
});

Deno.test("streamLimit() keys a client behind a trusted proxy by its forwarded address", async () => {
  const t = await setup({ ...one, trustedProxies: ["10.0.0.0/8", "fd00::/8"] });
  try {
    const proxy = "10.1.2.3";
    const xff = (v: string) => ({ "X-Forwarded-For": v });
    assertEquals((await t.generate(proxy, xff("203.0.113.7"))).status, 200);
    assertEquals((await t.generate(proxy, xff("203.0.113.8"))).status, 200);
    await refused(await t.generate(proxy, xff("203.0.113.7")));
    // Written to the left of what the proxy appended, a made-up address changes nothing.
    await refused(await t.generate(proxy, xff("198.51.100.1, 203.0.113.7")));
    // Through a second trusted proxy: the right-most address that is not a proxy.
    await refused(await t.generate(proxy, xff("203.0.113.8, 10.9.9.9")));
    // RFC 7239 Forwarded, over IPv6 from an IPv6 proxy.
    const fwd = (v: string) => ({ Forwarded: v });
    assertEquals((await t.generate("fd00::1", fwd('for="[2001:db8::17]:4711";proto=https'))).status, 200);
    await refused(await t.generate("[fd00::2]", fwd('for="[2001:db8:0::17]"')));
    assertEquals((await t.generate("fd00::1", fwd("for=192.0.2.60, for=10.0.0.1"))).status, 200);
    // A dual-stack socket's IPv4-mapped address is the same proxy, and the same client.
    await refused(await t.generate("::ffff:10.1.2.3", xff("192.0.2.60")));
    // The proxy's X-Forwarded-For wins over a Forwarded header the client wrote itself.
    const both = { "X-Forwarded-For": "203.0.113.50", Forwarded: "for=203.0.113.7" };
    assertEquals((await t.generate(proxy, both)).status, 200);
    // The proxy itself, without a header, is one more client.
    assertEquals((await t.generate(proxy)).status, 200);
  } finally {
    await t.cleanup();
  }
});

Deno.test("streamLimit() ignores X-Forwarded-For and Forwarded from a peer that is not a trusted proxy", async () => {
  const t = await setup({ ...one, trustedProxies: ["10.0.0.0/8"] });
  try {
    const client = "192.0.2.1";
    assertEquals((await t.generate(client, { "X-Forwarded-For": "203.0.113.1" })).status, 200);
    await refused(await t.generate(client, { "X-Forwarded-For": "203.0.113.2" }));
    await refused(await t.generate(client, { Forwarded: "for=203.0.113.3" }));
    await refused(await t.generate(client, { "X-Forwarded-For": "10.0.0.1" }));
  } finally {
    await t.cleanup();
  }
  const none = await setup(one); // no trusted proxies at all: even loopback's headers are ignored
  try {
    assertEquals((await none.generate("127.0.0.1", { "X-Forwarded-For": "203.0.113.1" })).status, 200);
    await refused(await none.generate("127.0.0.1", { "X-Forwarded-For": "203.0.113.2" }));
  } finally {
    await none.cleanup();
  }
});

Deno.test("a 429 past a stream limit names the limit, its value and the setting that raises it", async () => {
  const t = await setup({ limits: { maxStreamsPerClient: 2, maxStreams: 3 } });
  try {
    for (let i = 0; i < 2; i++) assertEquals((await t.generate("192.0.2.1")).status, 200);
    const res = await t.generate("192.0.2.1");
    assertEquals(res.headers.get("Retry-After"), null); // none before: a stream ends when it ends
    await refused(res, 429, {
      message: "Too many open streams from this client: 2 (limit GPT2_MAX_STREAMS_PER_CLIENT=2)",
      type: "rate_limit_error",
      code: "limit_exceeded",
      param: null,
    });
    assertEquals((await t.generate("192.0.2.2")).status, 200);
    await refused(await t.generate("192.0.2.3"), 429, {
      message: "Too many open streams: 3 (limit GPT2_MAX_STREAMS=3)",
      code: "limit_exceeded",
    });
  } finally {
    await t.cleanup();
  }
});

Deno.test("by default one client may open as many streams as an engine decodes together (64)", async () => {
  assertEquals(ENGINE_MAX_STREAMS, DEFAULT_GENERATION_OPTIONS.maxStreams);
  assertEquals(defaultLimits().maxStreamsPerClient, 64);
  assertEquals(readServerConfig({ get: () => undefined }).limits.maxStreamsPerClient, 64);
  const t = await setup();
  try {
    for (let i = 0; i < 64; i++) assertEquals((await t.generate("192.0.2.1")).status, 200, `stream ${i}`);
    await refused(await t.generate("192.0.2.1"), 429, {
      message: "Too many open streams from this client: 64 (limit GPT2_MAX_STREAMS_PER_CLIENT=64)",
    });
  } finally {
    await t.cleanup();
  }
});

Deno.test("readServerConfig() reads GPT2_TRUSTED_PROXIES and refuses an entry that is not an address or CIDR range", () => {
  const env = (v: string) => ({ get: (k: string) => (k === "GPT2_TRUSTED_PROXIES" ? v : undefined) });
  assertEquals(readServerConfig(env("")).trustedProxies, []);
  assertEquals(readServerConfig(env(" 127.0.0.1, 10.0.0.0/8 ,::1,fd00::/8")).trustedProxies, [
    "127.0.0.1",
    "10.0.0.0/8",
    "::1",
    "fd00::/8",
  ]);
  for (
    const bad of ["localhost", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "1.2.3.4/", "::1::2", "10.0.0.256"]
  ) {
    assertThrows(() => readServerConfig(env(`127.0.0.1,${bad}`)), {
      message:
        `Invalid GPT2_TRUSTED_PROXIES entry "${bad}": expected an IP address or a CIDR range such as "10.0.0.0/8" or "fd00::/8"`,
    });
  }
});

Deno.test("parseAddress() and parseRange() read IPv4, IPv6 and IPv4-mapped addresses into one form", () => {
  const text = (s: string) => {
    const a = parseAddress(s);
    return a && formatAddress(a);
  };
  assertEquals(text("192.0.2.1"), "192.0.2.1");
  assertEquals(text("::ffff:192.0.2.1"), "192.0.2.1");
  assertEquals(text("[2001:DB8::1]"), "2001:db8:0:0:0:0:0:1");
  assertEquals(text("fe80::1%eth0"), "fe80:0:0:0:0:0:0:1");
  assertEquals(text("::"), "0:0:0:0:0:0:0:0");
  for (
    const bad of [
      "",
      "unknown",
      "_hidden",
      "1.2.3",
      "1:2:3:4:5:6:7:8:9",
      "1::2::3",
      "1:2:3:4:5:6:7:8::",
      "g::1",
    ]
  ) {
    assertEquals(parseAddress(bad), null, bad);
  }
  const ranges = new AddressRanges(["10.0.0.0/8", "2001:db8::/32", "192.0.2.1", "172.16.0.0/12"]);
  const has = (s: string) => ranges.has(parseAddress(s)!);
  assert(has("10.255.0.1") && has("::ffff:10.0.0.1") && has("2001:db8:ffff::1") && has("192.0.2.1"));
  assert(has("172.31.255.255") && !has("172.32.0.0") && !has("11.0.0.1") && !has("192.0.2.2"));
  assert(!has("2001:db9::1") && !has("::1"));
  assertEquals(parseRange("0.0.0.0/0")?.bits, 96);
  assert(new AddressRanges(["::/0"]).has(parseAddress("192.0.2.1")!));
  assertThrows(() => new AddressRanges(["10.0.0.0/8", "nope"]), { message: /^Invalid address range "nope"/ });
});

Deno.test("xForwardedFor(), forwardedFor() and forwardedClient() take the right-most hop that is not a trusted proxy", () => {
  const texts = (hops: (Uint8Array | null)[]) => hops.map((h) => h && formatAddress(h));
  assertEquals(texts(xForwardedFor("203.0.113.1, 198.51.100.2:8080,[2001:db8::1]:443 , unknown,")), [
    "203.0.113.1",
    "198.51.100.2",
    "2001:db8:0:0:0:0:0:1",
    null,
  ]);
  assertEquals(
    texts(
      forwardedFor(
        'for=192.0.2.43;by="x,y", For="[2001:db8:cafe::17]:4711";proto=http, for=unknown,proto=https',
      ),
    ),
    ["192.0.2.43", "2001:db8:cafe:0:0:0:0:17", null, null],
  );
  const trusted = new AddressRanges(["10.0.0.0/8"]);
  const client = (peer: string, header: string) =>
    formatAddress(forwardedClient(parseAddress(peer)!, xForwardedFor(header), trusted));
  assertEquals(client("10.0.0.1", "203.0.113.1, 198.51.100.2"), "198.51.100.2");
  assertEquals(client("10.0.0.1", "203.0.113.1, 10.0.0.2"), "203.0.113.1");
  assertEquals(client("10.0.0.1", "10.0.0.3, 10.0.0.2"), "10.0.0.3"); // all proxies: the left-most
  assertEquals(client("10.0.0.1", "203.0.113.1, unknown, 10.0.0.2"), "10.0.0.2"); // unreadable: its reporter
  assertEquals(client("10.0.0.1", "203.0.113.1, unknown"), "10.0.0.1");
  assertEquals(client("10.0.0.1", ""), "10.0.0.1");
  assertEquals(client("192.0.2.1", "203.0.113.1"), "192.0.2.1"); // not a proxy: the header means nothing
});
