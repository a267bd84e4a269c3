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
import type { TrainConfig } from "../../model/job.ts";
import { reshardCheckpoint } from "../../checkpoint/reshard.ts";
import { CHAT_TEMPLATE, type ChatMessage, encodeChat, prepareDataset, renderChat } from "../../data/mod.ts";
import { resolveModelSource } from "../../checkpoint/model_source.ts";
import { runTraining } from "../../worker/train_loop.ts";
import { initParams } from "../reference/cpu_gpt2.ts";
import { noGpu, testContext } from "../_helpers.ts";

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

const PY = `
import json, sys
from transformers import AutoTokenizer
req = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained("gpt2")
tok.chat_template = req["template"]
out = []
for messages in req["conversations"]:
    r = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    out.append({"ids": list(r["input_ids"]), "mask": list(r["assistant_masks"])})
    p = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    out[-1]["prompt"] = list(p)
print(json.dumps(out))
`;

Deno.test({
  name: "transformers' apply_chat_template on the saved template gives our tokens and assistant mask",
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
    const child = new Deno.Command("python3", {
      args: ["-c", PY],
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
    for (const [i, messages] of conversations.entries()) {
      const ours = encodeChat(messages);
      assert.deepEqual(got[i].ids, ours.tokens, `conversation ${i} tokens`);
      assert.deepEqual(got[i].mask, ours.mask, `conversation ${i} assistant mask`);
      assert.deepEqual(
        got[i].prompt,
        encodeChat(messages, true).tokens,
        `conversation ${i} generation prompt`,
      );
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
