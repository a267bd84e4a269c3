/**
 * `deno task eval`: the evaluation `POST /evaluate` queues, run in this process on the first
 * WebGPU adapter, with the same options (checked by the same schema, so a mistake names the same
 * field). Useful without a server, and for benchmarks: it prints the figures and the scored tokens
 * per second.
 *
 *   deno task eval --model gpt2 --dataset sotu --split test --seq-len 1024 --stride 512
 *   deno task eval --model job_x --text-file wiki.test.raw --stride 256
 *   deno task eval --model gpt2 --task cloze --jsonl lambada_test.jsonl --strict
 *   deno task eval --model gpt2 --task multiple_choice --jsonl data/tasks/example_choice.jsonl
 *
 * `--model` is any model the server knows under `--home` (default $GPT2_HOME or ./.gpt2): a job id,
 * "<job id>/iter_0001000" (a checkpoint by its full name), or a Hugging Face folder under models/. Exit status: 0 done, 1 the
 * evaluation failed, 2 bad arguments.
 */

import { parseArgs } from "node:util";
import { EvaluateRequestSchema } from "../server/routes/schemas.ts";
import { completeEvalConfig, type EvaluateRequest } from "../job/job_config.ts";
import { InvalidJobError, ModelNotFoundError } from "../job/errors.ts";
import { resolveModelSource } from "../checkpoint/model_source.ts";
import { checkEvaluation, datasetLookups } from "../server/jobs/job_checks.ts";
import { describeDevice, openDevice } from "../engine/device.ts";
import { loadEvalModel, runEvalConfig, withChoiceExamples } from "../worker/evaluation.ts";
import { type ChoiceExample, parseChoiceJsonl } from "../model/multiple_choice.ts";

const USAGE = `Usage: deno task eval --model ID [--task perplexity|cloze|multiple_choice]
  (--text STR ... | --text-file FILE ... | --jsonl FILE | --dataset ID [--split test])
  [--seq-len N] [--stride N] [--batch-size N] [--strict] [--max-tokens N]
  [--scoring sum|mean_token] [--examples-file NAME] [--home DIR] [--json]
  multiple_choice reads --jsonl lines {"context": "...", "endings": ["...", ...], "label": k}`;

function usage(problem: string): never {
  console.error(`${problem}\n${USAGE}`);
  Deno.exit(2);
}

const int = (name: string, v: string | undefined): number | undefined => {
  if (v === undefined) return undefined;
  if (!/^\d+$/.test(v)) usage(`Invalid --${name} "${v}": expected a positive integer`);
  return Number(v);
};

/** The text of the file an option names (a bad argument when it cannot be read). */
async function readArg(flag: string, path: string): Promise<string> {
  try {
    return await Deno.readTextFile(path);
  } catch (e) {
    return usage(`Cannot read --${flag} "${path}": ${(e as Error).message}`);
  }
}

/** The `POST /evaluate` body the arguments describe (texts read from their files). */
async function requestOf(values: Record<string, string | string[] | boolean | undefined>) {
  const texts: string[] = [...(values.text as string[] ?? [])];
  for (const f of values["text-file"] as string[] ?? []) texts.push(await readArg("text-file", f));
  let examples: ChoiceExample[] | undefined;
  if (typeof values.jsonl === "string" && values.task === "multiple_choice") {
    const text = await readArg("jsonl", values.jsonl);
    try {
      examples = parseChoiceJsonl(text, values.jsonl);
    } catch (e) {
      usage((e as Error).message);
    }
  } else if (typeof values.jsonl === "string") {
    const lines = (await readArg("jsonl", values.jsonl)).split("\n");
    for (const [i, line] of lines.entries()) {
      if (line.trim() === "") continue;
      let text: unknown;
      try {
        text = JSON.parse(line).text;
      } catch (e) {
        usage(`Cannot read "${values.jsonl}" line ${i + 1}: ${(e as Error).message}`);
      }
      if (typeof text !== "string") usage(`Cannot read "${values.jsonl}" line ${i + 1}: no "text" string`);
      texts.push(text);
    }
  }
  return {
    model: values.model,
    task: values.task,
    ...(texts.length ? { texts } : {}),
    examples,
    examples_file: values["examples-file"],
    scoring: values.scoring,
    dataset: values.dataset,
    split: values.split,
    seq_len: int("seq-len", values["seq-len"] as string | undefined),
    stride: int("stride", values.stride as string | undefined),
    batch_size: int("batch-size", values["batch-size"] as string | undefined),
    strict: values.strict,
    max_tokens: int("max-tokens", values["max-tokens"] as string | undefined),
  };
}

if (import.meta.main) {
  let parsed;
  try {
    parsed = parseArgs({
      args: Deno.args,
      options: {
        model: { type: "string" },
        task: { type: "string" },
        text: { type: "string", multiple: true },
        "text-file": { type: "string", multiple: true },
        jsonl: { type: "string" },
        dataset: { type: "string" },
        split: { type: "string" },
        "seq-len": { type: "string" },
        stride: { type: "string" },
        "batch-size": { type: "string" },
        strict: { type: "boolean" },
        "max-tokens": { type: "string" },
        scoring: { type: "string" },
        "examples-file": { type: "string" },
        home: { type: "string" },
        json: { type: "boolean" },
        help: { type: "boolean" },
      },
    });
  } catch (e) {
    usage((e as Error).message);
  }
  const { values } = parsed;
  if (values.help) {
    console.log(USAGE);
    Deno.exit(0);
  }
  const raw = Object.fromEntries(Object.entries(await requestOf(values)).filter(([, v]) => v !== undefined));
  const checked = EvaluateRequestSchema.safeParse(raw);
  if (!checked.success) {
    const i = checked.error.issues[0];
    usage(`Invalid "${i.path.join(".") || "arguments"}": ${i.message}`);
  }
  const req: EvaluateRequest = checked.data;
  const home = values.home ?? Deno.env.get("GPT2_HOME") ?? "./.gpt2";
  try {
    // The server's submission checks, so a mistake is a bad argument (2) naming the same field.
    await checkEvaluation({ root: home, ...datasetLookups(home) }, req);
    const source = await resolveModelSource(home, req.model);
    const config = completeEvalConfig(req, source);
    const evaluate = await withChoiceExamples(home, config.evaluate!).catch((e) =>
      usage(`Invalid "examples_file": ${(e as Error).message}`)
    );
    const ctx = await openDevice();
    console.error(`Evaluating "${source.id}" (${req.task}) on ${describeDevice(ctx)}`);
    const model = await loadEvalModel(ctx, source, evaluate, config.batch_size, config.seq_len);
    let last = 0;
    const result = await runEvalConfig(model, home, evaluate, {
      progress: (p) => {
        if (performance.now() - last < 2000 && p.done < p.total) return;
        last = performance.now();
        console.error(`  ${p.done}/${p.total}, ${p.tokens} tokens, ${p.tokens_per_s.toFixed(0)} tokens/s`);
      },
    });
    model.destroy();
    if (values.json) console.log(JSON.stringify(result));
    else {
      for (const [k, v] of Object.entries(result)) {
        console.log(
          `${k.padEnd(16)} ${typeof v === "number" && !Number.isInteger(v) ? v.toPrecision(7) : v}`,
        );
      }
    }
    ctx.device.destroy();
  } catch (e) {
    if (e instanceof ModelNotFoundError) {
      usage(`Invalid "model": unknown model "${req.model}" under "${home}"`);
    }
    if (e instanceof InvalidJobError) usage(`Invalid "${e.field}": ${e.message}`);
    console.error((e as Error).message);
    Deno.exit(1);
  }
}
