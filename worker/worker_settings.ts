/**
 * A GPU Worker's settings, read once from the environment when the Worker starts (the GPU host
 * passes its environment on): whether it runs inside the GPU host (its stdout is then the host
 * protocol), and the generation batcher's tuning (GPT2_GEN_*, GPT2_TRAIN_SHARE,
 * GPT2_FAST_READBACK, and MESA_SHADER_CACHE_DISABLE, which compile reports mention). Nothing
 * else in worker/ or engine/ reads the environment. docs/operations.md lists every variable and its default.
 */

import { parseFastReadback } from "../engine/readback.ts";
import { driverCacheDisabled } from "./compile_report.ts";
import { DEFAULT_GENERATION_OPTIONS, type GenerationServiceOptions } from "./serving.ts";

type Env = { get(key: string): string | undefined };

/** Everything a Worker reads from the environment. */
export interface WorkerSettings {
  /** Inside the GPU host (GPT2_GPU_HOST_CHILD=1): console output must go to stderr. */
  hostChild: boolean;
  generation: GenerationServiceOptions;
}

/** Reads a Worker's settings; throws RangeError naming a variable that is out of range. */
export function readWorkerSettings(env: Env): WorkerSettings {
  return { hostChild: env.get("GPT2_GPU_HOST_CHILD") === "1", generation: generationOptionsFromEnv(env) };
}

/**
 * Options from the environment, for tuning without a rebuild: GPT2_GEN_MAX_STREAMS,
 * GPT2_GEN_CHUNK, GPT2_GEN_FIRST_CHUNK, GPT2_GEN_PREFILL_TOKENS, GPT2_GEN_STEP_BUDGET_MS, GPT2_GEN_MAX_MODELS,
 * GPT2_TRAIN_SHARE, GPT2_GEN_ADMIT_WINDOW_MS, GPT2_GEN_ADMIT_QUIET_MS, GPT2_GEN_LOAD_HOLD_MS, GPT2_GEN_RUN_AHEAD and GPT2_GEN_WARM_AT_LOAD (0 or 1), and MESA_SHADER_CACHE_DISABLE
 * (only reported). Throws RangeError naming a variable that is out of range.
 */
export function generationOptionsFromEnv(
  env: { get(key: string): string | undefined },
): GenerationServiceOptions {
  const o = { ...DEFAULT_GENERATION_OPTIONS };
  type NumericKey = Exclude<
    keyof GenerationServiceOptions,
    "runAhead" | "driverCacheDisabled" | "fastReadback" | "warmAtLoad" | "inbox" | "awaitPosted"
  >;
  const read = (name: string, key: NumericKey, min: number, max: number, int = true) => {
    const raw = env.get(name);
    if (raw === undefined || raw === "") return;
    const v = Number(raw);
    if (!(v >= min && v <= max) || (int && !Number.isInteger(v))) {
      throw new RangeError(
        `${name} "${raw}" must be ${int ? "an integer" : "a number"} from ${min} to ${max}`,
      );
    }
    o[key] = v;
  };
  read("GPT2_GEN_MAX_STREAMS", "maxStreams", 1, 1024);
  read("GPT2_GEN_CHUNK", "chunk", 2, 256);
  read("GPT2_GEN_FIRST_CHUNK", "firstChunk", 1, 256);
  read("GPT2_GEN_PREFILL_TOKENS", "prefillTokens", 1, 1 << 20);
  read("GPT2_GEN_STEP_BUDGET_MS", "stepBudgetMs", 1, 60_000, false);
  read("GPT2_GEN_MAX_MODELS", "maxModels", 1, 64);
  read("GPT2_TRAIN_SHARE", "trainShare", 0.05, 0.95, false);
  read("GPT2_GEN_ADMIT_WINDOW_MS", "admitWindowMs", 0, 1000, false);
  read("GPT2_GEN_ADMIT_QUIET_MS", "admitQuietMs", 0, 1000, false);
  read("GPT2_GEN_LOAD_HOLD_MS", "loadHoldMs", 0, 600_000, false);
  const flag = (name: string): boolean | undefined => {
    const raw = env.get(name);
    if (raw === undefined || raw === "") return undefined;
    if (raw !== "0" && raw !== "1") throw new RangeError(`${name} "${raw}" must be 0 or 1`);
    return raw === "1";
  };
  const ahead = flag("GPT2_GEN_RUN_AHEAD"), warm = flag("GPT2_GEN_WARM_AT_LOAD");
  if (ahead !== undefined) o.runAhead = ahead;
  if (warm !== undefined) o.warmAtLoad = warm;
  o.driverCacheDisabled = driverCacheDisabled(env);
  try {
    o.fastReadback = parseFastReadback(env.get("GPT2_FAST_READBACK"));
  } catch (e) {
    throw new RangeError((e as Error).message);
  }
  return o;
}
