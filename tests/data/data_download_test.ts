/**
 * Tests of stage 2: main-text extraction from fixture HTML, and the downloader against a local
 * HTTP server on 127.0.0.1 (no outside network; short timeouts keep it bounded).
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import {
  DEFAULT_USER_AGENT,
  downloadUrls,
  extractMainText,
  prepareDataset,
  type WebDocument,
} from "../../data/mod.ts";

const PARAGRAPH =
  "The committee met on Tuesday to review the annual budget and the state of the harbour works. ";
const ARTICLE_HTML =
  `<!doctype html><html><head><title>Harbour report</title><style>p{color:red}</style></head><body>
<nav><a href="/">Home</a> | <a href="/about">About us</a> | <a href="/contact">Contact</a></nav>
<header>Site banner and login</header>
<article><h1>Harbour report</h1><p>${PARAGRAPH.repeat(4)}</p><p>Second paragraph. ${
    PARAGRAPH.repeat(3)
  }</p></article>
<aside>Related: ten tricks for cheap flights</aside>
<footer>Copyright 2024 Example Corp</footer><script>var tracking = "should not appear";</script></body></html>`;

Deno.test("extractMainText keeps the article and drops navigation, scripts and footer", () => {
  const { title, text, article } = extractMainText(ARTICLE_HTML, "http://127.0.0.1/x");
  assert.equal(title, "Harbour report");
  assert.ok(article);
  assert.match(text, /^The committee met on Tuesday/); // Readability drops the h1 that repeats the title
  assert.match(text, /\n\nSecond paragraph\. The committee/);
  for (const junk of ["About us", "login", "cheap flights", "Copyright", "tracking", "color:red"]) {
    assert.ok(!text.includes(junk), `Extracted text contains "${junk}"`);
  }
});

Deno.test("extractMainText returns the text of short pages without menus or scripts", () => {
  const { text } = extractMainText(
    "<html><body><nav>Menu</nav><p>Just one line.</p><script>x()</script></body></html>",
  );
  assert.equal(text, "Just one line.");
});

Deno.test("downloadUrls extracts pages, retries server errors and records every failure without throwing", async () => {
  let flaky = 0;
  const agents = new Set<string>();
  const controller = new AbortController();
  const server = Deno.serve(
    { hostname: "127.0.0.1", port: 0, signal: controller.signal, onListen: () => {} },
    async (req) => {
      agents.add(req.headers.get("user-agent") ?? "");
      const path = new URL(req.url).pathname;
      if (path === "/article") {
        return new Response(ARTICLE_HTML, {
          headers: { "content-type": "text/html; charset=utf-8" },
        });
      }
      if (path === "/plain") {
        return new Response("Plain text body.", {
          headers: { "content-type": "text/plain" },
        });
      }
      if (path === "/flaky") {
        return ++flaky < 2
          ? new Response("busy", { status: 503 })
          : new Response("Recovered text.", { headers: { "content-type": "text/plain" } });
      }
      if (path === "/image") {
        return new Response(new Uint8Array(10), {
          headers: { "content-type": "image/png" },
        });
      }
      if (path === "/big") {
        return new Response("y".repeat(5000), {
          headers: { "content-type": "text/plain" },
        });
      }
      if (path === "/slow") {
        await new Promise((r) => setTimeout(r, 1500));
        return new Response("late", { headers: { "content-type": "text/plain" } });
      }
      return new Response("missing", { status: 404 });
    },
  );
  // A port nothing listens on: bind and close a listener to get one.
  const closed = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const deadPort = (closed.addr as Deno.NetAddr).port;
  closed.close();
  try {
    const base = `http://127.0.0.1:${server.addr.port}`;
    const docs: WebDocument[] = [];
    const { counts, failures } = await downloadUrls(
      [
        `${base}/article`,
        `${base}/plain`,
        `${base}/flaky`,
        `${base}/image`,
        `${base}/big`,
        `${base}/slow`,
        `${base}/gone`,
        `http://127.0.0.1:${deadPort}/x`,
      ],
      { concurrency: 4, timeoutMs: 400, retries: 1, retryDelayMs: 10, maxBytes: 4000, allowPrivate: true },
      (d) => void docs.push(d),
    );
    assert.deepEqual(docs.map((d) => d.url.replace(base, "")).sort(), ["/article", "/flaky", "/plain"]);
    assert.match(docs.find((d) => d.url.endsWith("/article"))!.text, /^The committee met/);
    assert.equal(counts.ok, 3);
    assert.equal(counts.failed, 5);
    const why = Object.fromEntries(failures.map((f) => [f.url.replace(base, ""), f.error]));
    assert.match(why["/image"], /Unsupported content type "image\/png"/);
    assert.match(why["/big"], /cap/);
    assert.match(why["/slow"], /Timed out after 400 ms/);
    assert.match(why["/gone"], /HTTP 404/);
    assert.match(why[`http://127.0.0.1:${deadPort}/x`], /Cannot fetch/);
    assert.equal(failures.find((f) => f.url.endsWith("/slow"))!.attempts, 2);
    assert.deepEqual([...agents], [DEFAULT_USER_AGENT]);
  } finally {
    controller.abort();
    await server.finished;
  }
});

Deno.test("prepareDataset from urls filters, downloads, records failures and tokenizes the pages", async () => {
  const controller = new AbortController();
  const server = Deno.serve(
    { hostname: "127.0.0.1", port: 0, signal: controller.signal, onListen: () => {} },
    (req) => {
      const path = new URL(req.url).pathname;
      if (path.startsWith("/page")) {
        return new Response(
          ARTICLE_HTML.replace("Harbour report</h1>", `Harbour report ${path}</h1>`).replaceAll(
            "Tuesday",
            path,
          ),
          {
            headers: { "content-type": "text/html" },
          },
        );
      }
      return new Response("missing", { status: 404 });
    },
  );
  const root = await Deno.makeTempDir({ prefix: "gpt2-data-test-" });
  try {
    const base = `http://127.0.0.1:${server.addr.port}`;
    const info = await prepareDataset(
      root,
      {
        urls: [
          `${base}/page1`,
          `${base}/page2`,
          `${base}/page1#again`,
          `${base}/gone`,
          `${base}/pic.png`,
          "https://youtube.com/x",
        ],
      },
      {
        min_tokens: 16,
        seq_len: 8,
        split: "8,1,1",
        dedup: false,
        workers: 1,
        download: { timeoutMs: 2000, retries: 0, allowPrivate: true },
      },
    );
    const stats = info.stats as { urls: Record<string, number>; download: Record<string, number> };
    assert.deepEqual(stats.urls, {
      input: 6,
      invalid: 0,
      duplicates: 1,
      blacklisted: 1,
      non_text: 1,
      kept: 3,
    });
    assert.equal(stats.download.ok, 2);
    assert.equal(stats.download.failed, 1);
    assert.equal(info.documents, 2);
    const failures = await Deno.readTextFile(join(root, "datasets", info.id, "failures.jsonl"));
    assert.match(failures, /\/gone.*HTTP 404/);
    await assert.rejects(
      () =>
        prepareDataset(root, { urls: [`${base}/gone`] }, {
          workers: 1,
          download: { retries: 0, allowPrivate: true },
        }),
      /No documents downloaded: all 1 URLs failed \(first: ".*\/gone": HTTP 404\)/,
    );
  } finally {
    controller.abort();
    await server.finished;
    await Deno.remove(root, { recursive: true });
  }
});
