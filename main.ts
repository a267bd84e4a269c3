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
  parseGpuRoles,
  spawnGpuWorker,
} from "./jobs/mod.ts";
import { createApp } from "./routes/mod.ts";
import { datasetRoutes } from "./routes/datasets.ts";

/** Server settings, read once from the environment. */
export interface ServerConfig {
  host: string;
  port: number;
  /** Data directory: job store, datasets, checkpoints. */
  home: string;
  token: string | null;
  gpus: number;
}

const LOOPBACK = new Set(["127.0.0.1", "::1", "localhost"]);

/** Reads PORT, HOST, GPT2_HOME, GPT2_API_TOKEN and GPT2_GPUS; refuses a non-loopback host without a token. */
export function readServerConfig(env: { get(key: string): string | undefined }): ServerConfig {
  const host = env.get("HOST") || "127.0.0.1";
  const port = Number(env.get("PORT") ?? "8080");
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new Error(`Invalid PORT "${env.get("PORT")}"`);
  }
  const gpus = Number(env.get("GPT2_GPUS") ?? "1");
  if (!Number.isInteger(gpus) || gpus < 1) throw new Error(`Invalid GPT2_GPUS "${env.get("GPT2_GPUS")}"`);
  const token = env.get("GPT2_API_TOKEN") || null;
  if (!LOOPBACK.has(host) && !token) {
    throw new Error(`Refusing to bind "${host}" without GPT2_API_TOKEN: set a token or bind 127.0.0.1`);
  }
  return { host, port, home: env.get("GPT2_HOME") || "./.gpt2", token, gpus };
}

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
  let roles;
  try {
    roles = parseGpuRoles(Deno.env.get("GPT2_GPU_ROLES"), config.gpus);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(2);
  }
  const generation = new GenerationManager(runner, home, { roles });
  const app = createApp({ runner, generation, token: config.token, extra: [datasetRoutes(home)] });
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
