/// <reference lib="dom" />
/**
 * Chat fine-tuning end to end on the real server (issue 42): a gpt2-tiny SFT job (init_from a
 * Hugging Face-shaped folder the test writes, the shipped conversation file
 * tests/fixtures/chat_small.jsonl) trains, reports its packing, and saves a checkpoint whose
 * `tokenizer_config.json` carries the chat template; the checkpoint answers
 * `/v1/chat/completions` through the official openai npm client, streamed and not, with n,
 * seed, logprobs and stop; a model without a template is a 400 naming `model`, roles out of
 * order one naming `messages.N.role`; where Chromium is installed, the playground's chat mode
 * holds a two-turn conversation with it. Runs on the test adapter (lavapipe on CI), skipped without.
 */
import assert from "node:assert/strict";
// Test-only, pinned in tests/deno.lock (see tests/web/browser_test.ts).
// deno-lint-ignore no-import-prefix
import OpenAI from "npm:openai@7.60.0";
// Test-only, pinned in tests/deno.lock (see tests/web/browser_test.ts).
// deno-lint-ignore no-import-prefix
import puppeteer from "npm:puppeteer-core@25.16.0";
import { presetConfig } from "../../model/config.ts";
import { exportTensors, hfConfig } from "../../checkpoint/checkpoint.ts";
import { writeSafetensors } from "../../checkpoint/safetensors.ts";
import { CHAT_TEMPLATE, prepareDataset } from "../../data/mod.ts";
import { initParams } from "../reference/cpu_gpt2.ts";
import { noGpu } from "../_helpers.ts";
import { follow, type SseEvent, startServer, submit } from "../_server.ts";

const FIXTURE = new URL("../fixtures/chat_small.jsonl", import.meta.url).pathname;
const tiny = presetConfig("gpt2-tiny");
const chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser", Deno.env.get("CHROMIUM_PATH")].find(
  (p) => {
    try {
      return !!p && Deno.statSync(p).isFile;
    } catch {
      return false;
    }
  },
);

/** The playground in chat mode: two turns with model `id`, both kept in the transcript. */
async function playgroundChat(url: string, id: string): Promise<void> {
  const browser = await puppeteer.launch({
    executablePath: chromium!,
    headless: true,
    args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
  });
  try {
    const page = await browser.newPage();
    const errors: string[] = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(`${url}/#/playground?model=${id}`);
    await page.waitForSelector("#pg-mode");
    await page.select("#pg-mode", "chat");
    await page.$eval("#pg-max_tokens", (el) => ((el as HTMLInputElement).value = "6"));
    await page.$eval("#pg-temperature", (el) => ((el as HTMLInputElement).value = "0"));
    for (const [i, text] of ["What color is the sky?", "Thank you."].entries()) {
      await page.$eval("#pg-prompt", (el, t) => ((el as HTMLTextAreaElement).value = t as string), text);
      await page.click("#pg-go");
      await page.waitForFunction(
        (n) => document.querySelectorAll("#pg-chat .turn-assistant").length === n,
        { timeout: 60_000 },
        i + 1,
      );
    }
    const turns = await page.$$eval("#pg-chat .turn", (els) => els.map((e) => e.className));
    assert.deepEqual(turns, [
      "turn turn-user",
      "turn turn-assistant",
      "turn turn-user",
      "turn turn-assistant",
    ]);
    assert.equal(await page.$eval("#pg-error", (el) => (el as HTMLElement).hidden), true);
    assert.deepEqual(errors, []);
  } finally {
    await browser.close();
  }
}

/** Writes a Hugging Face GPT-2 folder (config.json, model.safetensors) of fresh gpt2-tiny weights. */
async function writeHfFolder(home: string, name: string): Promise<void> {
  const dir = `${home}/models/${name}`;
  await Deno.mkdir(dir, { recursive: true });
  await Deno.writeTextFile(
    `${dir}/config.json`,
    JSON.stringify(hfConfig(tiny, { attention_dropout: 0, hidden_dropout: 0 })),
  );
  const tensors = exportTensors(tiny, initParams(tiny, 11)).map((t) => ({
    ...t,
    name: `transformer.${t.name}`,
  }));
  await writeSafetensors(`${dir}/model.safetensors`, tensors);
}

Deno.test({
  name:
    "An SFT job on a conversation file trains and its checkpoint answers /v1/chat/completions (openai client)",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const home = await Deno.makeTempDir({ prefix: "gpt2_chat_e2e_" });
    await writeHfFolder(home, "hf_tiny");
    await prepareDataset(home, { path: FIXTURE }, { format: "chat", allow_any_path: true, id: "chat" });
    const server = await startServer(home);
    try {
      const post = (path: string, body: unknown) =>
        fetch(`${server.url}${path}`, {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(body),
        });
      // Without init_from, or on a dataset without conversations: 400s naming the field.
      const noInit = await post("/train", { objective: "sft", dataset: "chat" });
      assert.equal(noInit.status, 400);
      assert.equal((await noInit.json()).error.param, "init_from");
      const notChat = await post("/train", { objective: "sft", dataset: "sotu", init_from: "hf_tiny" });
      assert.equal(notChat.status, 400);
      assert.equal((await notChat.json()).error.param, "dataset");

      const id = await submit(server.url, {
        objective: "sft",
        init_from: "hf_tiny",
        dataset: "chat",
        train_iters: 30,
        batch_size: 4,
        seq_len: 48,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup: 0,
        attention_dropout: 0,
        hidden_dropout: 0,
        log_interval: 5,
        eval_interval: 0,
        eval_iters: 1,
        save_interval: 0,
        seed: 5,
      });
      const events: SseEvent[] = [];
      await follow(`${server.url}/jobs/${id}/events`, 0, (e) => {
        events.push(e);
        return e.event !== "done";
      });
      const done = events.at(-1)!;
      assert.equal(done.data.status, "succeeded", JSON.stringify(done.data));
      const log = events.find((e) => e.event === "log" && String(e.data.message).startsWith("SFT data"));
      assert.ok(log, `no packing report in ${JSON.stringify(events.map((e) => e.event))}`);
      assert.match(String(log.data.message), /train \d+ rows, \d+ assistant targets, 0 cut, 0 dropped/);
      const losses = events.filter((e) => e.event === "progress" && typeof e.data.loss === "number")
        .map((e) => e.data.loss as number);
      assert.ok(losses.at(-1)! < losses[0], `loss ${losses[0]} → ${losses.at(-1)}`);
      const ckDir = `${home}/checkpoints/${id}`;
      const [ck] = [...Deno.readDirSync(ckDir)].filter((e) => e.name.startsWith("iter_"));
      const tc = JSON.parse(await Deno.readTextFile(`${ckDir}/${ck.name}/tokenizer_config.json`));
      assert.equal(tc.chat_template, CHAT_TEMPLATE);
      assert.equal(tc.eos_token, "<|endoftext|>");

      // A model without a template, and roles out of order.
      const plain = await post("/v1/chat/completions", {
        model: "hf_tiny",
        messages: [{ role: "user", content: "Hi" }],
      });
      assert.equal(plain.status, 400);
      const plainErr = (await plain.json()).error;
      assert.equal(plainErr.param, "model");
      assert.match(plainErr.message, /no chat template/);
      const order = await post("/v1/chat/completions", {
        model: id,
        messages: [{ role: "user", content: "Hi" }, { role: "user", content: "Again" }],
      });
      assert.equal(order.status, 400);
      assert.equal((await order.json()).error.param, "messages.1.role");
      // A conversation longer than the context is refused, not cut (a cut would lose its first
      // turn's role marker); parameters the server would ignore are refused too.
      const refused = async (body: Record<string, unknown>, param: string, message: RegExp) => {
        const res = await post("/v1/chat/completions", { model: id, ...body });
        assert.equal(res.status, 400);
        const err = (await res.json()).error;
        assert.deepEqual([err.param, err.message.match(message) !== null], [param, true], err.message);
      };
      const long = [{ role: "user", content: "word ".repeat(2000) }];
      await refused(
        { messages: long },
        "messages",
        /^messages take \d+ tokens, but model .* has a context of/,
      );
      const hi = [{ role: "user", content: "Hi" }];
      await refused({ messages: hi, top_logprobs: 2 }, "top_logprobs", /only allowed when logprobs is true/);
      await refused(
        { messages: hi, stream_options: { include_usage: true } },
        "stream_options",
        /stream is true/,
      );
      await refused({ messages: [{ ...hi[0], name: "ann" }] }, "messages.0.name", /no participant names/);

      const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "unused" });
      const messages = [{ role: "user" as const, content: "What color is the sky?" }];
      const whole = await client.chat.completions.create({
        model: id,
        messages,
        max_tokens: 8,
        temperature: 0,
        n: 2,
        seed: 3,
        logprobs: true,
        top_logprobs: 2,
      });
      assert.equal(whole.object, "chat.completion");
      assert.equal(whole.choices.length, 2);
      for (const ch of whole.choices) {
        assert.equal(ch.message.role, "assistant");
        assert.equal(typeof ch.message.content, "string");
        assert.ok(ch.finish_reason === "stop" || ch.finish_reason === "length");
        assert.ok(ch.logprobs!.content!.length > 0);
        assert.equal(ch.logprobs!.content![0].top_logprobs.length, 2);
      }
      // Greedy: both choices, and the stream, say the same.
      assert.equal(whole.choices[0].message.content, whole.choices[1].message.content);
      assert.ok(whole.usage!.prompt_tokens > 5 && whole.usage!.completion_tokens > 0);

      const stream = await client.chat.completions.create({
        model: id,
        messages,
        max_tokens: 8,
        temperature: 0,
        stream: true,
        stream_options: { include_usage: true },
      });
      let text = "", role = "", finish: string | null = null, usage = 0;
      for await (const chunk of stream) {
        assert.equal(chunk.object, "chat.completion.chunk");
        for (const ch of chunk.choices) {
          if (ch.delta.role) role = ch.delta.role;
          text += ch.delta.content ?? "";
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        if (chunk.usage) usage = chunk.usage.completion_tokens;
      }
      assert.equal(role, "assistant");
      assert.equal(text, whole.choices[0].message.content);
      assert.ok(finish === "stop" || finish === "length");
      assert.equal(usage, whole.usage!.completion_tokens / 2);

      if (chromium) await playgroundChat(server.url, id);
    } finally {
      server.child.kill("SIGKILL");
      await server.child.status;
      await Deno.remove(home, { recursive: true }).catch(() => {});
    }
  },
});
