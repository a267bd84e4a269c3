/** Tests of stages 3-4 (merge, clean): text and loose-JSON files, bad input counted, cleaning rules. */
import assert from "node:assert/strict";
import { join } from "node:path";
import {
  cleanText,
  emptyMergeCounts,
  type FileIssue,
  jsonTooDeep,
  mergeToLooseJson,
  readDocuments,
} from "../../data/mod.ts";
import { withRoot } from "../data_fixtures.ts";

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
    await Deno.symlink(join(dir, "a.txt"), join(dir, "link.txt"));
    const counts = emptyMergeCounts();
    const issues: FileIssue[] = [];
    const docs = await Array.fromAsync(
      readDocuments(dir, counts, { maxDocumentBytes: 1000, onIssue: (i) => void issues.push(i) }),
    );
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
      skipped_files: 2,
      invalid_utf8: 1,
      malformed_json: 2,
      oversized: 1,
      too_deep: 0,
      timed_out: 0,
    });
    assert.deepEqual(issues, [
      { file: "bad.txt", reason: "invalid UTF-8 (decoded with U+FFFD)" },
      { file: "bin.txt", reason: "binary (NUL bytes)" },
      { file: "empty.txt", reason: "empty" },
      { file: "image.png", reason: 'unsupported extension ".png"' },
      { file: "link.txt", reason: "symlink (not followed)" },
      {
        file: join("sub", "b.jsonl"),
        reason: "malformed JSON on lines 3, 4; over the 1000-byte cap on line 6",
      },
    ]);
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

Deno.test("readDocuments refuses deeply nested JSON fast, by file and by line, and bounds time per file", async () => {
  await withRoot(async (root) => {
    // 2M levels of nesting: JSON.parse/stringify of this would take seconds to minutes.
    const depth = 2_000_000;
    await Deno.writeTextFile(join(root, "deep.json"), "[".repeat(depth) + "]".repeat(depth));
    await Deno.writeTextFile(
      join(root, "lines.jsonl"),
      ['{"text": "ok"}', `{"text": "x", "n": ${"[".repeat(100)}${"]".repeat(100)}}`, '"fine"'].join("\n"),
    );
    await Deno.writeTextFile(join(root, "slow.jsonl"), '"a"\n"b"\n');
    const counts = emptyMergeCounts();
    const issues: FileIssue[] = [];
    const t0 = performance.now();
    const docs = await Array.fromAsync(readDocuments(join(root, "deep.json"), counts, {
      onIssue: (i) => void issues.push(i),
    }));
    for (const name of ["lines.jsonl"]) {
      docs.push(
        ...await Array.fromAsync(readDocuments(join(root, name), counts, {
          onIssue: (i) => void issues.push(i),
        })),
      );
    }
    assert.ok(performance.now() - t0 < 5000, `took ${performance.now() - t0} ms`);
    docs.push(
      ...await Array.fromAsync(
        readDocuments(join(root, "slow.jsonl"), counts, {
          maxFileMs: 0,
          onIssue: (i) => void issues.push(i),
        }),
      ),
    );
    assert.deepEqual(docs.map((d) => d.text), ["ok", "fine"]);
    assert.equal(counts.too_deep, 2);
    assert.equal(counts.timed_out, 1);
    assert.deepEqual(issues, [
      { file: "deep.json", reason: "too deep: JSON nested more than 64 levels" },
      { file: "lines.jsonl", reason: "JSON nested more than 64 levels on line 2" },
      {
        file: "slow.jsonl",
        reason: "timed out: parsing took longer than 0 ms, stopped at line 1",
        cut: { line: 1 },
      },
    ]);
    assert.equal(jsonTooDeep('{"a": "[[[[[[", "b": [[1]]}', 3), false);
    assert.equal(jsonTooDeep('{"a": "\\"[[[[", "b": [[[1]]]}', 3), true);
  });
});
