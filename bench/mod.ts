/**
 * `deno task bench [train|data|matmul|attention|allreduce|runtime|generate|curve|dp|demo|hosts|faults|choice] [options]`:
 * the benchmarks. With no suite named it runs the training benchmark (bench/train_bench.ts); `data`
 * runs the data pipeline benchmark, `matmul` the matmul shapes and tile sweep (bench/matmul_bench.ts),
 * `attention` today's attention kernels against the flash ones (bench/attention_bench.ts), `allreduce`
 * the shared-memory allreduce and GPU host-path benchmark, `runtime` the start-train-SIGTERM cycles,
 * `generate` the generation scenarios (bench/generate_bench.ts), `curve` the fp16-against-fp32 loss
 * curves, `dp` data-parallel training through the server, and `demo` the newcomer's `deno task demo`
 * as a subprocess with a cold and a warm shader cache (bench/demo_bench.ts), `hosts` short jobs on
 * several servers sharing one PostgreSQL job store, against one (bench/hosts_bench.ts), `faults` the fault
 * matrix of issue 37: stops, crashes, a database restart, a full disk and a corrupted checkpoint against
 * `deno task serve`, with what happened to each job (bench/fault_matrix.ts), and `choice` issue 41's
 * multiple-choice throughput and the cost of evaluations during training (bench/choice_bench.ts).
 * Options pass through.
 */

const suites: Record<string, string> = {
  train: "./train_bench.ts",
  data: "./data_bench.ts",
  matmul: "./matmul_bench.ts",
  attention: "./attention_bench.ts",
  allreduce: "./allreduce_bench.ts",
  runtime: "./runtime_bench.ts",
  generate: "./generate_bench.ts",
  curve: "./curve_bench.ts",
  dp: "./dp_bench.ts",
  demo: "./demo_bench.ts",
  hosts: "./hosts_bench.ts",
  faults: "./fault_matrix.ts",
  choice: "./choice_bench.ts",
};
const [first, ...rest] = Deno.args;
const name = first && first in suites ? first : "train";
const args = first && first in suites ? rest : Deno.args;
const script = new URL(suites[name], import.meta.url).pathname;
const status = await new Deno.Command(Deno.execPath(), {
  args: ["run", "-A", script, ...args],
  stdout: "inherit",
  stderr: "inherit",
}).spawn().status;
Deno.exit(status.code);
