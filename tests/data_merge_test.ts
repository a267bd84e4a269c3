/** Tests of stages 3-4 (merge, clean): text and loose-JSON files, bad input counted, cleaning rules. */
import assert from "node:assert/strict";
import { join } from "node:path";
import { cleanText, emptyMergeCounts, mergeToLooseJson, readDocuments } from "../data/mod.ts";
import { withRoot } from "./data_fixtures.ts";

Deno.test("cleanText normalises to NFC, strips control characters and collapses blank lines", () => {
  assert.equal(
    cleanText("\uFEFFCafe\u0301\r\nline\u0007two  \n\n\n\nend\uFFFD\u0000 "),
    "Caf\u00e9\nlinetwo\n\nend",
  );
  assert.equal(cleanText("tab\tkept\n"), "tab\tkept");
});

Deno.test("readDocuments merges txt and jsonl files and counts empty, binary, invalid UTF-8, malformed and oversized input", async () => {
  await withRoot(async (root) => {
    const dir = join(root, "in");
    await Deno.mkdir(join(dir, "sub"), { recursive: true });
    await Deno.writeTextFile(join(dir, "a.txt"), "First document.");
    await Deno.writeTextFile(join(dir, "empty.txt"), "");
    await Deno.writeFile(join(dir, "bin.txt"), new Uint8Array([0x50, 0x4b, 0x00, 0x01, 0x02]));
    await Deno.writeFile(join(dir, "bad.txt"), new Uint8Array([0x48, 0x69, 0xff, 0xfe, 0x21]));
    await Deno.writeTextFile(join(dir, "image.png"), "not read");
    const huge = "x".repeat(3000);
    await Deno.writeTextFile(
      join(dir, "sub", "b.jsonl"),
      [
        '{"text": "Second.", "url": "https://e.com/2"}',
        '"Third."',
        "{not json",
        '{"title": "no text"}',
        "",
        JSON.stringify({ text: huge }),
        '{"text": "Fourth."}',
      ]
        .join("\n"),
    );
    const counts = emptyMergeCounts();
    const docs = await Array.fromAsync(readDocuments(dir, counts, { maxDocumentBytes: 1000 }));
    assert.deepEqual(docs.map((d) => d.text), [
      "First document.",
      "Hi\uFFFD\uFFFD!",
      "Second.",
      "Third.",
      "Fourth.",
    ]);
    assert.equal(docs[2].url, "https://e.com/2");
    assert.deepEqual(counts, {
      files: 5,
      documents: 5,
      empty_files: 1,
      binary_files: 1,
      skipped_files: 1,
      invalid_utf8: 1,
      malformed_json: 2,
      oversized: 1,
    });
  });
});

Deno.test("mergeToLooseJson writes one JSON object per line and keeps an old file when it fails", async () => {
  await withRoot(async (root) => {
    await Deno.writeTextFile(join(root, "x.txt"), "Hello\nworld");
    await Deno.writeTextFile(
      join(root, "y.json"),
      JSON.stringify([{ text: "From array" }, "Bare string", 5]),
    );
    const out = join(root, "merged.jsonl");
    const counts = await mergeToLooseJson([join(root, "x.txt"), join(root, "y.json")], out);
    const lines = (await Deno.readTextFile(out)).trim().split("\n").map((l) => JSON.parse(l));
    assert.deepEqual(lines.map((l) => l.text), ["Hello\nworld", "From array", "Bare string"]);
    assert.equal(counts.malformed_json, 1);
    await assert.rejects(() => mergeToLooseJson([join(root, "missing")], out), /NotFound|No such file/);
    assert.equal((await Deno.readTextFile(out)).trim().split("\n").length, 3);
    assert.deepEqual((await Array.fromAsync(Deno.readDir(root))).filter((e) => e.name.includes(".tmp-")), []);
  });
});
