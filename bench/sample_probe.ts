/**
 * GPU time of the sampling kernel alone (issue 13): S rows of GPT-2's vocabulary, random logits
 * (roughly normal, scale 2; "peaked": 20 ids raised by 9, as a trained model's few likely
 * tokens), for several sampling settings. Each figure is the mean of 100 dispatches recorded in
 * one timestamped pass.
 *
 *   deno run -A bench/sample_probe.ts [--streams 1,16] [--variants all]
 */

import { createPipeline, describeDevice, openDevice, readBuffers } from "../engine/device.ts";
import { LP_WORDS, PARAM_WORDS, sampleWgsl, STATE_WORDS } from "../engine/kernels/sample.ts";
import { pcg } from "../model/rng.ts";

function arg(name: string, def: string): string {
  const i = Deno.args.indexOf(`--${name}`);
  return i >= 0 && i + 1 < Deno.args.length ? Deno.args[i + 1] : def;
}

const ctx = await openDevice();
console.log(describeDevice(ctx));
if (!ctx.hasTimestamps) throw new Error("needs timestamp queries");
const V = 50257, Vp = 50304, REPS = 100;
const settings = [
  { name: "greedy", temperature: 0, top_k: 0, top_p: 1, logprobs: 0 },
  { name: "T0.8 top-k 40", temperature: 0.8, top_k: 40, top_p: 1, logprobs: 0 },
  { name: "T1 no filter", temperature: 1, top_k: 0, top_p: 1, logprobs: 0 },
  { name: "T0.8 top-p 0.9", temperature: 0.8, top_k: 0, top_p: 0.9, logprobs: 0 },
  { name: "T0.8 top-k 40 logprobs 5", temperature: 0.8, top_k: 40, top_p: 1, logprobs: 6 },
  { name: "T0.8 top-p 0.9, peaked", temperature: 0.8, top_k: 0, top_p: 0.9, logprobs: 0, peaked: true },
];
/** Kernel variants (`--variants all`: also the tree reductions and other vocabulary unrolls). */
const subgroups = ctx.subgroupMinSize > 0;
const variants = arg("variants", "default") === "all"
  ? [
    { name: "tree, vocab unroll 8", spec: { unroll: 8 } },
    { name: "tree, vocab unroll 32", spec: { unroll: 32 } },
    ...(subgroups
      ? [8, 16, 32].map((u) => ({ name: `subgroups, vocab unroll ${u}`, spec: { subgroups, unroll: u } }))
      : []),
    // The passes' rests and the rank loops written out (SampleSpec.writtenRest).
    ...(subgroups
      ? [16, 32, 64, 128].map((u) => ({
        name: `subgroups, vocab unroll ${u}, rests written out`,
        spec: { subgroups, unroll: u, writtenRest: true },
      }))
      : [{ name: "tree, vocab unroll 32, rests written out", spec: { unroll: 32, writtenRest: true } }]),
  ]
  : [{ name: subgroups ? "subgroups" : "tree", spec: { subgroups } }];
const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
const buf = (data: ArrayBufferView<ArrayBuffer>) => {
  const b = ctx.device.createBuffer({ size: Math.max(16, data.byteLength), usage });
  ctx.device.queue.writeBuffer(b, 0, data);
  return b;
};
for (const S of arg("streams", "1,16").split(",").map(Number)) {
  {
    const logits = new Float32Array(S * Vp);
    let seed = 12345;
    const next = () => (seed = pcg(seed)) / 4294967296;
    for (let r = 0; r < S; r++) {
      for (let v = 0; v < V; v++) logits[r * Vp + v] = 2 * (next() + next() + next() + next() - 2);
    }
    const peaked = logits.slice();
    for (let r = 0; r < S; r++) for (let i = 0; i < 20; i++) peaked[r * Vp + ((i * 2477 + r * 31) % V)] += 9;
    const lb = buf(logits), pb = buf(peaked);
    for (const variant of variants) {
      const pipeline = await createPipeline(
        ctx,
        "sample probe",
        sampleWgsl({ V, Vp, streams: S, chunk: REPS, rows: "stream", maxPos: 1 << 20, ...variant.spec }),
      );
      const line: string[] = [];
      const picks: number[] = [];
      for (const st of settings) {
        const state = new Uint32Array(S * STATE_WORDS), prm = new Uint32Array(S * PARAM_WORDS);
        const pf = new Float32Array(prm.buffer);
        for (let r = 0; r < S; r++) {
          state[r * STATE_WORDS + 2] = r + 1;
          pf[r * PARAM_WORDS] = st.temperature;
          prm[r * PARAM_WORDS + 1] = st.top_k;
          pf[r * PARAM_WORDS + 2] = st.top_p;
          prm[r * PARAM_WORDS + 3] = st.logprobs;
        }
        const bufs = [
          "peaked" in st ? pb : lb,
          buf(state),
          buf(prm),
          buf(new Uint32Array(S * REPS)),
          buf(new Float32Array(S * REPS * LP_WORDS)),
        ];
        const group = ctx.device.createBindGroup({
          layout: pipeline.getBindGroupLayout(0),
          entries: bufs.map((b, binding) => ({ binding, resource: { buffer: b } })),
        });
        const qs = ctx.device.createQuerySet({ type: "timestamp", count: 2 });
        const res = ctx.device.createBuffer({
          size: 16,
          usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC,
        });
        const enc = ctx.device.createCommandEncoder();
        const pass = enc.beginComputePass({
          timestampWrites: { querySet: qs, beginningOfPassWriteIndex: 0, endOfPassWriteIndex: 1 },
        });
        pass.setPipeline(pipeline);
        pass.setBindGroup(0, group);
        for (let i = 0; i < REPS; i++) pass.dispatchWorkgroups(S);
        pass.end();
        enc.resolveQuerySet(qs, 0, 2, res, 0);
        ctx.device.queue.submit([enc.finish()]);
        const [t, out] = await readBuffers(ctx, [{ buffer: res, bytes: 16 }, {
          buffer: bufs[3],
          bytes: S * REPS * 4,
        }]);
        const ts = new BigUint64Array(t);
        line.push(`${st.name} ${(Number(ts[1] - ts[0]) / 1e3 / REPS).toFixed(1)} µs`);
        picks.push(...new Uint32Array(out).subarray(0, 8));
        for (const b of bufs.slice(1)) b.destroy();
        qs.destroy();
        res.destroy();
      }
      console.log(
        `S=${S} ${variant.name}: ${line.join(", ")}; first picks ${picks.slice(0, 24).join(",")}`,
      );
    }
    lb.destroy();
    pb.destroy();
  }
}
Deno.exit(0);
