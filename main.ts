/**
 * The server's entry point, and only wiring: read the configuration from the environment once
 * (server/settings.ts), open the job store, start the GPU host (a child process with one Worker
 * per GPU) and the job runner, build the routes and serve them. No WebGPU is loaded in this
 * process, so a driver fault can only take down the GPU host, which is restarted.
 *
 * Nothing that can go wrong at start ends in an uncaught error: a bad setting or an unusable data
 * directory exits with a message, and a GPU host that cannot start is a state `/health` shows
 * while it is tried again (server/gpus/host_client.ts).
 *
 * With GPT2_DATABASE_URL the job store is PostgreSQL (server/jobs/postgres_bridge.ts), shared
 * with other hosts: this one registers there under GPT2_HOST_ID, claims the jobs it can place
 * under leases it renews (server/jobs/leases.ts) and resumes those of a host that stopped
 * renewing; GPT2_SHARED_DIR holds checkpoints and datasets instead of GPT2_HOME.
 *
 * SIGTERM or SIGINT stops gracefully within GPT2_SHUTDOWN_S (30 s): new requests get 503, each
 * running job saves a checkpoint at its current step, event streams end, the Workers let their
 * GPUs go idle, the host exits, the store closes, and the process exits 0. The same signal
 * forwarded by `deno task` or sent to the whole process group counts once
 * (server/stop_signals.ts); a second one sent on purpose, a second later or more, exits at once.
 * The GPU host never sees these signals (its own session), so it is alive to save the jobs.
 */

import { resolve } from "node:path";
import { datasetsDir } from "./data/mod.ts";
import {
  type ClusterConfig,
  readClusterConfig,
  readServerConfig,
  type ServerConfig,
} from "./server/settings.ts";
import { GenerationManager } from "./server/generate/mod.ts";
import { GpuHostClient, trainingGpus } from "./server/gpus/mod.ts";
import {
  datasetLookups,
  JobRunner,
  JobStore,
  removeStaleCheckpointTemporaries,
  removeStaleTemporaries,
} from "./server/jobs/mod.ts";
import { lockDataDir } from "./server/lock.ts";
import { hostPermissions } from "./server/gpus/host_client.ts";
import { PostgresBridgeStore } from "./server/jobs/postgres_bridge.ts";
import { LeaseKeeper } from "./server/jobs/leases.ts";
import { createApp, FailureLimiter } from "./server/routes/mod.ts";
import { warmUp } from "./server/rehearsal.ts";
import { Access, QuotaBook, TokenAuth } from "./server/auth/mod.ts";
import { datasetRoutes } from "./server/routes/datasets.ts";
import { stoppingLine, StopSignals } from "./server/stop_signals.ts";

if (import.meta.main) {
  let config: ServerConfig, cluster: ClusterConfig;
  try {
    config = readServerConfig(Deno.env);
    cluster = readClusterConfig(Deno.env);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(2);
  }
  const { home, roles } = config;
  // Checkpoints and datasets: on storage every host sees when GPT2_SHARED_DIR is set.
  const data = cluster.sharedDir ?? home;
  let store: JobStore, homeReal: string, dataReal: string;
  try {
    const dirs = [[home, "GPT2_HOME"], [config.sources, "GPT2_SOURCES"], [data, "GPT2_SHARED_DIR"]];
    for (const [dir, setting] of dirs) {
      await Deno.mkdir(dir, { recursive: true }).catch((e) => {
        throw new Error(`Cannot create "${dir}" (${setting}): ${(e as Error).message}`);
      });
    }
    homeReal = await Deno.realPath(home);
    dataReal = await Deno.realPath(data);
    await lockDataDir(home);
    // No writer is running yet: whatever a killed process left half-written goes. Not in a shared
    // folder, where another host may be writing right now.
    if (cluster.sharedDir === null) {
      const stale = [
        ...await removeStaleCheckpointTemporaries(home),
        ...await removeStaleTemporaries(datasetsDir(home)),
      ];
      for (const name of stale) console.log(`Removed stale temporary "${name}"`);
    }
    if (cluster.databaseUrl) {
      store = PostgresBridgeStore.open(cluster.databaseUrl);
    } else {
      try {
        store = new JobStore(`${home}/jobs.sqlite`);
      } catch (e) {
        throw new Error(`Cannot open the job store "${home}/jobs.sqlite": ${(e as Error).message}`);
      }
    }
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(1);
  }
  const host = new GpuHostClient({
    env: { GPT2_SHUTDOWN_S: String(config.shutdownSeconds) },
    // The Deno that runs the GPU host; a path that does not work leaves the host "failed" in /health.
    deno: config.hostDeno ?? undefined,
    denoFlags: hostPermissions([...new Set([resolve(home), homeReal, resolve(data), dataReal])]),
  });
  const keeper = cluster.databaseUrl ? hostLeases(store, () => runner, cluster, config.gpus) : undefined;
  // Users' tokens reloaded every heartbeat (a revocation on any host holds here within one).
  const heartbeatMs = cluster.databaseUrl ? Math.max(100, Math.floor(cluster.leaseSeconds * 1000 / 3)) : 1000;
  const tokens = new TokenAuth(store, {
    bootstrap: config.token ? [config.token] : [],
    refreshMs: heartbeatMs,
  });
  const quotas = new QuotaBook(store, config.quotas);
  const runner: JobRunner = new JobRunner(store, {
    leases: keeper,
    skipOwners: () => quotas.atRunningQuota(),
    root: data,
    gpus: config.gpus,
    stallMs: config.stallSeconds * 1000,
    spawn: host.spawn,
    host: () => host.status,
    trainGpus: trainingGpus(roles),
    ...datasetLookups(data),
  });
  const generation = new GenerationManager(runner.pool, data, { roles });
  const access = new Access(store, (id) => runner.checkpointDir(id));
  const datasets = datasetRoutes(data, {
    sources: config.sources,
    limits: config.limits,
    allowPrivateUrls: config.allowPrivateUrls,
    auth: { access, store },
  });
  const app = createApp({
    runner,
    generation,
    token: config.token,
    auth: { tokens: tokens.start(), access, quotas, failures: new FailureLimiter() },
    limits: config.limits,
    host: config.host,
    port: config.port,
    allowedHosts: config.allowedHosts,
    corsOrigins: config.corsOrigins,
    trustedProxies: config.trustedProxies,
    home: data,
    homeName: cluster.sharedDir === null ? "$GPT2_HOME" : "$GPT2_SHARED_DIR",
    extra: [datasets],
    draining: { active: () => runner.draining, retryAfterSeconds: config.shutdownSeconds },
  });
  let server: Deno.HttpServer;
  try {
    server = Deno.serve({
      hostname: config.host,
      port: config.port,
      onListen: ({ hostname, port }) => {
        const host = hostname.includes(":") ? `[${hostname}]` : hostname;
        const where = cluster.sharedDir === null ? `data in ${home}` : `checkpoints and datasets in ${data}`;
        console.log(`GPT-2 server listening on http://${host}:${port}/ (${where})`);
      },
    }, app.fetch);
  } catch (e) {
    console.error(
      `Cannot listen on ${config.host}:${config.port}: ${(e as Error).message} (set PORT or HOST)`,
    );
    store.close();
    Deno.exit(1);
  }
  // Only once the port is ours: recover interrupted jobs and start the GPU Workers.
  runner.start();
  // The request path compiled before the first users' burst (rehearsals: no model, no GPU work).
  // Its rounds over the socket wait (at most a minute) for a GPU's Worker, and then go through it.
  warmUp(app, {
    host: config.host,
    port: (server.addr as Deno.NetAddr).port,
    ready: () => generation.whenReady(60_000),
  }).then((ms) => {
    const { worker, here } = generation.rehearsed;
    console.log(
      `Request path warmed up in ${
        Math.round(ms)
      } ms: ${worker} rehearsals through a GPU's Worker, ${here} in this process`,
    );
  }).catch((e) => console.error(`Start-up warm-up of the request path failed: ${(e as Error).message}`));
  const signals = new StopSignals();
  const stop = async (signal: Deno.Signal) => {
    const deadline = Date.now() + config.shutdownSeconds * 1000;
    const left = (reserveMs = 0) => Math.max(0, deadline - Date.now() - reserveMs);
    console.log(stoppingLine(signal, config.shutdownSeconds));
    await runner.stop(left(2000));
    keeper?.stop();
    tokens.stop();
    const hostExit = await host.close(left(500));
    if (hostExit && !hostExit.success) {
      const how = hostExit.signal ? `signal ${hostExit.signal}` : `status ${hostExit.code}`;
      console.error(`GPU host exited with ${how} after its Workers had shut down`);
    }
    await Promise.race([server.shutdown(), new Promise((r) => setTimeout(r, left()))]);
    store.close();
    console.log("Stopped");
    Deno.exit(0);
  };
  const onSignal = (signal: Deno.Signal) => {
    const action = signals.receive(performance.now());
    if (action === "duplicate") return; // the same stop request, forwarded (deno task) or sent to the group
    if (action === "exit") {
      console.error(`Second ${signal}: exiting now; running jobs resume from their newest checkpoint`);
      Deno.exit(signal === "SIGINT" ? 130 : 143);
    }
    stop(signal).catch((e) => {
      console.error(
        `Stopping failed: ${(e as Error).message}; running jobs resume from their newest checkpoint`,
      );
      Deno.exit(1);
    });
  };
  Deno.addSignalListener("SIGINT", () => onSignal("SIGINT"));
  Deno.addSignalListener("SIGTERM", () => onSignal("SIGTERM"));
}

/**
 * This host's leases on the shared queue: its heartbeat reports its GPUs, free Workers and state;
 * a lease another host took stops that job here, and a cancel sent elsewhere reaches it.
 */
function hostLeases(
  store: JobStore,
  runner: () => JobRunner,
  cluster: ClusterConfig,
  gpus: number,
): LeaseKeeper {
  return new LeaseKeeper({
    store,
    hostId: cluster.hostId,
    leaseMs: cluster.leaseSeconds * 1000,
    report: () => ({
      gpus,
      free: runner().gpus().filter((g) => g.state === "idle" && !g.job).length,
      state: runner().draining ? "draining" : "ready",
      info: { pid: Deno.pid },
    }),
    onLost: (id) => runner().leaseLost(id),
    onCancel: (id) => runner().cancelFromElsewhere(id),
    // An unreachable store is the runner's state (logged once, shown by /health), not a line per beat.
    onError: (e) => {
      if (!runner().storeFailed(e)) console.error(`Heartbeat to the job store failed: ${e.message}`);
    },
  });
}
