/** Tests of stage 1 (URL lists): normalisation, dedupe, blacklist and extension counts, empty result. */
import assert from "node:assert/strict";
import { filterUrls, normalizeUrl } from "../../data/mod.ts";

Deno.test("normalizeUrl lower-cases the host, drops www, fragment, tracking and trailing slash", () => {
  assert.equal(
    normalizeUrl("HTTPS://WWW.Example.COM:443/a/b/?utm_source=x&q=1#frag"),
    "https://example.com/a/b?q=1",
  );
  assert.equal(normalizeUrl("ftp://example.com/file"), undefined);
  assert.equal(normalizeUrl("not a url"), undefined);
});

Deno.test("filterUrls reports invalid, duplicate, blacklisted and non-text counts", () => {
  const { urls, counts } = filterUrls([
    "https://example.com/article",
    "https://www.example.com/article/", // duplicate after normalisation
    "http://example.com/article#comments", // different scheme: kept as distinct
    "https://i.imgur.com/abc", // blacklisted subdomain
    "https://youtube.com/watch?v=1", // blacklisted
    "https://news.example.org/photo.JPG", // image
    "https://news.example.org/setup.exe", // executable
    "https://news.example.org/archive.tar.gz", // archive
    "https://news.example.org/story.html",
    "garbage",
    "",
    "# comment",
  ]);
  assert.deepEqual(counts, { input: 10, invalid: 1, duplicates: 1, blacklisted: 2, non_text: 3, kept: 3 });
  assert.deepEqual(urls, [
    "https://example.com/article",
    "http://example.com/article",
    "https://news.example.org/story.html",
  ]);
});

Deno.test("filterUrls throws with the counts when nothing is left", () => {
  assert.throws(
    () => filterUrls(["https://youtube.com/x", "https://example.com/a.png"]),
    /No URLs left.*2 input.*1 blacklisted.*1 non-text/,
  );
  assert.throws(() => filterUrls([]), /No URLs left/);
});
