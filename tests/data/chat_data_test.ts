/**
 * Tests of conversation datasets (data/chat.ts, data/chat_dataset.ts): the template's tokens and
 * assistant mask, bad lines reported with file and line and skipped or refused as `on_error`
 * says (library, CLI and `POST /datasets`), roles out of order named by path, and packing that
 * never crosses conversations and cuts long ones at a turn boundary.
 */
import assert from "node:assert/strict";
import { join } from "node:path";
import { Hono } from "hono";
import { decode, encode } from "gpt-tokenizer/encoding/r50k_base";
import {
  CHAT_EOT,
  type ChatMessage,
  checkMessages,
  encodeChat,
  joinChats,
  loadChatSplit,
  packChats,
  PackedSampler,
  parseChatJsonl,
  prepareDataset,
  renderChat,
} from "../../data/mod.ts";
import { main as dataCli } from "../../data/cli.ts";
import { datasetRoutes } from "../../server/routes/datasets.ts";
import { withRoot } from "../data_fixtures.ts";

const FIXTURE = new URL("../fixtures/chat_small.jsonl", import.meta.url).pathname;

const CONV: ChatMessage[] = [
  { role: "system", content: "You are terse." },
  { role: "user", content: "  What color is the sky?\n" },
  { role: "assistant", content: "Blue, mostly." },
  { role: "user", content: "And grass?" },
  { role: "assistant", content: " Green. " },
];

/** Tokens of rendered text, `<|endoftext|>` as the special token (what transformers does). */
function encodeRendered(s: string): number[] {
  const out: number[] = [];
  for (const [i, part] of s.split("<|endoftext|>").entries()) {
    if (i > 0) out.push(CHAT_EOT);
    if (part) out.push(...encode(part));
  }
  return out;
}

Deno.test("encodeChat() tokens equal the rendered template's and the mask covers assistant content and end-of-text", () => {
  const c = encodeChat(CONV);
  assert.equal(
    renderChat(CONV),
    "System: You are terse.\nUser: What color is the sky?\nAssistant: Blue, mostly.<|endoftext|>\n" +
      "User: And grass?\nAssistant: Green.<|endoftext|>\n",
  );
  assert.deepEqual(c.tokens, encodeRendered(renderChat(CONV)));
  const masked = c.tokens.filter((_, i) => c.mask[i] === 1);
  assert.equal(decode(masked), " Blue, mostly.<|endoftext|> Green.<|endoftext|>");
  assert.equal(c.turns.length, 5);
  assert.equal(c.turns[0], 0);
  // Each turn starts where the previous one's text ends.
  assert.equal(decode(c.tokens.slice(c.turns[2], c.turns[3])), "Assistant: Blue, mostly.<|endoftext|>\n");
  const prompt = encodeChat(CONV.slice(0, 2), true);
  assert.deepEqual(prompt.tokens, encodeRendered(renderChat(CONV.slice(0, 2), true)));
  assert.ok(renderChat(CONV.slice(0, 2), true).endsWith("\nAssistant:"));
});

Deno.test("parseChatJsonl() reports each bad line with file and line and keeps the good ones", () => {
  const text = [
    JSON.stringify({ messages: [{ role: "user", content: "hi" }, { role: "assistant", content: "hello" }] }),
    JSON.stringify({ conversation: [] }),
    JSON.stringify({ messages: [{ role: "robot", content: "hi" }, { role: "assistant", content: "x" }] }),
    "",
    JSON.stringify({ messages: [{ role: "user", content: "  " }, { role: "assistant", content: "x" }] }),
    JSON.stringify({ messages: [{ role: "system", content: "s" }, { role: "user", content: "u" }] }),
    "{not json",
  ].join("\n");
  const { conversations, issues } = parseChatJsonl(text, "chats.jsonl");
  assert.deepEqual(conversations.map((c) => c.line), [1]);
  assert.deepEqual(issues.map((i) => [i.file, i.line]), [
    ["chats.jsonl", 2],
    ["chats.jsonl", 3],
    ["chats.jsonl", 5],
    ["chats.jsonl", 6],
    ["chats.jsonl", 7],
  ]);
  assert.match(issues[0].reason, /No "messages"/);
  assert.match(issues[1].reason, /^messages\.0\.role: Unknown role "robot"/);
  assert.match(issues[2].reason, /^messages\.0\.content: Empty content/);
  assert.match(issues[3].reason, /without an assistant turn/);
  assert.match(issues[4].reason, /^Not JSON/);
});

Deno.test("checkMessages() names messages.N.role for roles out of order in a chat request", () => {
  const u = (content: string) => ({ role: "user", content });
  const a = (content: string) => ({ role: "assistant", content });
  assert.equal(checkMessages([u("hi")], true), undefined);
  assert.equal(
    checkMessages([{ role: "system", content: "s" }, u("hi"), a("yo"), u("and?")], true),
    undefined,
  );
  assert.equal(checkMessages([u("hi"), u("again")], true)?.[0], "messages.1.role");
  assert.equal(
    checkMessages([u("hi"), a("yo"), { role: "system", content: "s" }, u("x")], true)?.[0],
    "messages.2.role",
  );
  assert.equal(checkMessages([a("first")], true)?.[0], "messages.0.role");
  assert.equal(checkMessages([u("hi"), a("yo")], true)?.[0], "messages.1.role");
});

Deno.test("packChats() packs whole conversations, pads with end-of-text and cuts a long one at a turn boundary", () => {
  const short = encodeChat([{ role: "user", content: "Hi" }, { role: "assistant", content: "Hello there." }]);
  const long = encodeChat([
    { role: "user", content: "Tell me a long story about the sea and the wind." },
    { role: "assistant", content: "Once upon a time." },
    { role: "user", content: "More, please, with many more words in it than fit." },
    { role: "assistant", content: "The wind blew over the sea for days and days and days without end." },
  ]);
  const noAnswer = encodeChat([
    { role: "user", content: "One two three four five six seven eight nine ten eleven twelve thirteen" },
    { role: "assistant", content: "ok" },
  ]);
  const seqLen = long.turns[2] + 2; // the long one's first two turns fit, not the third
  assert.ok(long.tokens.length > seqLen + 1 && short.tokens.length * 2 <= seqLen + 1);
  assert.ok(noAnswer.turns[1] > seqLen + 1 || noAnswer.tokens.length <= seqLen + 1);
  const split = joinChats([short, long, short]);
  const p = packChats(split, seqLen);
  assert.equal(p.cut, 1);
  assert.equal(p.dropped, 0);
  const L = seqLen + 1;
  // Row 0: short, short (first fit), then padding; row 1: the long one's first two turns.
  assert.equal(p.rows, 2);
  assert.deepEqual([...p.tokens.subarray(0, short.tokens.length)], short.tokens);
  assert.deepEqual(
    [...p.tokens.subarray(short.tokens.length, 2 * short.tokens.length)],
    short.tokens,
  );
  assert.ok(p.tokens.subarray(2 * short.tokens.length, L).every((t) => t === CHAT_EOT));
  assert.deepEqual([...p.tokens.subarray(L, L + long.turns[2])], long.tokens.slice(0, long.turns[2]));
  // The mask of target t is the mask of token t + 1, 0 for a conversation's first token and padding.
  for (let t = 0; t < seqLen; t++) {
    const k = t + 1;
    const want = k < short.tokens.length
      ? short.mask[k]
      : k === short.tokens.length
      ? 0
      : k < 2 * short.tokens.length
      ? short.mask[k - short.tokens.length]
      : 0;
    assert.equal(p.mask[t], want, `row 0 target ${t}`);
  }
  const assistantTargets = p.mask.reduce((s, m) => s + m, 0);
  const expected = 2 * short.mask.reduce((s, m) => s + m, 0) +
    long.mask.slice(0, long.turns[2]).reduce((s, m) => s + m, 0);
  assert.equal(assistantTargets, expected);
  // A conversation whose first assistant turn starts past the row is dropped, and counted.
  const tiny = packChats(joinChats([long]), long.turns[1] - 1);
  assert.deepEqual([tiny.rows, tiny.cut, tiny.dropped], [0, 0, 1]);
});

/** A conversation file with a bad line of each kind after two good ones. */
const BAD_FILE = [
  JSON.stringify({ messages: [{ role: "user", content: "Hi" }, { role: "assistant", content: "Hello." }] }),
  JSON.stringify({
    messages: [{ role: "user", content: "Bye" }, { role: "assistant", content: "Bye now." }],
  }),
  JSON.stringify({ text: "no messages here" }),
  JSON.stringify({ messages: [{ role: "wizard", content: "x" }, { role: "assistant", content: "y" }] }),
  JSON.stringify({ messages: [{ role: "user", content: "" }, { role: "assistant", content: "y" }] }),
  JSON.stringify({ messages: [{ role: "user", content: "only a question" }] }),
].join("\n") + "\n";

Deno.test("prepareDataset() with format chat refuses bad lines by default and skips them with on_error skip", async () => {
  await withRoot(async (root) => {
    const path = join(root, "bad.jsonl");
    await Deno.writeTextFile(path, BAD_FILE);
    await assert.rejects(
      () => prepareDataset(root, { path }, { format: "chat", allow_any_path: true, id: "bad" }),
      (e: Error) => {
        for (const line of [3, 4, 5, 6]) assert.match(e.message, new RegExp(`"${path}" line ${line}: `));
        assert.match(e.message, /4 bad lines/);
        return true;
      },
    );
    const info = await prepareDataset(root, { path }, {
      format: "chat",
      allow_any_path: true,
      id: "bad",
      on_error: "skip",
      split: "1,0,0",
    });
    assert.equal(info.documents, 2);
    const stats = info.stats as { lines_skipped: number; issues: { line: number }[] };
    assert.equal(stats.lines_skipped, 4);
    assert.deepEqual(stats.issues.map((i) => i.line), [3, 4, 5, 6]);
    const train = await loadChatSplit(root, "bad", "train");
    assert.equal(train.conversations.length, 3);
    assert.equal(train.tokens.length, info.tokens);
    assert.equal(
      decode([...train.tokens]),
      renderChat(parseChatJsonl(BAD_FILE, "x").conversations.flatMap((c) => c.messages)),
    );
  });
});

Deno.test("The data CLI prepares the shipped conversation file with --format chat", async () => {
  await withRoot(async (root) => {
    const log = console.log, out: string[] = [];
    console.log = (s: string) => out.push(s);
    try {
      const code = await dataCli([
        "prepare",
        "--path",
        FIXTURE,
        "--format",
        "chat",
        "--id",
        "chat",
        "--root",
        root,
      ]);
      assert.equal(code, 0);
    } finally {
      console.log = log;
    }
    const summary = JSON.parse(out[0]);
    assert.equal(summary.documents, 24);
    const manifest = JSON.parse(await Deno.readTextFile(join(root, "datasets", "chat", "manifest.json")));
    assert.equal(manifest.format, "gpt2-webgpu-chat/1");
    assert.deepEqual(manifest.stats.conversations_per_split, [22, 2, 0]);
  });
});

Deno.test("POST /datasets with format chat answers 422 naming file and line, or 201 skipping them", async () => {
  await withRoot(async (root) => {
    const sources = join(root, "sources");
    await Deno.mkdir(sources);
    await Deno.writeTextFile(join(sources, "chats.jsonl"), BAD_FILE);
    const app = new Hono().route("/", datasetRoutes(root, { workers: 1, waitMs: 30_000, sources }));
    const post = (body: unknown) =>
      app.request("/datasets", {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
      });
    const refused = await post({ path: "chats.jsonl", format: "chat", id: "c1" });
    assert.equal(refused.status, 422);
    const msg = (await refused.json()).error.message as string;
    assert.match(msg, /"chats\.jsonl" line 3: No "messages"/);
    assert.match(msg, /"chats\.jsonl" line 4: messages\.0\.role: Unknown role "wizard"/);
    assert.match(msg, /"chats\.jsonl" line 5: messages\.0\.content: Empty content/);
    assert.match(msg, /"chats\.jsonl" line 6: messages: Conversation without an assistant turn/);
    const ok = await post({
      path: "chats.jsonl",
      format: "chat",
      id: "c2",
      on_error: "skip",
      split: [1, 0, 0],
    });
    assert.equal(ok.status, 201);
    const body = await ok.json();
    assert.equal(body.documents, 2);
    assert.equal(body.stats.lines_skipped, 4);
    const bad = await post({ texts: ["x"], format: "chat" });
    assert.equal(bad.status, 400);
  });
});

Deno.test("PackedSampler draws whole packed rows with their masks and resumes from its state", () => {
  const chats = Array.from(
    { length: 12 },
    (_, i) =>
      encodeChat([{ role: "user", content: `Question ${i}?` }, {
        role: "assistant",
        content: `Answer ${i}.`,
      }]),
  );
  const seqLen = 24;
  const packed = packChats(joinChats(chats), seqLen);
  assert.ok(packed.rows >= 4);
  const opts = { seqLen, batchSize: 2, seed: 9, onEpoch: () => {} };
  const a = new PackedSampler(packed, opts);
  const rowsOf = (b: { tokens: Uint16Array; mask: Uint8Array }) =>
    [0, 1].map((r) => {
      const toks = b.tokens.subarray(r * (seqLen + 1), (r + 1) * (seqLen + 1));
      const row = [...Array(packed.rows).keys()].find((k) =>
        packed.tokens.subarray(k * (seqLen + 1), (k + 1) * (seqLen + 1)).every((t, i) => t === toks[i])
      );
      assert.notEqual(row, undefined, "a batch row is a packed row");
      assert.deepEqual(
        b.mask.subarray(r * seqLen, (r + 1) * seqLen),
        packed.mask.subarray(row! * seqLen, (row! + 1) * seqLen),
      );
      return row!;
    });
  const first = [a.nextBatch(), a.nextBatch()].flatMap(rowsOf);
  assert.equal(new Set(first).size, 4, "an epoch draws each row once");
  const state = a.state;
  const next = rowsOf(a.nextBatch());
  assert.deepEqual(rowsOf(new PackedSampler(packed, opts, state).nextBatch()), next);
});
