/**
 * A matmul for CPU adapters (llvmpipe, lavapipe) that Mesa compiles in a fraction of a second:
 * no workgroup memory, no barriers, no unrolling beyond one 4×4 block.
 *
 * Mesa compiles a compute shader that has barriers as an LLVM coroutine, and the coroutine frame
 * grows with every value live across a barrier: the tiled kernels of matmul.ts (register tiles
 * live across two barriers per k-tile) took 7-20 s each to compile on llvmpipe with an empty
 * shader cache (bench/compile_probe.ts, gpt2-tiny), most of a cold demo's first step. Here each
 * invocation computes a 4×4 block of the output (4 rows, one vec4 of columns) reading A and B
 * straight from storage, 4 k at a time.
 *
 * Every output element is one fused multiply-add chain over k in order starting from 0, as in the
 * tiled kernels (fmaLines in matmul.ts), so with f32 math the results are bit-identical to theirs.
 * Every layout, epilogue, the GELU prologue and f16 storage are served; f16 math is not (the
 * tiled kernels keep it). M, N and K must be multiples of 4.
 */

import { dropWgsl, GELU_WGSL, grid1d, LINEAR_WG } from "./common.ts";
import {
  bindingDecls,
  epilogueLines,
  finish,
  matmulBindings,
  type MatmulKernel,
  type MatmulSpec,
} from "./matmul.ts";

/** Why the direct kernel cannot compute `spec`, or null when it can. */
export function matmulDirectError(spec: MatmulSpec): string | null {
  if (spec.math === "f16") return "f16 math needs the tiled kernels";
  if (spec.M % 4 || spec.N % 4 || spec.K % 4) {
    return `M, N and K must be multiples of 4 (${spec.M}, ${spec.N}, ${spec.K})`;
  }
  return null;
}

/** The one kernel of a direct matmul: one invocation per 4×4 output block, grid1d over M·N/16/64. */
export function matmulDirectKernel(spec: MatmulSpec): MatmulKernel {
  const err = matmulDirectError(spec);
  if (err) throw new RangeError(`Direct matmul: ${err}`);
  const { M, N, K, transA, transB } = spec;
  const N4 = N / 4, blocks = (M / 4) * N4;
  const bindings = matmulBindings(spec);
  const L = bindingDecls(bindings, false);
  if (spec.dropout) L.push(dropWgsl());
  if (spec.epilogue === "gelu" || spec.epilogue === "gelu_grad" || spec.prologueA === "gelu") {
    L.push(GELU_WGSL);
  }
  const pro = (read: string) => spec.prologueA === "gelu" ? `gelu4(${read})` : read;
  const r4 = [0, 1, 2, 3];
  const xyzw = "xyzw";
  // Loads of one step of 4 k: a_i (row i of the block, vec4 over k) or at_j (k + j, vec4 over m);
  // b_j (k + j, vec4 over n) or bt_c (column c, vec4 over k).
  const loads = [
    ...r4.map((i) =>
      transA
        ? `let at${i} = ${pro(`A[((k + ${i}u) * ${M}u + m0) / 4u]`)};`
        : `let a${i} = ${pro(`A[((m0 + ${i}u) * ${K}u + k) / 4u]`)};`
    ),
    ...r4.map((j) =>
      transB
        ? `let bt${j} = B[((n0 + ${j}u) * ${K}u + k) / 4u];`
        : `let b${j} = B[((k + ${j}u) * ${N}u + n0) / 4u];`
    ),
  ];
  if (transB) {
    loads.push(
      ...r4.map((j) =>
        `let b${j} = vec4<f32>(bt0.${xyzw[j]}, bt1.${xyzw[j]}, bt2.${xyzw[j]}, bt3.${xyzw[j]});`
      ),
    );
  }
  const a = (i: number, j: number) => transA ? `at${j}.${xyzw[i]}` : `a${i}.${xyzw[j]}`;
  const fmas = r4.flatMap((j) => r4.map((i) => `acc${i} = fma(vec4<f32>(${a(i, j)}), b${j}, acc${i});`));
  const epi = r4.map((i) =>
    `{\n    let q = (m0 + ${i}u) * ${N4}u + n4;\n    var v = acc${i};\n    ${
      epilogueLines(spec, "n0").join("\n    ")
    }\n  }`
  );
  const code = `${L.join("\n")}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
  let t = ${LINEAR_WG} * 64u + tid;
  if (t >= ${blocks}u) { return; }
  let n4 = t % ${N4}u;
  let n0 = n4 * 4u;
  let m0 = (t / ${N4}u) * 4u;
  ${r4.map((i) => `var acc${i} = vec4<f32>(0.0);`).join("\n  ")}
  for (var k = 0u; k < ${K}u; k = k + 4u) {
    ${loads.join("\n    ")}
    ${fmas.join("\n    ")}
  }
  ${epi.join("\n  ")}
}
`;
  return {
    suffix: "",
    code: finish(code, spec, false, bindings),
    bindings,
    grid: grid1d(Math.ceil(blocks / 64)),
    uniform: !!spec.dropout,
  };
}
