/**
 * The server's entry point, and only wiring: read the configuration from the environment once,
 * open the job store, start the job runner (one GPU Worker per GPU), build the routes and serve
 * them. Stopping (SIGINT/SIGTERM) terminates the Workers and exits explicitly, since a process
 * whose Workers held GPU devices can otherwise hang at exit.
 */

import { getDataset, isBuiltinName } from "./data/mod.ts";
import {
  GenerationManager,
  JobRunner,
  JobStore,
  lockDataDir,
  readServerConfig,
  type ServerConfig,
  spawnGpuWorker,
} from "./jobs/mod.ts";
import { createApp } from "./routes/mod.ts";
import { datasetRoutes } from "./routes/datasets.ts";

if (import.meta.main) {
  let config: ServerConfig;
  try {
    config = readServerConfig(Deno.env);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(2);
  }
  const { home } = config;
  await Deno.mkdir(home, { recursive: true });
  await Deno.mkdir(config.sources, { recursive: true });
  try {
    await lockDataDir(home);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(1);
  }
  const store = new JobStore(`${home}/jobs.sqlite`);
  const runner = new JobRunner(store, {
    root: home,
    gpus: config.gpus,
    spawn: spawnGpuWorker,
    datasetExists: async (id) =>
      isBuiltinName(id) || (await getDataset(home, id).catch(() => undefined)) !== undefined,
  });
  const generation = new GenerationManager(runner, home);
  const datasets = datasetRoutes(home, {
    sources: config.sources,
    limits: config.limits,
    allowPrivateUrls: config.allowPrivateUrls,
  });
  const app = createApp({
    runner,
    generation,
    token: config.token,
    limits: config.limits,
    host: config.host,
    port: config.port,
    allowedHosts: config.allowedHosts,
    corsOrigins: config.corsOrigins,
    home,
    extra: [datasets],
  });
  let server: Deno.HttpServer;
  try {
    server = Deno.serve({
      hostname: config.host,
      port: config.port,
      onListen: ({ hostname, port }) => {
        const host = hostname.includes(":") ? `[${hostname}]` : hostname;
        console.log(`GPT-2 server listening on http://${host}:${port}/ (data in ${home})`);
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
  const stop = async () => {
    runner.shutdown();
    // Open event streams would keep shutdown() waiting: give them a moment, then exit.
    await Promise.race([server.shutdown(), new Promise((r) => setTimeout(r, 1000))]);
    store.close();
    Deno.exit(0);
  };
  Deno.addSignalListener("SIGINT", stop);
  Deno.addSignalListener("SIGTERM", stop);
}
