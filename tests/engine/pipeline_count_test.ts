/**
 * What a training plan compiles does not grow with its layers (issue 38's cold compile): with
 * dropout on, every layer's kernels share their pipelines, each op binding its dropout site's slot
 * of the uniform instead of naming the site in its WGSL. The GPUs' kernels (tiled matmuls, the
 * attention kernels with workgroup memory), as bench/compile_list.ts counts them for an H200.
 */

import assert from "node:assert/strict";
import { makeConfig } from "../../model/config.ts";
import { Trainer } from "../../engine/trainer.ts";
import { DEFAULT_ADAMW } from "../../model/schedule.ts";
import type { CompileProgress } from "../../engine/ops.ts";
import { noGpu, testContext } from "../_helpers.ts";

async function pipelines(nLayer: number, dropout: number): Promise<number> {
  const ctx = (await testContext())!;
  const seen: CompileProgress[] = [];
  const tr = await Trainer.create(ctx, {
    config: makeConfig({ n_layer: nLayer, n_head: 2, n_embd: 32, n_positions: 32 }),
    batchSize: 2,
    seqLen: 16,
    schedule: { lr: 1e-3, min_lr: 1e-4, warmup_iters: 1, decay_iters: 10, style: "cosine" },
    adamw: DEFAULT_ADAMW,
    attnDropout: dropout,
    hiddenDropout: dropout,
    seed: 1,
    kernels: { cpuDirect: false, cpuMatmul: false },
    onCompile: (p) => seen.push(p),
  });
  tr.destroy();
  assert.equal(seen.length, seen.at(-1)?.total ?? 0);
  return seen.length;
}

Deno.test({
  name: "a training plan with dropout compiles as many pipelines at 3 layers as at 1",
  ignore: noGpu,
  fn: async () => {
    const one = await pipelines(1, 0.1), three = await pipelines(3, 0.1);
    assert.equal(three, one, `${one} distinct pipelines at 1 layer, ${three} at 3`);
    // Dropout adds only the mask of the residual branches' backward.
    assert.equal(one, (await pipelines(1, 0)) + 1);
  },
});
