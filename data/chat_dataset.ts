/**
 * Chat datasets: a JSONL conversation file (data/chat.ts) prepared into `<root>/datasets/<id>/`.
 *
 * Beside the usual `train.bin`, `valid.bin`, `test.bin` (uint16 tokens of the conversations
 * through the chat template, one after another) each split has `<split>.mask` (uint8 per token,
 * 1 for the assistant's), `<split>.convs` (uint32 start offsets of its conversations, then the
 * total) and `<split>.turns` (uint32 start offsets of every turn), so training can pack whole
 * conversations and cut long ones at a turn boundary for any seq_len. The manifest's `format` is
 * {@link CHAT_DATASET_FORMAT} and it carries the chat template. Bad lines are reported with file
 * and line: `on_error: "skip"` leaves them out (listed in `stats.issues`), `"refuse"` (the
 * default) fails the preparation naming them. Conversations go to the splits by count, in order.
 */
import { createHash } from "node:crypto";
import { join } from "node:path";
import {
  CHAT_TEMPLATE,
  type ChatIssue,
  type ChatSplit,
  encodeChat,
  joinChats,
  parseChatJsonl,
  type SourceConversation,
} from "./chat.ts";
import { parseSplitWeights } from "./split.ts";
import { datasetDir, type DatasetInfo, datasetsDir, type SplitName, SPLITS } from "./store.ts";

/** The manifest `format` of a chat dataset. */
export const CHAT_DATASET_FORMAT = "gpt2-webgpu-chat/1";
/** Split weights of a chat dataset by default (by conversations). */
export const CHAT_DEFAULT_SPLIT: readonly [number, number, number] = [90, 10, 0];
/** Largest conversation file read, in bytes. */
const MAX_CHAT_FILE_BYTES = 256 << 20;

/** What to do with a bad line. */
export type ChatOnError = "skip" | "refuse";

/** Whether a dataset's manifest says it holds conversations. */
export function isChatDataset(info: DatasetInfo | undefined): boolean {
  return info?.format === CHAT_DATASET_FORMAT;
}

/** Error of a refused preparation: the bad lines, each with file and line. */
export class ChatDatasetError extends Error {
  /** The bad lines (all of them). */
  readonly issues: ChatIssue[];
  /** An error listing the first issues. */
  constructor(id: string, issues: ChatIssue[]) {
    const listed = issues.slice(0, 10).map((i) => `"${i.file}" line ${i.line}: ${i.reason}`).join("; ");
    super(
      `Cannot prepare chat dataset "${id}": ${issues.length} bad line${
        issues.length === 1 ? "" : "s"
      } (${listed}` +
        `${issues.length > 10 ? ` and ${issues.length - 10} more` : ""}); nothing was published. ` +
        `Fix them, or set on_error to "skip" to leave them out`,
    );
    this.name = "ChatDatasetError";
    this.issues = issues;
  }
}

/** What {@link prepareChatDataset} needs of the plan. */
export interface ChatPlan {
  id: string;
  /** Real path of the JSONL file. */
  resolvedPath: string;
  /** The file as the caller named it (in issues). */
  file: string;
  sourceKey: string;
  describe: Record<string, unknown>;
  /** Split weights. */
  split: readonly number[] | string;
  onError: ChatOnError;
}

/** Prepare (or reuse, same source key unless `force`) the chat dataset of `plan`. */
export async function prepareChatDataset(root: string, plan: ChatPlan, force = false): Promise<DatasetInfo> {
  const started = performance.now();
  const final = datasetDir(root, plan.id);
  if (!force) {
    const old = await Deno.readTextFile(join(final, "manifest.json")).then((t) => JSON.parse(t)).catch(() =>
      undefined
    );
    if (old?.source_key === plan.sourceKey) return old as DatasetInfo;
  }
  const size = (await Deno.stat(plan.resolvedPath)).size;
  if (size > MAX_CHAT_FILE_BYTES) {
    throw new Error(
      `Conversation file "${plan.file}" is ${size} bytes, over the ${MAX_CHAT_FILE_BYTES} limit`,
    );
  }
  const { conversations, issues } = parseChatJsonl(await Deno.readTextFile(plan.resolvedPath), plan.file);
  for (const i of issues) console.warn(`Dataset "${plan.id}": "${i.file}" line ${i.line}: ${i.reason}`);
  if (issues.length > 0 && plan.onError === "refuse") throw new ChatDatasetError(plan.id, issues);
  if (conversations.length === 0) {
    throw new Error(`No conversations left to train on in "${plan.file}": ${issues.length} bad lines`);
  }
  const parts = splitConversations(conversations, plan.split);
  const work = join(datasetsDir(root), `.work-${plan.id}-${plan.sourceKey}`), out = join(work, "out");
  await Deno.mkdir(out, { recursive: true });
  try {
    const files: Record<string, { bytes: number; sha256: string }> = {};
    const all = createHash("sha256");
    const splits = { train: 0, valid: 0, test: 0 };
    let tokens = 0, assistant = 0;
    for (const [i, name] of SPLITS.entries()) {
      const s = joinChats(parts[i].map((c) => encodeChat(c.messages)));
      splits[name] = s.tokens.length;
      tokens += s.tokens.length;
      for (const m of s.mask) assistant += m;
      const write = async (file: string, data: ArrayBufferView, combined = false) => {
        const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
        await Deno.writeFile(join(out, file), bytes);
        if (combined) all.update(bytes);
        files[file] = { bytes: bytes.length, sha256: createHash("sha256").update(bytes).digest("hex") };
      };
      await write(`${name}.bin`, s.tokens, true);
      await write(`${name}.mask`, s.mask);
      await write(`${name}.convs`, s.conversations);
      await write(`${name}.turns`, s.turns);
    }
    const info: DatasetInfo & { source_key: string; chat_template: string } = {
      id: plan.id,
      documents: conversations.length,
      tokens,
      splits,
      format: CHAT_DATASET_FORMAT,
      source: plan.describe,
      tokenizer: { name: "gpt2 (r50k_base)", vocab_size: 50257, eot: 50256, dtype: "uint16" },
      options: { split: parseSplitWeights(plan.split).join(","), on_error: plan.onError },
      stats: {
        conversations: conversations.length,
        conversations_per_split: parts.map((p) => p.length),
        assistant_tokens: assistant,
        lines_skipped: issues.length,
        issues: issues.slice(0, 100),
      },
      files,
      checksum: all.digest("hex"),
      created_at: new Date().toISOString(),
      seconds: Math.round((performance.now() - started) / 10) / 100,
      source_key: plan.sourceKey,
      chat_template: CHAT_TEMPLATE,
    };
    await Deno.writeTextFile(join(out, "manifest.json"), JSON.stringify(info, null, 2) + "\n");
    await Deno.remove(final, { recursive: true }).catch(() => {});
    await Deno.rename(out, final);
    return info;
  } finally {
    await Deno.remove(work, { recursive: true }).catch(() => {});
  }
}

/** Conversations to train, valid, test by the weights, in order (a positive weight gets at least one when there are enough). */
function splitConversations(list: SourceConversation[], split: readonly number[] | string) {
  const w = parseSplitWeights(split), sum = w[0] + w[1] + w[2], n = list.length;
  let valid = Math.round((n * w[1]) / sum), test = Math.round((n * w[2]) / sum);
  if (w[1] > 0 && valid === 0 && n - test > 1) valid = 1;
  if (w[2] > 0 && test === 0 && n - valid > 1) test = 1;
  const train = n - valid - test;
  if (train < 1) throw new Error(`Split "${w.join(",")}" leaves no conversation of ${n} to train on`);
  return [list.slice(0, train), list.slice(train, train + valid), list.slice(train + valid)];
}

/** Load one split of a chat dataset. */
export async function loadChatSplit(root: string, id: string, split: SplitName): Promise<ChatSplit> {
  const dir = datasetDir(root, id);
  const read = async (ext: string) => {
    try {
      return await Deno.readFile(join(dir, `${split}.${ext}`));
    } catch (e) {
      throw new Error(`Cannot read split "${split}" of chat dataset "${id}": ${(e as Error).message}`);
    }
  };
  const [t, m, c, u] = await Promise.all([read("bin"), read("mask"), read("convs"), read("turns")]);
  const split_: ChatSplit = {
    tokens: new Uint16Array(t.buffer, t.byteOffset, t.byteLength / 2),
    mask: m,
    conversations: new Uint32Array(c.buffer, c.byteOffset, c.byteLength / 4),
    turns: new Uint32Array(u.buffer, u.byteOffset, u.byteLength / 4),
  };
  if (split_.mask.length !== split_.tokens.length) {
    throw new Error(`Split "${split}" of chat dataset "${id}" is corrupt: mask and tokens differ in length`);
  }
  return split_;
}
