/**
 * `deno task reshard SRC --tensor-parallel N --out DST`: writes a copy of checkpoint folder SRC
 * resharded to N tensor-parallel ranks as the new folder DST (never replacing one). At N = 1 the
 * copy is the merged Hugging Face folder (`model.safetensors`, `config.json`) that transformers
 * loads. Training and generation do not need this: they reshard on load.
 *
 * Exit status: 0 done, 1 the resharding failed (the message says why), 2 bad arguments.
 */

import { parseArgs } from "node:util";
import { reshardCheckpoint, ReshardError } from "../checkpoint/reshard.ts";

const USAGE = "Usage: deno task reshard SRC --tensor-parallel N --out DST";

function usage(problem: string): never {
  console.error(`${problem}\n${USAGE}`);
  Deno.exit(2);
}

if (import.meta.main) {
  let parsed;
  try {
    parsed = parseArgs({
      args: Deno.args,
      allowPositionals: true,
      options: { "tensor-parallel": { type: "string" }, out: { type: "string" }, help: { type: "boolean" } },
    });
  } catch (e) {
    usage((e as Error).message);
  }
  const { values, positionals } = parsed;
  if (values.help) {
    console.log(USAGE);
    Deno.exit(0);
  }
  if (positionals.length !== 1) usage(`Expected one source checkpoint folder, got ${positionals.length}`);
  const raw = values["tensor-parallel"];
  if (raw === undefined) usage("Missing --tensor-parallel N");
  if (!/^\d+$/.test(raw) || Number(raw) < 1) {
    usage(`Invalid --tensor-parallel "${raw}": expected a positive integer`);
  }
  if (values.out === undefined) usage("Missing --out DST");
  const [src] = positionals;
  try {
    const t0 = performance.now();
    const r = await reshardCheckpoint(src, values.out, Number(raw));
    console.log(
      `Resharded "${src}" (tensor_parallel ${r.from_tensor_parallel}) to "${r.path}" (tensor_parallel ${r.tensor_parallel}): ` +
        `${r.files.join(", ")}; ${(r.bytes / 2 ** 20).toFixed(1)} MiB in ${
          ((performance.now() - t0) / 1000).toFixed(1)
        } s`,
    );
  } catch (e) {
    if (!(e instanceof ReshardError)) throw e;
    console.error(e.message);
    Deno.exit(1);
  }
}
