/**
 * Conversations: OpenAI's fine-tuning format (JSONL lines of `{"messages": [{"role", "content"}]}`),
 * checked line by line, rendered through the chat template into GPT-2 tokens with a mask of the
 * assistant's tokens, and packed into training rows of seq_len + 1 tokens.
 *
 * The template is plain text: "System: …\n", "User: …\n", "Assistant: …<|endoftext|>\n", and a
 * generation prompt "Assistant:". GPT-2's padded vocabulary rows (50,257..50,303) could carry turn
 * markers, but the loss and the sampler exclude them on purpose (they are never learned nor
 * sampled), so markers there would need both kernels changed, start as zero rows the model has
 * never seen, and be unknown to a transformers tokenizer loaded from the checkpoint. Plain role
 * names are words GPT-2 already knows, and the end of an assistant turn is `<|endoftext|>`, the
 * token generation already stops at. Contents are trimmed, so every piece of the template meets
 * the content at a GPT-2 pre-token boundary: tokenizing the pieces one by one (which gives the
 * mask) yields exactly the tokens of the whole rendered text (what transformers'
 * `apply_chat_template(tokenize=True)` computes from `CHAT_TEMPLATE`).
 */
import { encode } from "gpt-tokenizer/encoding/r50k_base";

/** The roles of a conversation. */
export const CHAT_ROLES = ["system", "user", "assistant"] as const;
/** One role. */
export type ChatRole = typeof CHAT_ROLES[number];
/** One turn. */
export interface ChatMessage {
  role: ChatRole;
  content: string;
}

/** GPT-2's end-of-text token: the end of every assistant turn. */
export const CHAT_EOT = 50256;
/** Its text, as transformers' `eos_token`. */
export const CHAT_EOT_TEXT = "<|endoftext|>";

/**
 * The template in transformers' Jinja (saved as `chat_template` in `tokenizer_config.json`). The
 * assistant's content and end-of-text are inside `{% generation %}`, so
 * `return_assistant_tokens_mask=True` gives the mask this module computes.
 */
export const CHAT_TEMPLATE = "{%- for message in messages -%}" +
  "{%- if message['role'] == 'assistant' -%}" +
  "{{- 'Assistant:' -}}{%- generation -%}{{- ' ' + message['content'] | trim + eos_token -}}" +
  "{%- endgeneration -%}{{- '\\n' -}}" +
  "{%- else -%}" +
  "{{- message['role'] | capitalize + ': ' + message['content'] | trim + '\\n' -}}" +
  "{%- endif -%}" +
  "{%- endfor -%}" +
  "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}";

/** Role prefixes of the template. */
const PREFIX: Record<ChatRole, string> = { system: "System: ", user: "User: ", assistant: "Assistant:" };

/** A conversation rendered into tokens. */
export interface ChatTokens {
  /** Token ids. */
  tokens: number[];
  /** Per token: 1 when it belongs to an assistant turn's content or its end-of-text, else 0. */
  mask: number[];
  /** Start offset of every turn (the first is 0). */
  turns: number[];
}

/** The text of `messages` through the template (what transformers renders). */
export function renderChat(messages: readonly ChatMessage[], addGenerationPrompt = false): string {
  let s = "";
  for (const m of messages) {
    s += m.role === "assistant"
      ? `${PREFIX.assistant} ${m.content.trim()}${CHAT_EOT_TEXT}\n`
      : `${PREFIX[m.role]}${m.content.trim()}\n`;
  }
  return addGenerationPrompt ? s + PREFIX.assistant : s;
}

/** Plain-text tokens: `<|endoftext|>` inside a message is text, not the special token. */
function text(s: string): number[] {
  return s ? encode(s, { disallowedSpecial: new Set() }) : [];
}

/** Tokens of `messages` through the template, with the assistant mask and turn starts. */
export function encodeChat(messages: readonly ChatMessage[], addGenerationPrompt = false): ChatTokens {
  const out: ChatTokens = { tokens: [], mask: [], turns: [] };
  const push = (ids: number[], m: 0 | 1) => {
    for (const id of ids) {
      out.tokens.push(id);
      out.mask.push(m);
    }
  };
  for (const m of messages) {
    out.turns.push(out.tokens.length);
    if (m.role === "assistant") {
      push(text(PREFIX.assistant), 0);
      push([...text(" " + m.content.trim()), CHAT_EOT], 1);
      push(text("\n"), 0);
    } else push(text(`${PREFIX[m.role]}${m.content.trim()}\n`), 0);
  }
  if (addGenerationPrompt) push(text(PREFIX.assistant), 0);
  return out;
}

/**
 * What is wrong with `messages`, as `[path, reason]` (path like `messages.2.role`), or undefined.
 * Roles go: an optional system turn first, then user and assistant alternating from user.
 * `prompt`: a chat request, whose last turn must be the user's; otherwise (a training
 * conversation) it needs an assistant turn.
 */
export function checkMessages(messages: unknown, prompt: boolean): [string, string] | undefined {
  if (!Array.isArray(messages)) return ["messages", "Expected an array of messages"];
  if (messages.length === 0) return ["messages", "Expected at least one message"];
  let expect: ChatRole = "user";
  for (const [i, m] of messages.entries()) {
    if (typeof m !== "object" || m === null || Array.isArray(m)) {
      return [`messages.${i}`, "Expected an object with role and content"];
    }
    const { role, content } = m as Record<string, unknown>;
    if (typeof role !== "string" || !(CHAT_ROLES as readonly string[]).includes(role)) {
      return [
        `messages.${i}.role`,
        `Unknown role ${JSON.stringify(role)}: expected "system", "user" or "assistant"`,
      ];
    }
    if (typeof content !== "string" || content.trim() === "") {
      return [`messages.${i}.content`, "Empty content: expected a non-empty string"];
    }
    const ok = role === expect || (role === "system" && i === 0);
    if (!ok) {
      return [
        `messages.${i}.role`,
        `Role "${role}" out of order: expected "${expect}" (an optional system turn first, then user and ` +
        `assistant alternating from user)`,
      ];
    }
    if (role !== "system") expect = role === "user" ? "assistant" : "user";
  }
  const last = (messages[messages.length - 1] as ChatMessage).role;
  if (prompt && last !== "user") {
    return [`messages.${messages.length - 1}.role`, `The last message must be the user's, not "${last}"`];
  }
  if (!prompt && !messages.some((m) => (m as ChatMessage).role === "assistant")) {
    return ["messages", "Conversation without an assistant turn: nothing to train on"];
  }
  return undefined;
}

/** A bad line of a conversation file. */
export interface ChatIssue {
  /** The file, as given. */
  file: string;
  /** Line number, from 1. */
  line: number;
  /** What is wrong (with the field's path). */
  reason: string;
}

/** A conversation read from a file. */
export interface SourceConversation {
  /** Its line, from 1. */
  line: number;
  messages: ChatMessage[];
}

/**
 * Parse a JSONL conversation file: each non-blank line one `{"messages": [...]}`. Lines that are
 * not JSON, have no `messages`, an unknown role, empty content, roles out of order or no assistant
 * turn are returned as issues with file and line, never as conversations.
 */
export function parseChatJsonl(
  text: string,
  file: string,
): { conversations: SourceConversation[]; issues: ChatIssue[] } {
  const conversations: SourceConversation[] = [], issues: ChatIssue[] = [];
  const lines = text.split("\n");
  for (const [i, raw] of lines.entries()) {
    const line = raw.trim();
    if (line === "") continue;
    let value: unknown;
    try {
      value = JSON.parse(line);
    } catch (e) {
      issues.push({ file, line: i + 1, reason: `Not JSON: ${(e as Error).message}` });
      continue;
    }
    if (typeof value !== "object" || value === null || !("messages" in value)) {
      issues.push({
        file,
        line: i + 1,
        reason: 'No "messages": expected {"messages": [{"role", "content"}]}',
      });
      continue;
    }
    const bad = checkMessages((value as { messages: unknown }).messages, false);
    if (bad) {
      issues.push({ file, line: i + 1, reason: `${bad[0]}: ${bad[1]}` });
      continue;
    }
    const messages = (value as { messages: ChatMessage[] }).messages.map((m) => ({
      role: m.role,
      content: m.content,
    }));
    conversations.push({ line: i + 1, messages });
  }
  return { conversations, issues };
}

/** Conversations of one split, tokenized: tokens and mask concatenated, with offsets. */
export interface ChatSplit {
  /** Tokens of all conversations, one after another. */
  tokens: Uint16Array;
  /** Per token, 1 for the assistant's. */
  mask: Uint8Array;
  /** Start offset of each conversation, then the total (conversations + 1 entries). */
  conversations: Uint32Array;
  /** Start offset of each turn (of all conversations, in order). */
  turns: Uint32Array;
}

/** Concatenate tokenized conversations into a {@link ChatSplit}. */
export function joinChats(chats: readonly ChatTokens[]): ChatSplit {
  const total = chats.reduce((s, c) => s + c.tokens.length, 0);
  const nTurns = chats.reduce((s, c) => s + c.turns.length, 0);
  const out: ChatSplit = {
    tokens: new Uint16Array(total),
    mask: new Uint8Array(total),
    conversations: new Uint32Array(chats.length + 1),
    turns: new Uint32Array(nTurns),
  };
  let at = 0, t = 0;
  for (const [i, c] of chats.entries()) {
    out.conversations[i] = at;
    out.tokens.set(c.tokens, at);
    out.mask.set(c.mask, at);
    for (const s of c.turns) out.turns[t++] = at + s;
    at += c.tokens.length;
  }
  out.conversations[chats.length] = at;
  return out;
}

/** Rows packed for training: whole conversations, padded. */
export interface PackedRows {
  /** rows × (seqLen + 1) tokens. */
  tokens: Uint16Array;
  /** rows × seqLen: 1 where the target (the token after position t) is the assistant's. */
  mask: Uint8Array;
  /** Number of rows. */
  rows: number;
  /** Conversations longer than seqLen + 1 tokens, cut at their last turn boundary that fits. */
  cut: number;
  /** Conversations dropped: no assistant token left within seqLen + 1 tokens. */
  dropped: number;
}

/**
 * Pack the conversations of `split` into rows of seqLen + 1 tokens, first fit in order: a
 * conversation never crosses rows; one longer than a row is cut at the last turn start that
 * keeps it within the row (and dropped when nothing of an assistant turn is left); the rest of
 * a row is `<|endoftext|>` with mask 0.
 */
export function packChats(split: ChatSplit, seqLen: number): PackedRows {
  const L = seqLen + 1;
  const pieces: [number, number][] = [];
  let cut = 0, dropped = 0, ti = 0;
  const n = split.conversations.length - 1;
  for (let c = 0; c < n; c++) {
    const start = split.conversations[c], end = split.conversations[c + 1];
    const starts: number[] = [];
    while (ti < split.turns.length && split.turns[ti] < end) starts.push(split.turns[ti++]);
    let stop = end;
    if (end - start > L) {
      stop = start;
      for (const t of starts) if (t - start <= L) stop = t;
      cut++;
    }
    let any = false;
    for (let k = start + 1; k < stop && !any; k++) any = split.mask[k] === 1;
    if (!any) {
      if (stop !== end) cut--;
      dropped++;
      continue;
    }
    pieces.push([start, stop]);
  }
  // First fit over open rows (their free space), in order.
  const rowsFill: number[] = [], rowPieces: [number, number][][] = [];
  for (const p of pieces) {
    const len = p[1] - p[0];
    let r = rowsFill.findIndex((f) => f + len <= L);
    if (r < 0) {
      r = rowsFill.length;
      rowsFill.push(0);
      rowPieces.push([]);
    }
    rowPieces[r].push(p);
    rowsFill[r] += len;
  }
  const rows = rowPieces.length;
  const tokens = new Uint16Array(rows * L).fill(CHAT_EOT), mask = new Uint8Array(rows * seqLen);
  for (let r = 0; r < rows; r++) {
    let at = r * L;
    for (const [s, e] of rowPieces[r]) {
      tokens.set(split.tokens.subarray(s, e), at);
      // Target of position t is token t + 1: its mask, except for a conversation's first token.
      for (let k = s + 1; k < e; k++) mask[r * seqLen + (at - r * L) + (k - s) - 1] = split.mask[k];
      at += e - s;
    }
  }
  return { tokens, mask, rows, cut, dropped };
}

/** One batch of packed rows: B·(seqLen + 1) tokens and B·seqLen target mask. */
export interface PackedBatch {
  tokens: Uint16Array;
  mask: Uint8Array;
}

/** Rows `rows` of `packed` as one batch. */
export function packedBatch(packed: PackedRows, seqLen: number, rows: readonly number[]): PackedBatch {
  const L = seqLen + 1,
    tokens = new Uint16Array(rows.length * L),
    mask = new Uint8Array(rows.length * seqLen);
  rows.forEach((r, b) => {
    tokens.set(packed.tokens.subarray(r * L, (r + 1) * L), b * L);
    mask.set(packed.mask.subarray(r * seqLen, (r + 1) * seqLen), b * seqLen);
  });
  return { tokens, mask };
}

/**
 * Evaluation batches of packed rows, in order: up to `maxBatches` batches of `batchSize` rows
 * (the last rows wrap to the first when the split holds fewer), with the assistant targets counted.
 */
export function packedEvalBatches(
  packed: PackedRows,
  seqLen: number,
  batchSize: number,
  maxBatches: number,
): { batches: PackedBatch[]; tokens: number } {
  if (packed.rows === 0) return { batches: [], tokens: 0 };
  const n = Math.max(1, Math.min(maxBatches, Math.floor(packed.rows / batchSize)));
  const batches: PackedBatch[] = [];
  let tokens = 0;
  for (let i = 0; i < n; i++) {
    const rows = Array.from({ length: batchSize }, (_, b) => (i * batchSize + b) % packed.rows);
    const batch = packedBatch(packed, seqLen, rows);
    for (const m of batch.mask) tokens += m;
    batches.push(batch);
  }
  return { batches, tokens };
}
