/**
 * The chat template kept with the model: a checkpoint saved with one has it as `chat_template` in
 * `tokenizer_config.json` (and its manifest), resharding to any tensor-parallel size keeps it, a
 * job fine-tuned with init_from from such a model saves it again, and transformers'
 * `apply_chat_template` on it gives our tokens and assistant mask. That last test runs only where
 * Python with transformers and the `gpt2` tokenizer (cached, or downloadable) exist; it is
 * skipped elsewhere (it was skipped where this was written: no transformers there). Where only
 * Python's jinja2 exists (as there), the template is rendered as transformers renders it
 * (trim_blocks, lstrip_blocks, `{% generation %}` rendering its body) and compared with ours.
 */
import assert from "node:assert/strict";
import { presetConfig } from "../../model/config.ts";
import { readChatTemplate, saveCheckpoint } from "../../checkpoint/checkpoint.ts";
import type { TrainConfig } from "../../job/job.ts";
import { reshardCheckpoint } from "../../checkpoint/reshard.ts";
import { CHAT_TEMPLATE, type ChatMessage, encodeChat, prepareDataset, renderChat } from "../../data/mod.ts";
import { resolveModelSource } from "../../checkpoint/model_source.ts";
import { runTraining } from "../../worker/train_loop.ts";
import { initParams } from "../reference/cpu_gpt2.ts";
import { noGpu, testContext } from "../_helpers.ts";
import bpeRanks from "gpt-tokenizer/bpeRanks/r50k_base";
import { encode } from "gpt-tokenizer/encoding/r50k_base";

const FIXTURE = new URL("../fixtures/chat_small.jsonl", import.meta.url).pathname;
const tiny = presetConfig("gpt2-tiny");

const train: TrainConfig = {
  model: "gpt2-tiny",
  dataset: "chat",
  split: "90,10,0",
  train_iters: 2,
  batch_size: 2,
  seq_len: 16,
  lr: 1e-3,
  min_lr: 1e-4,
  lr_decay_style: "constant",
  warmup: 0,
  weight_decay: 0.1,
  clip_grad: 1,
  attention_dropout: 0,
  hidden_dropout: 0,
  seed: 1,
  log_interval: 1,
  eval_interval: 0,
  eval_iters: 1,
  save_interval: 0,
  keep_checkpoints: 2,
};

/** A gpt2-tiny checkpoint of `job` saved with the chat template. */
async function chatCheckpoint(root: string, job: string) {
  const params = initParams(tiny, 4);
  const zeros = new Float32Array(params.length);
  return await saveCheckpoint(
    `${root}/checkpoints/${job}`,
    {
      job_id: job,
      model: tiny,
      train: { ...train, objective: "sft", init_from: "x" },
      sampler: { epoch: 0, position: 0 },
      metrics: { loss: null, val_loss: null },
      chat_template: CHAT_TEMPLATE,
    },
    { step: 3, params, m: zeros, v: zeros },
    2,
  );
}

Deno.test("A checkpoint saved with a chat template has it in tokenizer_config.json, and resharding keeps it", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_chat_tpl_" });
  try {
    const ck = await chatCheckpoint(root, "job_c");
    const zeros = initParams(tiny, 1).length;
    const tc = JSON.parse(await Deno.readTextFile(`${ck.path}/tokenizer_config.json`));
    assert.equal(tc.chat_template, CHAT_TEMPLATE);
    assert.equal(tc.tokenizer_class, "GPT2Tokenizer");
    const r2 = await reshardCheckpoint(ck.path, `${root}/out/tp2`, 2);
    const r1 = await reshardCheckpoint(r2.path, `${root}/out/tp1`, 1);
    for (const dir of [r2.path, r1.path]) assert.equal(await readChatTemplate(dir), CHAT_TEMPLATE, dir);
    const manifest = JSON.parse(await Deno.readTextFile(`${r2.path}/manifest.json`));
    assert.equal(manifest.chat_template, CHAT_TEMPLATE);
    // A checkpoint without one has no tokenizer_config.json.
    const plain = await saveCheckpoint(
      `${root}/checkpoints/job_p`,
      {
        job_id: "job_p",
        model: tiny,
        train,
        sampler: { epoch: 0, position: 0 },
        metrics: { loss: null, val_loss: null },
      },
      { step: 1, params: initParams(tiny, 1), m: new Float32Array(zeros), v: new Float32Array(zeros) },
      2,
    );
    assert.equal(await readChatTemplate(plain.path), undefined);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});

Deno.test({
  name: "A job fine-tuned with init_from from a model with a chat template keeps it (objective lm)",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_chat_init_" });
    try {
      await chatCheckpoint(root, "job_src");
      await prepareDataset(root, { path: FIXTURE }, { format: "chat", allow_any_path: true, id: "chat" });
      const source = await resolveModelSource(root, "job_src");
      const ctx = (await testContext())!;
      const done = await runTraining(ctx, {
        id: "job_ft",
        config: { ...train, init_from: "job_src" },
        root,
        checkpoint_dir: `${root}/checkpoints/job_ft`,
        resume_path: null,
        init_source: source,
      }, { post: () => {}, cancelled: () => false });
      assert.equal(done.status, "succeeded", done.error ?? "");
      const ft = await resolveModelSource(root, "job_ft");
      assert.equal(await readChatTemplate(ft.path), CHAT_TEMPLATE);
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});

/** Whether `python3` can import `module`. */
function hasPython(module: string): boolean {
  try {
    const r = new Deno.Command("python3", {
      args: ["-c", `import ${module}`],
      stdout: "null",
      stderr: "null",
    })
      .outputSync();
    return r.success;
  } catch {
    return false;
  }
}

/**
 * GPT-2's `vocab.json` and `merges.txt` written into `dir` from gpt-tokenizer's r50k_base ranks
 * (the same BPE the service encodes with), so transformers loads a GPT-2 tokenizer offline: rank
 * r's token is `vocab[bytes]`, and its merge is the pair BPE reaches on those bytes with the
 * ranks below r (the two parts that become it last).
 */
async function writeGpt2Vocab(dir: string): Promise<void> {
  const ranks = (bpeRanks as unknown as (string | number[])[]).map((t) =>
    typeof t === "string" ? new TextEncoder().encode(t) : Uint8Array.from(t)
  );
  // GPT-2's byte-to-unicode table: printable bytes stand for themselves, the rest from U+0100 on.
  const printable = (b: number) => (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  const uni: string[] = [];
  for (let b = 0, extra = 0; b < 256; b++) uni[b] = String.fromCharCode(printable(b) ? b : 256 + extra++);
  const text = (bytes: Uint8Array) => Array.from(bytes, (b) => uni[b]).join("");
  const rankOf = new Map(ranks.map((bytes, r) => [text(bytes), r]));
  const vocab: Record<string, number> = {};
  const merges: string[] = [];
  for (const [r, bytes] of ranks.entries()) {
    vocab[text(bytes)] = r;
    if (r < 256) continue;
    let parts = Array.from(bytes, (b) => uni[b]);
    while (parts.length > 2) {
      let best = -1, bestRank = Infinity;
      for (let i = 0; i + 1 < parts.length; i++) {
        const m = rankOf.get(parts[i] + parts[i + 1]);
        if (m !== undefined && m < r && m < bestRank) [best, bestRank] = [i, m];
      }
      if (best < 0) throw new Error(`No merge path to rank ${r}`);
      parts = [...parts.slice(0, best), parts[best] + parts[best + 1], ...parts.slice(best + 2)];
    }
    merges.push(parts.join(" "));
  }
  vocab["<|endoftext|>"] = 50256;
  await Deno.writeTextFile(`${dir}/vocab.json`, JSON.stringify(vocab));
  await Deno.writeTextFile(`${dir}/merges.txt`, ["#version: 0.2", ...merges].join("\n") + "\n");
}

const PY = `
import json, sys
from transformers import AutoTokenizer
req = json.load(sys.stdin)
# The checkpoint's own tokenizer_config.json (its chat_template), with GPT-2's vocabulary beside it.
tok = AutoTokenizer.from_pretrained(req["dir"])
assert tok.chat_template == req["template"], "the saved chat_template was not the one loaded"
out = {"probe": tok(req["probe"])["input_ids"], "conversations": []}
for messages in req["conversations"]:
    r = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    o = {"ids": list(r["input_ids"]), "mask": list(r["assistant_masks"])}
    p = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    o["prompt"] = list(p["input_ids"])
    out["conversations"].append(o)
print(json.dumps(out))
`;

Deno.test({
  name:
    "transformers' apply_chat_template on a saved checkpoint's tokenizer_config.json gives our tokens and assistant mask",
  ignore: !hasPython("transformers"),
  fn: async () => {
    const conversations: ChatMessage[][] = [
      [
        { role: "system", content: "You are terse." },
        { role: "user", content: "  What color is the sky?\n" },
        { role: "assistant", content: "Blue, mostly." },
        { role: "user", content: "And grass? It's green, isn't it?" },
        { role: "assistant", content: " Green.  " },
      ],
      [{ role: "user", content: "2+2=?" }, { role: "assistant", content: "4" }],
    ];
    const root = await Deno.makeTempDir({ prefix: "gpt2_chat_hf_" });
    try {
      const ck = await chatCheckpoint(root, "job_hf");
      await writeGpt2Vocab(ck.path);
      // Plain text (no special tokens: ours encodes <|endoftext|> only where the template puts it).
      const probe = "Hello world: naïve café, 12345 tokens and   spaces\n";
      const child = new Deno.Command("python3", {
        args: ["-c", PY],
        env: { HF_HUB_OFFLINE: "1", TRANSFORMERS_OFFLINE: "1" },
        stdin: "piped",
        stdout: "piped",
        stderr: "piped",
      }).spawn();
      const w = child.stdin.getWriter();
      await w.write(
        new TextEncoder().encode(
          JSON.stringify({ dir: ck.path, template: CHAT_TEMPLATE, probe, conversations }),
        ),
      );
      await w.close();
      const out = await child.output();
      assert.ok(out.success, new TextDecoder().decode(out.stderr));
      const got = JSON.parse(new TextDecoder().decode(out.stdout));
      // The vocabulary written here tokenizes as ours does (so the comparisons below test the template).
      assert.deepEqual(got.probe, encode(probe));
      for (const [i, messages] of conversations.entries()) {
        const ours = encodeChat(messages);
        assert.deepEqual(got.conversations[i].ids, ours.tokens, `conversation ${i} tokens`);
        assert.deepEqual(got.conversations[i].mask, ours.mask, `conversation ${i} assistant mask`);
        assert.deepEqual(
          got.conversations[i].prompt,
          encodeChat(messages, true).tokens,
          `conversation ${i} generation prompt`,
        );
      }
    } finally {
      await Deno.remove(root, { recursive: true });
    }
  },
});

const JINJA = `
import json, sys, jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
class Generation(Extension):
    tags = {"generation"}
    def parse(self, parser):
        next(parser.stream)
        return nodes.Scope(parser.parse_statements(["name:endgeneration"], drop_needle=True))
req = json.load(sys.stdin)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
t = env.from_string(req["template"])
print(json.dumps([[t.render(messages=m, eos_token="<|endoftext|>", add_generation_prompt=g) for g in (False, True)]
                  for m in req["conversations"]]))
`;

Deno.test({
  name:
    "The Jinja chat template renders, as transformers' environment renders it, the text renderChat() gives",
  ignore: !hasPython("jinja2"),
  fn: async () => {
    const conversations: ChatMessage[][] = [
      [
        { role: "system", content: "You are terse." },
        { role: "user", content: "  What color is the sky?\n" },
        { role: "assistant", content: "Blue, mostly." },
        { role: "user", content: "And grass?" },
        { role: "assistant", content: " Green.  " },
      ],
      [{ role: "user", content: "2+2=?" }],
    ];
    const child = new Deno.Command("python3", {
      args: ["-c", JINJA],
      stdin: "piped",
      stdout: "piped",
      stderr: "piped",
    })
      .spawn();
    const w = child.stdin.getWriter();
    await w.write(new TextEncoder().encode(JSON.stringify({ template: CHAT_TEMPLATE, conversations })));
    await w.close();
    const out = await child.output();
    assert.ok(out.success, new TextDecoder().decode(out.stderr));
    const got = JSON.parse(new TextDecoder().decode(out.stdout));
    assert.deepEqual(got, conversations.map((m) => [renderChat(m), renderChat(m, true)]));
  },
});
