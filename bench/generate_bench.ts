/**
 * Generation benchmark: batch 1, 256 new tokens after a 32-token prompt (tokens/s, several
 * tokens decoded per submission), and time to first token for a 512-token prompt, for GPT-2
 * presets with fresh weights; optionally the PyTorch eager KV-cache peer in the same run.
 *
 *   deno run -A --no-config --no-check bench/generate_bench.ts [--models gpt2-124M,gpt2-345M]
 *     [--new 256] [--chunk 16] [--torch]
 */

import { presetConfig } from "../gpu/config.ts";
import { describeDevice, openDevice } from "../gpu/device.ts";
import { Generator } from "../gpu/generator.ts";
import { initParams } from "../gpu/init.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

const ctx = await openDevice();
console.log(describeDevice(ctx));
const cpu = /llvmpipe|lavapipe/i.test(ctx.adapterInfo.description);
const models = arg("models", cpu ? "gpt2-tiny" : "gpt2-124M,gpt2-345M").split(",");
const newTokens = +arg("new", cpu ? "32" : "256"), chunk = +arg("chunk", "16");
const sampling = { temperature: 0, top_k: 0, top_p: 1, seed: 1 };
const prompt = (n: number) => Array.from({ length: n }, (_, i) => (i * 7919) % 50000);

for (const model of models) {
  const config = presetConfig(model);
  const gen = await Generator.create(ctx, config, initParams(config, 1), { streams: 1, chunk });
  // Warm up: compiles the prefill buckets and the decode graph.
  const ttftPrompt = Math.min(512, config.n_positions - newTokens - 1);
  for (const n of [32, ttftPrompt]) {
    await gen.prefill(0, prompt(n), sampling);
    await gen.decode(chunk - 1);
  }
  // Time to first token: prefill + first sampled token read back.
  let t0 = performance.now();
  await gen.prefill(0, prompt(ttftPrompt), sampling);
  await gen.decode(0);
  const ttft = performance.now() - t0;
  // Throughput: 32-token prompt, then newTokens tokens in chunks.
  t0 = performance.now();
  await gen.prefill(0, prompt(32), sampling);
  let got = (await gen.decode(chunk - 1))[0].length;
  while (got < newTokens) got += (await gen.decode(Math.min(chunk, newTokens - got)))[0].length;
  const ms = performance.now() - t0;
  const r = { model, new_tokens: got, tokens_per_s: got / (ms / 1000), ttft_ms_512: ttft, chunk };
  console.log(JSON.stringify(r));
  console.log(
    `${model}: ${r.tokens_per_s.toFixed(0)} tokens/s (batch 1, ${got} tokens after a 32-token prompt, ` +
      `${chunk} per submission), time to first token ${ttft.toFixed(1)} ms for ${ttftPrompt} tokens`,
  );
  gen.destroy();
  if (Deno.args.includes("--torch")) {
    const out = await new Deno.Command("python3", {
      args: ["bench/torch_gpt2.py", "--model", model, "--generate", "--new-tokens", `${newTokens}`],
      stderr: "inherit",
    }).output();
    console.log(`  PyTorch eager fp32 KV cache: ${new TextDecoder().decode(out.stdout).trim()}`);
  }
}
ctx.device.destroy();
Deno.exit(0);
