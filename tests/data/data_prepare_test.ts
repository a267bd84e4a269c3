/**
 * Tests of prepareDataset end to end on small fixtures: layout and manifest, cache reuse, clear
 * errors, bad input counted, and nothing already prepared lost when a preparation fails.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import {
  getDataset,
  listDatasets,
  loadDocumentIndex,
  loadSplit,
  prepareDataset,
  Sampler,
} from "../../data/mod.ts";
import { makeDocs, nearDuplicate, withRoot } from "../data_fixtures.ts";

const SMALL = { min_tokens: 16, seq_len: 8, split: "8,1,1", workers: 1 };

Deno.test("prepareDataset writes splits, document index and manifest, dropping short docs and near-duplicates", async () => {
  await withRoot(async (root) => {
    const docs = makeDocs(20, 120, 2);
    const texts = [...docs, nearDuplicate(docs[4], 100), "Too short.", "   \u0000  "];
    const progress: string[] = [];
    const info = await prepareDataset(
      root,
      { texts },
      { ...SMALL, id: "fixture" },
      (p) => progress.push(p.stage),
    );
    assert.equal(info.id, "fixture");
    assert.equal(info.documents, 20);
    const stats = info.stats as Record<string, number>;
    assert.equal(stats.near_duplicates, 1);
    assert.equal(stats.under_min_tokens, 1);
    assert.equal(stats.empty_after_cleaning, 1);
    assert.equal(info.splits.train + info.splits.valid + info.splits.test, info.tokens);
    assert.ok(Math.abs(info.splits.valid - info.tokens / 10) <= 1);
    assert.deepEqual([progress[0], progress.at(-1)], ["tokenize", "done"]);
    for (const s of ["train", "valid", "test"] as const) {
      assert.equal((await loadSplit(root, "fixture", s)).length, info.splits[s]);
      assert.equal((await Deno.stat(join(root, "datasets", "fixture", `${s}.bin`))).size, info.splits[s] * 2);
    }
    const idx = await loadDocumentIndex(root, "fixture");
    assert.equal(idx.length, 21);
    assert.equal(Number(idx[20]), info.tokens);
    assert.match(info.checksum!, /^[0-9a-f]{64}$/);
    const sampler = new Sampler(await loadSplit(root, "fixture", "train"), {
      seqLen: 8,
      batchSize: 2,
      seed: 1,
    });
    assert.equal(sampler.nextBatch().length, 18);
    assert.deepEqual((await listDatasets(root)).map((d) => d.id), ["fixture"]);
    assert.deepEqual((await Array.fromAsync(Deno.readDir(join(root, "datasets")))).map((e) => e.name), [
      "fixture",
    ]);
  });
});

Deno.test("prepareDataset reuses a dataset with the same source and options, and derives stable ids", async () => {
  await withRoot(async (root) => {
    const texts = makeDocs(6, 100, 4);
    const a = await prepareDataset(root, { texts }, SMALL);
    assert.match(a.id, /^texts-[0-9a-f]{8}$/);
    const t0 = performance.now();
    const b = await prepareDataset(root, { texts }, SMALL);
    assert.ok(performance.now() - t0 < 200);
    assert.equal(b.created_at, a.created_at);
    const c = await prepareDataset(root, { texts }, { ...SMALL, min_tokens: 17 });
    assert.notEqual(c.id, a.id);
  });
});

Deno.test("prepareDataset called twice at once for one dataset: the second waits for the first and returns what it published", async () => {
  await withRoot(async (root) => {
    const texts = makeDocs(6, 100, 8);
    const [a, b] = await Promise.all([
      prepareDataset(root, { texts }, SMALL),
      prepareDataset(root, { texts }, SMALL),
    ]);
    assert.equal(a.id, b.id);
    assert.deepEqual(b, a);
    assert.equal((await listDatasets(root)).filter((d) => d.id === a.id).length, 1);
  });
});

Deno.test("prepareDataset on a path counts malformed lines and rejects paths outside the root", async () => {
  await withRoot(async (root) => {
    await Deno.mkdir(join(root, "web"));
    const lines = makeDocs(8, 100, 6).map((text, i) => JSON.stringify({ text, url: `https://e.com/${i}` }));
    await Deno.writeTextFile(
      join(root, "web", "part.jsonl"),
      [...lines, "{broken", '{"no": "text"}'].join("\n"),
    );
    await Deno.writeFile(join(root, "web", "blob.txt"), new Uint8Array([1, 0, 2, 0]));
    const info = await prepareDataset(root, { path: "web" }, SMALL);
    assert.equal(info.documents, 8);
    const merge = (info.stats as { merge: Record<string, number> }).merge;
    assert.equal(merge.malformed_json, 2);
    assert.equal(merge.binary_files, 1);
    assert.equal((await prepareDataset(root, { path: "web" }, SMALL)).id, info.id);
    await Deno.writeTextFile(join(root, "web", "more.txt"), makeDocs(1, 100, 7)[0]);
    const edited = await prepareDataset(root, { path: "web" }, SMALL);
    assert.notEqual(edited.id, info.id);
    assert.equal(edited.documents, 9);
    await assert.rejects(
      () => prepareDataset(root, { path: "../etc" }, SMALL),
      /Path "\.\.\/etc" is outside the data root/,
    );
    await assert.rejects(
      () => prepareDataset(root, { path: "/etc/passwd" }, SMALL),
      /Path "\/etc\/passwd" is outside/,
    );
    await assert.rejects(() => prepareDataset(root, { path: "nope" }, SMALL), /Cannot read "nope"/);
  });
});

Deno.test("prepareDataset failures are clear and leave the previous dataset intact", async () => {
  await withRoot(async (root) => {
    const good = await prepareDataset(root, { texts: makeDocs(6, 100, 8) }, { ...SMALL, id: "keep" });
    const before = await Deno.readFile(join(root, "datasets", "keep", "train.bin"));
    // A named id holding other data is not prepared over without force; a built-in's is not taken.
    await assert.rejects(
      () => prepareDataset(root, { texts: makeDocs(3, 100, 9) }, { ...SMALL, id: "keep" }),
      /^DatasetExistsError: Dataset "keep" exists, prepared from another source or with other options: .*force/,
    );
    await assert.rejects(
      () => prepareDataset(root, { texts: makeDocs(3, 100, 9) }, { ...SMALL, id: "sotu" }),
      /Dataset id "sotu" is a built-in dataset's: choose another id/,
    );
    // With force, a preparation that fails still leaves the previous dataset as it was.
    await assert.rejects(
      () =>
        prepareDataset(root, { texts: makeDocs(3, 30, 9) }, {
          ...SMALL,
          id: "keep",
          seq_len: 1024,
          force: true,
        }),
      /Split "train" gets \d+ tokens .* seq_len \+ 1 = 1025/,
    );
    await assert.rejects(
      () => prepareDataset(root, { texts: ["tiny", "also tiny"] }, { ...SMALL, id: "keep", force: true }),
      /No documents left to train on: 2 read, 0 empty after cleaning, 2 under 16 tokens/,
    );
    assert.deepEqual(await Deno.readFile(join(root, "datasets", "keep", "train.bin")), before);
    assert.equal((await getDataset(root, "keep"))?.checksum, good.checksum);
    assert.deepEqual((await Array.fromAsync(Deno.readDir(join(root, "datasets")))).map((e) => e.name), [
      "keep",
    ]);
    await assert.rejects(
      () => loadSplit(root, "missing", "train"),
      /Split "train" of dataset "missing" not found/,
    );
  });
});

Deno.test("prepareDataset builtin sotu subset prepares from the npm package", async () => {
  await withRoot(async (root) => {
    const info = await prepareDataset(root, { builtin: "sotu" }, {
      max_documents: 3,
      seq_len: 4,
      workers: 1,
    });
    assert.match(info.id, /^sotu-[0-9a-f]{8}$/);
    assert.equal(info.documents, 3);
    assert.ok(info.tokens > 5_000);
    assert.deepEqual(info.source, { builtin: "sotu" });
  });
});
