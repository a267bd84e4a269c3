/**
 * Whether compiling pipelines on other threads or processes, each with its own device, fills the
 * driver's shader cache so that the main device's own creation of the same pipelines is fast.
 * Deno's createComputePipelineAsync compiles one at a time (bench/pipeline_async_probe.ts), and a
 * fresh H200 spends about 85 ms per training pipeline.
 *
 *   deno run -A bench/compile_pool_probe.ts [--n 48] [--pool 8] [--mode worker|process|both]
 *
 * Each run salts the shapes (distinct M) so nothing is cached from an earlier run. Prints, for each
 * mode: N/2 pipelines created cold on the main device one at a time; the pool's wall time for the
 * other N/2; then the main device creating those N/2 after the pool.
 *
 * On the H200 (bench/RESULTS.md, issue 38) neither mode is a way forward: 8 Workers made 24 pipelines
 * 1.43× faster in all, 14 Workers for 64 hung past 150 s, and 14 processes left the main device
 * slower than compiling cold (0.53×).
 */
import { openDevice } from "../engine/device.ts";
import { chooseTile, type MatmulSpec, matmulWgsl } from "../engine/kernels/matmul.ts";

const arg = (name: string, dflt: string) => {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 ? Deno.args[i + 1] : dflt;
};

/** Compiles every WGSL of `codes` on a device of its own (a Worker's or a child process's body). */
export async function compileAll(codes: string[]): Promise<number> {
  const ctx = await openDevice();
  const t0 = performance.now();
  for (const code of codes) {
    ctx.device.createComputePipeline({
      layout: "auto",
      compute: { module: ctx.device.createShaderModule({ code }) },
    });
  }
  return performance.now() - t0;
}

if (import.meta.main && Deno.args[0] === "--child") {
  const ms = await compileAll(JSON.parse(await Deno.readTextFile(Deno.args[1])));
  console.log(JSON.stringify({ ms }));
  Deno.exit(0);
}

async function pooled(mode: "worker" | "process", shares: string[][]): Promise<number> {
  const t0 = performance.now();
  if (mode === "worker") {
    await Promise.all(shares.map((codes) =>
      new Promise<void>((resolve, reject) => {
        const w = new Worker(new URL("./compile_pool_worker.ts", import.meta.url), { type: "module" });
        w.onmessage = () => {
          w.terminate();
          resolve();
        };
        w.onerror = (e) => reject(new Error(e.message));
        w.postMessage(codes);
      })
    ));
  } else {
    await Promise.all(shares.map(async (codes, i) => {
      const file = await Deno.makeTempFile({ suffix: `.pool${i}.json` });
      await Deno.writeTextFile(file, JSON.stringify(codes));
      const out = await new Deno.Command(Deno.execPath(), {
        args: ["run", "-A", "--no-config", "--no-check", new URL(import.meta.url).pathname, "--child", file],
        stdout: "piped",
        stderr: "piped",
      }).output();
      if (!out.success) throw new Error(`child ${i}: ${new TextDecoder().decode(out.stderr).slice(-400)}`);
    }));
  }
  return performance.now() - t0;
}

if (import.meta.main && Deno.args[0] !== "--child") {
  const n = Number(arg("n", "48")), pool = Number(arg("pool", "8"));
  const m = arg("mode", "both");
  const modes: Array<"worker" | "process"> = m === "both"
    ? ["process", "worker"]
    : m === "process"
    ? ["process"]
    : ["worker"];
  const ctx = await openDevice();
  const salt = Math.floor(Math.random() * 1e6);
  let next = 0;
  const codes = (count: number) =>
    Array.from({ length: count }, () => {
      const i = next++;
      const spec: MatmulSpec = {
        M: 64 * (salt + 4 * i + 1),
        N: 768,
        K: 768,
        transA: i % 3 === 1,
        transB: i % 2 === 1,
        bias: true,
        epilogue: i % 4 === 0 ? "gelu" : "store",
      };
      return matmulWgsl(spec, chooseTile(spec, ctx.limits.maxComputeInvocationsPerWorkgroup));
    });
  const create = (list: string[]) => {
    const t0 = performance.now();
    for (const code of list) {
      ctx.device.createComputePipeline({
        layout: "auto",
        compute: { module: ctx.device.createShaderModule({ code }) },
      });
    }
    return performance.now() - t0;
  };
  console.log(`${ctx.adapterInfo.description}: ${n / 2} pipelines per set, pool of ${pool}`);
  for (const mode of modes) {
    const cold = create(codes(n / 2));
    const second = codes(n / 2);
    const shares = Array.from({ length: pool }, (_, w) => second.filter((_, i) => i % pool === w));
    const poolMs = await pooled(mode, shares);
    const after = create(second);
    console.log(
      `${mode}: cold on the main device ${cold.toFixed(0)} ms; pool ${poolMs.toFixed(0)} ms, then the main ` +
        `device ${after.toFixed(0)} ms (total ${(poolMs + after).toFixed(0)} ms, ${
          (cold / (poolMs + after)).toFixed(2)
        }x)`,
    );
  }
  Deno.exit(0);
}
