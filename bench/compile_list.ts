/**
 * Which distinct pipelines a training job compiles (issue 38's cold-compile target), and why. Builds
 * what `POST /train` builds, through the same code: the request is completed by the server's schema
 * defaults and completeConfig (dropout 0.1, periodic evaluation…), mapped to Trainer options by
 * worker/train_loop.ts's jobTrainerOptions, and the Trainer is created with a compile listener as
 * the job's. A job compiles one build: the training plan, whose batch holds the forward, the
 * training loss, backward, the optimizer, the evaluation loss (evalLoss: validation and eval_tasks)
 * and the f16 weight cast (fp16); eval_tasks run on that plan, nothing else compiles. (The
 * parameters' checksum, which only data- or tensor-parallel jobs read, compiles at its first use.)
 *
 * Prints one line per distinct pipeline (first label, WGSL lines, creation ms, the op lists that
 * dispatch it), then the groups of near-duplicates: pipelines whose labels differ only by layer or
 * chunk number, with what differs in their text. Then which pipelines a single-rank job never
 * dispatches.
 *
 * On a GPU the pipelines are really created, each timed (createShaderModule + createComputePipeline,
 * what device.ts's createPipeline does): run with an empty driver cache for cold figures, e.g. on
 * NVIDIA `__GL_SHADER_DISK_CACHE=0` or an empty `XDG_CACHE_HOME`:
 *
 *   XDG_CACHE_HOME=$(mktemp -d) deno run -A bench/compile_list.ts --model gpt2-124M --batch 8 --seq 1024
 *
 * On a CPU adapter (or with `--emulate h200`) nothing is compiled or allocated: a stand-in device with
 * the H200's features and limits (subgroups ≥ 32 lanes, shader-f16, timestamps, 48 KiB of workgroup
 * memory, 1024 invocations, NVIDIA's binding limits) records the WGSL, so the kernel choices are a
 * GPU's and the list is what the H200 compiles (ms then reads "-"). `--validate` also checks each
 * source with the real adapter's WGSL front end (createShaderModule, no pipeline).
 *
 * Options: `--model`, `--batch`, `--seq`, `--set key=json` (any other field of the /train request,
 * repeatable: `--set attention_dropout=0 --set precision='"fp16"'`), `--emulate h200|none`,
 * `--validate`, `--json <file>` (every pipeline with its WGSL), `--quiet` (groups and totals only),
 * `--uniform-dims all|none|weight-gradients` (which matmuls read their sizes from a uniform:
 * GraphOptions.kernels.uniformDims; default weight-gradients).
 */
import { type GpuContext, isCpuAdapter, openDevice } from "../engine/device.ts";
import { Trainer } from "../engine/trainer.ts";
import type { CompileProgress, Op } from "../engine/ops.ts";
import { jobTrainerOptions } from "../worker/train_loop.ts";
import { completeConfig, trainingModel } from "../job/job_config.ts";
import { TrainRequestSchema } from "../server/routes/schemas.ts";
import { GPU_PRESETS } from "../model/memory_estimate.ts";

const args = Deno.args;
const arg = (name: string, dflt: string) => {
  const i = args.indexOf(`--${name}`);
  return i >= 0 ? args[i + 1] : dflt;
};
const flag = (name: string) => args.includes(`--${name}`);

// ---------------------------------------------------------------------------------------------
// The job's configuration, as the server completes a POST /train body.

const body: Record<string, unknown> = {
  model: arg("model", "gpt2-124M"),
  dataset: "sotu",
  batch_size: Number(arg("batch", "8")),
  seq_len: Number(arg("seq", "1024")),
};
args.forEach((a, i) => {
  if (a !== "--set") return;
  const [k, ...v] = args[i + 1].split("=");
  body[k] = JSON.parse(v.join("="));
});
const config = completeConfig(TrainRequestSchema.parse(body));
const model = trainingModel(config);

// ---------------------------------------------------------------------------------------------
// The device: the real one on a GPU, else a stand-in with the H200's features and limits.

interface Created {
  code: string;
  label: string;
  ms: number | null;
}
const created: Created[] = [];
const codeOf = new Map<object, string>();
const pipelineCode = new Map<object, string>();

const real = await openDevice();
const emulate = arg("emulate", isCpuAdapter(real) ? "h200" : "none");
let ctx: GpuContext;
if (emulate === "none") {
  ctx = real;
  const dev = real.device;
  const createModule = dev.createShaderModule.bind(dev);
  const createPipeline = dev.createComputePipeline.bind(dev);
  let moduleMs = 0;
  dev.createShaderModule = (d: GPUShaderModuleDescriptor) => {
    const t0 = performance.now();
    const m = createModule(d);
    moduleMs = performance.now() - t0;
    codeOf.set(m, d.code);
    return m;
  };
  dev.createComputePipeline = (d: GPUComputePipelineDescriptor) => {
    const t0 = performance.now();
    const p = createPipeline(d);
    const code = codeOf.get(d.compute.module) ?? "?";
    created.push({ code, label: d.label ?? "?", ms: moduleMs + performance.now() - t0 });
    pipelineCode.set(p, code);
    return p;
  };
} else if (emulate === "h200") {
  ctx = standIn(real);
} else throw new Error(`--emulate takes h200 or none, got "${emulate}"`);

/** A device that allocates and compiles nothing: it records shader sources and hands out stubs. */
function standIn(realCtx: GpuContext): GpuContext {
  const h200 = GPU_PRESETS.h200;
  const limits = {
    maxStorageBufferBindingSize: h200.maxStorageBufferBindingSize,
    maxBufferSize: h200.maxBufferSize,
    maxComputeWorkgroupStorageSize: 49152,
    maxComputeInvocationsPerWorkgroup: 1024,
    maxComputeWorkgroupsPerDimension: 65535,
    maxStorageBuffersPerShaderStage: 1048576,
  };
  const deviceLimits = {
    ...limits,
    maxUniformBufferBindingSize: 65536,
    maxUniformBuffersPerShaderStage: 15,
    minUniformBufferOffsetAlignment: 64,
    minStorageBufferOffsetAlignment: 16,
    maxTextureDimension2D: 32768,
    maxComputeWorkgroupSizeX: 1024,
    maxComputeWorkgroupSizeY: 1024,
  };
  const validate = flag("validate");
  const stubEncoder = () => {
    const pass = {
      setPipeline() {},
      setBindGroup() {},
      dispatchWorkgroups() {},
      end() {},
    };
    return {
      beginComputePass: () => pass,
      clearBuffer() {},
      copyBufferToBuffer() {},
      copyBufferToTexture() {},
      resolveQuerySet() {},
      finish: () => ({}),
    };
  };
  const device = {
    label: "stand-in H200",
    limits: deviceLimits,
    features: new Set(["subgroups", "timestamp-query", "shader-f16"]),
    lost: new Promise(() => {}),
    addEventListener() {},
    pushErrorScope() {},
    popErrorScope: () => Promise.resolve(null),
    createBuffer: (d: GPUBufferDescriptor) => ({
      label: d.label ?? "",
      size: d.size,
      usage: d.usage,
      mapState: "unmapped",
      destroy() {},
      mapAsync: () => Promise.resolve(),
      getMappedRange: () => new ArrayBuffer(d.size),
      unmap() {},
    }),
    createShaderModule: (d: GPUShaderModuleDescriptor) => {
      const m = { label: d.label, getCompilationInfo: () => Promise.resolve({ messages: [] }) };
      codeOf.set(m, d.code);
      return m;
    },
    createComputePipeline: (d: GPUComputePipelineDescriptor) => {
      const code = codeOf.get(d.compute.module) ?? "?";
      const p = { label: d.label, getBindGroupLayout: () => ({}) };
      created.push({ code, label: d.label ?? "?", ms: null });
      pipelineCode.set(p, code);
      if (validate) validateWgsl(realCtx, d.label ?? "?", code);
      return p;
    },
    createBindGroup: () => ({}),
    createQuerySet: (d: GPUQuerySetDescriptor) => ({ ...d, destroy() {} }),
    createCommandEncoder: stubEncoder,
    queue: {
      writeBuffer() {},
      submit() {},
      onSubmittedWorkDone: () => Promise.resolve(),
    },
    destroy() {},
  };
  return {
    device: device as unknown as GPUDevice,
    adapterInfo: {
      vendor: "nvidia",
      architecture: "",
      device: "",
      description: "NVIDIA H200 (stand-in: nothing compiled)",
    },
    features: new Set(device.features),
    limits,
    hasF16: true,
    hasTimestamps: true,
    hasSubgroups: true,
    subgroupMinSize: 32,
    lostReason: null,
    uncaptured: null,
  };
}

const invalid: string[] = [];
/** Checks a source with the real adapter's WGSL front end (errors collected, printed at the end). */
function validateWgsl(realCtx: GpuContext, label: string, code: string) {
  const dev = realCtx.device;
  dev.pushErrorScope("validation");
  dev.createShaderModule({ label, code });
  dev.popErrorScope().then((e) => {
    if (e) invalid.push(`${label}: ${e.message.split("\n").slice(0, 6).join(" | ")}`);
  });
}

// ---------------------------------------------------------------------------------------------
// The build, as createTrainer makes it.

const progress: CompileProgress[] = [];
console.log(
  `adapter: ${ctx.adapterInfo.description}${
    emulate === "none" ? "" : ` (on ${real.adapterInfo.description})`
  }`,
);
console.log(
  `job: ${
    typeof config.model === "string" ? config.model : JSON.stringify(config.model)
  }, batch ${config.batch_size}` +
    ` × ${config.seq_len}, dropout attention ${config.attention_dropout} hidden ${config.hidden_dropout}, ` +
    `${config.precision ?? "fp32"}, eval_interval ${config.eval_interval}, micro-batches ${
      (config.global_batch_size ?? config.batch_size) / config.batch_size / (config.data_parallel ?? 1)
    }, dp ${config.data_parallel} tp ${config.tensor_parallel}`,
);
const t0 = performance.now();
const base = jobTrainerOptions(ctx, config, model);
const trainer = await Trainer.create(ctx, {
  ...base,
  ...(args.includes("--uniform-dims")
    ? {
      kernels: {
        ...base.kernels,
        uniformDims: arg("uniform-dims", "all") as "weight-gradients" | "all" | "none",
      },
    }
    : {}),
  onCompile: (p) => progress.push(p),
});
const buildMs = performance.now() - t0;

// Which op lists dispatch each pipeline.
const m = trainer.model;
const lists: Record<string, Op[]> = {
  forward: m.forward,
  loss: m.loss,
  backward: m.backward,
  optimizer: m.optimizer,
  evalLoss: m.evalLoss,
  castWeights: m.castWeights,
  checksum: m.checksum,
};
const usedBy = new Map<string, Set<string>>();
const opsOf = new Map<string, number>();
for (const [name, ops] of Object.entries(lists)) {
  for (const op of ops) {
    if (!op.pipeline) continue; // compiled on first use (the checksum), not by the build
    const code = pipelineCode.get(op.pipeline) ?? "?";
    if (!usedBy.has(code)) usedBy.set(code, new Set());
    usedBy.get(code)!.add(name);
    opsOf.set(code, (opsOf.get(code) ?? 0) + 1);
  }
}
/** What a single-rank job dispatches: a step, the evaluations, and the cast at the start (fp16). */
const world = (config.data_parallel ?? 1) * (config.tensor_parallel ?? 1);
const dispatched = new Set(["forward", "loss", "backward", "optimizer", "evalLoss", "castWeights"]);
if (world > 1) dispatched.add("checksum");
/** Which plan a pipeline is counted in: training (a step), evaluation only, or other. */
const planOf = (code: string) => {
  const u = usedBy.get(code) ?? new Set();
  if (["forward", "loss", "backward", "optimizer"].some((n) => u.has(n))) return "train";
  if (u.has("evalLoss")) return "eval";
  return "other";
};

// ---------------------------------------------------------------------------------------------
// The list.

const lines = (code: string) => code.split("\n").length;
const fmtMs = (ms: number | null) => (ms === null ? "-" : ms.toFixed(0)).padStart(6);
if (!flag("quiet")) {
  console.log(`\n  #  ${"label".padEnd(28)} lines     ms  plan   ops  used by`);
  created.forEach((c, i) => {
    const u = [...(usedBy.get(c.code) ?? [])].join(",") || "(no op)";
    console.log(
      `${String(i + 1).padStart(3)}  ${c.label.padEnd(28)} ${String(lines(c.code)).padStart(5)} ${
        fmtMs(c.ms)
      }  ${planOf(c.code).padEnd(5)} ${String(opsOf.get(c.code) ?? 0).padStart(4)}  ${u}`,
    );
  });
}

// Groups: labels with their layer, chunk and part numbers taken out.
const groupKey = (label: string) =>
  label.replace(/^l\d+\./, "l*.").replace(/\.\d+$/, ".*").replace(/\.u\d+$/, ".u*");
const groups = new Map<string, Created[]>();
for (const c of created) {
  const k = groupKey(c.label);
  if (!groups.has(k)) groups.set(k, []);
  groups.get(k)!.push(c);
}
/** The lines of `b` that differ from `a`'s (a short summary). */
function differs(a: string, b: string): string {
  const la = a.split("\n"), lb = b.split("\n");
  const out: string[] = [];
  for (let i = 0; i < Math.max(la.length, lb.length); i++) {
    if (la[i] === lb[i]) continue;
    const x = la[i] ?? "", y = lb[i] ?? "";
    let at = 0;
    while (at < x.length && x[at] === y[at]) at++;
    const from = Math.max(0, at - 24);
    const cut = (t: string) => `${from > 0 ? "…" : ""}${t.slice(from, at + 24).trim()}`;
    out.push(`"${cut(x)}" → "${cut(y)}"`);
  }
  if (la.length !== lb.length) out.unshift(`${la.length} → ${lb.length} lines`);
  return out.length > 3 ? `${out.slice(0, 3).join("; ")}; … (${out.length} lines differ)` : out.join("; ");
}
console.log(`\nGroups with more than one pipeline (label with layer/chunk numbers as *):`);
const sum = (cs: Created[]) => cs.some((c) => c.ms === null) ? null : cs.reduce((s, c) => s + c.ms!, 0);
for (const [k, cs] of [...groups].sort((a, b) => b[1].length - a[1].length)) {
  if (cs.length < 2) continue;
  console.log(`  ${k.padEnd(28)} ${String(cs.length).padStart(3)} pipelines, ${fmtMs(sum(cs))} ms`);
  for (const c of cs.slice(1, 3)) {
    console.log(`      ${cs[0].label} vs ${c.label}: ${differs(cs[0].code, c.code)}`);
  }
}

const perPlan = { train: 0, eval: 0, other: 0 };
for (const c of created) perPlan[planOf(c.code)]++;
const never = created.filter((c) => ![...(usedBy.get(c.code) ?? [])].some((n) => dispatched.has(n)));
console.log(
  `\nNever dispatched by this job (${never.length}): ${never.map((c) => c.label).join(", ") || "none"}`,
);
const total = sum(created);
console.log(
  `\n${created.length} distinct pipelines (reported to the job's listener: ${progress.length}; ` +
    `train ${perPlan.train}, eval only ${perPlan.eval}, other ${perPlan.other}), ${groups.size} label groups; ` +
    `creation ${total === null ? "not measured (stand-in)" : `${total.toFixed(0)} ms`}, build ${
      buildMs.toFixed(0)
    } ms`,
);
if (flag("validate")) {
  await real.device.queue.onSubmittedWorkDone();
  await new Promise((r) => setTimeout(r, 100));
  console.log(invalid.length ? `WGSL errors:\n${invalid.join("\n")}` : "every source validated");
}
const jsonOut = arg("json", "");
if (jsonOut) {
  await Deno.writeTextFile(
    jsonOut,
    JSON.stringify(
      created.map((c) => ({ ...c, plan: planOf(c.code), usedBy: [...(usedBy.get(c.code) ?? [])] })),
      null,
      1,
    ),
  );
}
Deno.exit(0);
