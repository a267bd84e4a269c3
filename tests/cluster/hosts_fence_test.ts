/**
 * The fence on checkpoint files (issue 29): a host that lost a job's lease does not commit a
 * checkpoint for it. One runner with a real GPU Worker inside a real GPU host process
 * (host/gpu_host.ts through GpuHostClient), on a database shared with a second store handle that
 * stands for another host (SQLite: the claims and fences are the same as PostgreSQL's, which
 * tests/server/jobs_lease_test.ts checks on both engines). The test holds back the Worker's
 * `commit_check` for the job's first checkpoint while this host's heartbeat stops past its lease
 * (a host paused with SIGSTOP) and the other host claims the job; then it lets the question
 * through. The runner reads the lease from the database and answers no: the Worker removes the
 * checkpoint's temporary folder and ends the job, no checkpoint file exists for it, and this host
 * writes nothing more to the job. Skipped without a WebGPU adapter.
 */

import assert from "node:assert/strict";
import { noGpu } from "../_helpers.ts";
import { until } from "../_wait.ts";
import { prepareDataset } from "../../data/mod.ts";
import { GpuHostClient } from "../../server/gpus/host_client.ts";
import { JobRunner, JobStore } from "../../server/jobs/mod.ts";
import { LeaseKeeper } from "../../server/jobs/leases.ts";
import type { FromWorker, SpawnWorker, WorkerPort } from "../../protocol.ts";

/** A port that lets the test hold back the Worker's messages before the runner sees them. */
class GatedPort implements WorkerPort {
  onmessage: ((e: MessageEvent<FromWorker>) => void) | null = null;
  onerror: ((e: ErrorEvent) => void) | null = null;
  constructor(
    readonly inner: WorkerPort,
    gate: (msg: FromWorker, deliver: () => void) => void,
  ) {
    inner.onmessage = (e) => gate(e.data, () => this.onmessage?.(e));
    inner.onerror = (e) => this.onerror?.(e);
  }
  postMessage(msg: Parameters<WorkerPort["postMessage"]>[0]): void {
    this.inner.postMessage(msg);
  }
  terminate(): void {
    this.inner.terminate();
  }
}

Deno.test({
  name:
    "a host that lost a job's lease does not commit its checkpoint: the temporary folder goes, the job stops",
  ignore: noGpu,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const root = await Deno.makeTempDir({ prefix: "gpt2_fence_" });
    const a = new JobStore(`${root}/jobs.sqlite`), b = new JobStore(`${root}/jobs.sqlite`);
    const host = new GpuHostClient();
    const seen: FromWorker[] = [];
    const checked = Promise.withResolvers<() => void>();
    const spawn: SpawnWorker = (gpu) =>
      new GatedPort(host.spawn(gpu), (msg, deliver) => {
        seen.push(msg);
        if (msg.type === "commit_check") checked.resolve(deliver); // held until the test says
        else deliver();
      });
    let runner: JobRunner | null = null;
    const keeper = new LeaseKeeper({
      store: a,
      hostId: "host-a",
      leaseMs: 1000,
      report: () => ({ gpus: 1, free: 0, state: "ready" }),
      onLost: (id) => runner?.leaseLost(id),
      onCancel: () => {},
    });
    runner = new JobRunner(a, {
      root,
      gpus: 1,
      spawn,
      leases: keeper,
      datasetExists: () => Promise.resolve(true),
    });
    try {
      await prepareDataset(root, { builtin: "sotu" });
      runner.start();
      await until(() => runner.gpus()[0].state === "idle", "the Worker ready", 60_000, 50);
      const { id } = await runner.submit({
        model: "gpt2-tiny",
        dataset: "sotu",
        split: "949,50,1",
        train_iters: 4,
        batch_size: 2,
        seq_len: 16,
        lr: 1e-3,
        min_lr: 1e-4,
        lr_decay_style: "cosine",
        warmup: 0,
        weight_decay: 0.1,
        clip_grad: 1,
        attention_dropout: 0,
        hidden_dropout: 0,
        seed: 3,
        log_interval: 100,
        eval_interval: 0,
        eval_iters: 1,
        save_interval: 2,
        keep_checkpoints: 2,
      });
      const deliver = await checked.promise;
      const dir = runner.checkpointDir(id);
      // The checkpoint is written, not committed: only its temporary folder exists.
      const names = () => [...Deno.readDirSync(dir)].map((e) => e.name);
      assert.equal(names().length, 1);
      assert.match(names()[0], /^\.tmp-iter_0000002-/);

      // This host stops renewing (paused) past its lease; the other host claims the job.
      keeper.stop();
      await new Promise((r) => setTimeout(r, 1300));
      const taken = b.claimNext("host-b", 1, 60_000);
      assert.equal(taken?.job.id, id);
      assert.equal(taken.job.status, "running");
      const events = b.eventsAfter(id).length;

      deliver(); // the Worker's question reaches the runner now
      await until(() => seen.some((m) => m.type === "done"), "the Worker ending the job", 30_000, 50);
      const done = seen.find((m) => m.type === "done")!;
      assert.equal(done.type === "done" && done.status, "failed");
      assert.match(
        done.type === "done" ? String(done.error) : "",
        /Checkpoint "iter_0000002" of job "job_\w+" was not committed: this host no longer holds the job \(the database says host "host-a" no longer holds its lease/,
      );
      assert.ok(!seen.some((m) => m.type === "checkpoint"), "a checkpoint was reported");
      assert.deepEqual(names(), [], "no checkpoint and no temporary folder left");

      // Nothing more was written for the job by this host; it is the other host's, lease intact.
      const job = b.getJob(id)!;
      assert.equal(job.status, "running");
      assert.equal(job.last_checkpoint, null);
      assert.equal(b.eventsAfter(id).length, events);
      assert.equal(b.confirmLease(taken.lease, 60_000), true);
      // The Worker ended the job itself and is free again (not replaced).
      await until(
        () => runner.gpus()[0].state === "idle" && runner.gpus()[0].job === null,
        "GPU free",
        5000,
        50,
      );
    } finally {
      runner.shutdown();
      keeper.stop();
      await host.close(5000);
      a.close();
      b.close();
      await Deno.remove(root, { recursive: true });
    }
  },
});
