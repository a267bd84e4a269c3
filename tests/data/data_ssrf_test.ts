/**
 * URL sources reach only public addresses: the address classifier, the per-URL check (schemes,
 * literal addresses, names resolving to private addresses), redirects to private addresses
 * refused on every hop, and the per-dataset download budget.
 */

import assert from "node:assert/strict";
import { checkPublicUrl, downloadUrls, nonPublicRange, type WebDocument } from "../../data/mod.ts";

Deno.test("nonPublicRange() classifies loopback, private, link-local, multicast and mapped addresses", () => {
  const cases: Array<[string, string | null]> = [
    ["127.0.0.1", "loopback"],
    ["127.8.9.10", "loopback"],
    ["10.1.2.3", "private"],
    ["172.16.0.1", "private"],
    ["172.31.255.255", "private"],
    ["172.32.0.1", null],
    ["192.168.1.1", "private"],
    ["100.64.0.1", "private (shared address space)"],
    ["169.254.169.254", "link-local"],
    ["224.0.0.1", "multicast"],
    ["239.255.255.250", "multicast"],
    ["0.0.0.0", "unspecified"],
    ["255.255.255.255", "reserved"],
    ["8.8.8.8", null],
    ["93.184.216.34", null],
    ["::1", "loopback"],
    ["[::1]", "loopback"],
    ["::", "unspecified"],
    ["fe80::1", "link-local"],
    ["fd00::1", "private"],
    ["fc12:3456::1", "private"],
    ["ff02::1", "multicast"],
    ["::ffff:127.0.0.1", "loopback"],
    ["::ffff:7f00:1", "loopback"],
    ["::ffff:169.254.169.254", "link-local"],
    ["64:ff9b::a9fe:a9fe", "link-local"],
    ["2002:c0a8:0101::1", "private"],
    ["2606:4700:4700::1111", null],
    ["2001:db8::1", "reserved"],
    ["not-an-ip", "invalid"],
  ];
  for (const [ip, want] of cases) assert.equal(nonPublicRange(ip), want, ip);
});

Deno.test("checkPublicUrl() refuses other schemes, private literals and names that resolve privately", async () => {
  const dns: Record<string, string[]> = {
    "public.example": ["93.184.216.34"],
    "rebind.example": ["93.184.216.34", "10.0.0.5"],
    "meta.example": ["169.254.169.254"],
  };
  const resolve = (h: string) => Promise.resolve(dns[h] ?? []);
  await checkPublicUrl("https://public.example/page", { resolve });
  const refused = async (url: string, re: RegExp) =>
    await assert.rejects(() => checkPublicUrl(url, { resolve }), (e: Error) => {
      assert.equal(e.name, "UrlRefusedError");
      assert.match(e.message, re);
      return true;
    });
  await refused("file:///etc/passwd", /^Unsupported scheme "file": only http and https are fetched$/);
  await refused("ftp://public.example/", /Unsupported scheme "ftp"/);
  await refused("http://127.0.0.1:8080/train", /^Refusing "127\.0\.0\.1:8080": a loopback address/);
  await refused("http://2130706433/", /loopback/); // 127.0.0.1 written as one number
  await refused("http://[::ffff:169.254.169.254]/", /link-local/);
  await refused("http://localhost/", /loopback name/);
  await refused("http://app.localhost/", /loopback name/);
  await refused(
    "http://rebind.example/",
    /^Refusing "rebind\.example" \(resolves to 10\.0\.0\.5\): a private address/,
  );
  await refused("http://meta.example/latest/", /link-local/);
  await checkPublicUrl("http://127.0.0.1/", { allowPrivate: true });
  await checkPublicUrl("http://127.0.0.1:1/", { allowHosts: ["127.0.0.1"] });
});

Deno.test("downloadUrls refuses private addresses on every redirect hop and stops at the byte budget", async () => {
  const hits: string[] = [];
  const controller = new AbortController();
  let port = 0;
  const server: Deno.HttpServer<Deno.NetAddr> = Deno.serve({
    hostname: "127.0.0.1",
    port: 0,
    signal: controller.signal,
    onListen: () => {},
  }, (req): Response => {
    const path = new URL(req.url).pathname;
    hits.push(path);
    if (path === "/to-metadata") {
      return new Response(null, {
        status: 302,
        headers: { location: "http://169.254.169.254/latest/meta-data" },
      });
    }
    if (path === "/to-localhost") {
      return new Response(null, { status: 301, headers: { location: `http://localhost:${port}/page1` } });
    }
    if (path === "/to-page") return new Response(null, { status: 307, headers: { location: "/page2" } });
    if (path === "/loop") return new Response(null, { status: 302, headers: { location: "/loop" } });
    return new Response(`Text of ${path}. `.repeat(5), { headers: { "content-type": "text/plain" } });
  });
  port = server.addr.port;
  const base = `http://127.0.0.1:${port}`;
  try {
    const docs: WebDocument[] = [];
    // Only the test server's literal address is exempt: where its redirects point is checked.
    const { counts, failures } = await downloadUrls(
      [`${base}/to-metadata`, `${base}/to-localhost`, `${base}/to-page`, `${base}/loop`, `${base}/page3`],
      { concurrency: 1, retries: 0, allowHosts: ["127.0.0.1"], maxRedirects: 3 },
      (d) => void docs.push(d),
    );
    const why = Object.fromEntries(failures.map((f) => [f.url.replace(base, ""), f.error]));
    assert.match(why["/to-metadata"], /^Refusing "169\.254\.169\.254": a link-local address/);
    assert.match(why["/to-localhost"], /^Refusing "localhost:\d+": a loopback name/);
    assert.equal(why["/loop"], "More than 3 redirects");
    assert.deepEqual(docs.map((d) => d.url.replace(base, "")), ["/to-page", "/page3"]);
    assert.match(docs[0].text, /^Text of \/page2\./);
    assert.equal(counts.ok, 2);
    assert.ok(!hits.includes("/page1"), "the refused redirect target was never fetched");

    // Without the exemption the server itself is refused before any request.
    const before = hits.length;
    const direct = await downloadUrls([`${base}/page1`], { retries: 0 }, () => {});
    assert.match(direct.failures[0].error, /^Refusing "127\.0\.0\.1:\d+": a loopback address/);
    assert.equal(hits.length, before);

    // Each page is 65 bytes: a 150-byte budget takes two, the third overruns it, the fourth never starts.
    const budget = await downloadUrls(
      [1, 2, 3, 4].map((i) => `${base}/p${i}`),
      {
        concurrency: 1,
        retries: 0,
        allowPrivate: true,
        maxTotalBytes: 150,
        budgetSetting: "GPT2_MAX_DOWNLOAD_BYTES",
      },
      () => {},
    );
    assert.equal(budget.counts.ok, 2);
    assert.deepEqual(budget.failures.map((f) => f.error), [
      "Download budget of 150 bytes for this dataset is spent (GPT2_MAX_DOWNLOAD_BYTES)",
      "Download budget of 150 bytes for this dataset is spent (GPT2_MAX_DOWNLOAD_BYTES)",
    ]);
    assert.ok(!hits.includes("/p4"), "no request once the budget is spent");
  } finally {
    controller.abort();
    await server.finished;
  }
});
