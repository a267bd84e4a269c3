/**
 * A multi-user server for tests, through `app.request()`: the real store, runner, token check,
 * ownership and quotas, a scripted GPU Worker (tests/fakes), a shared Hugging Face model folder
 * `tiny`, the dataset routes, and the bootstrap token {@link BOOT}. Helpers make users' tokens
 * through `POST /admin/tokens` and send requests with a token.
 */

import assert from "node:assert/strict";
import { ScriptedWorker } from "./fakes/fake_worker.ts";
import { type AppOptions, createApp, FailureLimiter } from "../server/routes/mod.ts";
import { datasetRoutes } from "../server/routes/datasets.ts";
import { Access, QuotaBook, TokenAuth } from "../server/auth/mod.ts";
import { defaultQuotas, type Quotas } from "../server/settings.ts";
import { GenerationManager } from "../server/generate/mod.ts";
import { JobRunner, JobStore } from "../server/jobs/mod.ts";
import { getDataset, isBuiltinName } from "../data/mod.ts";

/** The bootstrap admin token of {@link authServer}. */
export const BOOT = "bootstrap-admin-token";

const tinyDims = { n_layer: 2, n_head: 4, n_embd: 64, n_positions: 64 };

/** Writes a checkpoint manifest `checkpoints/<id>/iter_0000005` (the scripted Worker reads no weights). */
export async function fakeCheckpoint(root: string, id: string): Promise<void> {
  const ck = `${root}/checkpoints/${id}/iter_0000005`;
  await Deno.mkdir(ck, { recursive: true });
  await Deno.writeTextFile(
    `${ck}/manifest.json`,
    JSON.stringify({
      format: "gpt2-webgpu-checkpoint",
      version: 1,
      job_id: id,
      name: "iter_0000005",
      iteration: 5,
      created_at: "2025-01-01T00:00:00.000Z",
      model: { ...tinyDims, vocab_size: 50257, padded_vocab_size: 50304 },
      metrics: { loss: 1, val_loss: null },
    }),
  );
  await Deno.writeTextFile(`${ck}/config.json`, "{}");
}

/** The server of a test. */
export type AuthServer = Awaited<ReturnType<typeof authServer>>;

/**
 * Starts the server over `store` (default a fresh SQLite one); `gpus` scripted Workers; with
 * `refreshMs`, the tokens are reloaded from the store that often (a host's heartbeat).
 */
export async function authServer(
  opts: {
    store?: JobStore;
    gpus?: number;
    quotas?: Partial<Quotas>;
    refreshMs?: number;
    app?: Partial<AppOptions>;
  } = {},
) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_auth_" });
  await Deno.mkdir(`${root}/models/tiny`, { recursive: true });
  await Deno.writeTextFile(
    `${root}/models/tiny/config.json`,
    JSON.stringify({ ...tinyDims, vocab_size: 50257 }),
  );
  await Deno.writeFile(`${root}/models/tiny/model.safetensors`, new Uint8Array(8));
  const store = opts.store ?? new JobStore(":memory:");
  const workers: ScriptedWorker[] = [];
  const quotas = new QuotaBook(store, { ...defaultQuotas(), ...opts.quotas });
  const runner = new JobRunner(store, {
    root,
    gpus: opts.gpus ?? 1,
    spawn: () => {
      const w = new ScriptedWorker();
      workers.push(w);
      return w;
    },
    datasetExists: async (id) => isBuiltinName(id) || (await getDataset(root, id)) !== undefined,
    skipOwners: () => quotas.atRunningQuota(),
  });
  runner.start();
  await new Promise((r) => setTimeout(r, 0));
  const generation = new GenerationManager(runner.pool, root);
  const tokens = new TokenAuth(store, { bootstrap: [BOOT], refreshMs: opts.refreshMs ?? 60_000 });
  if (opts.refreshMs !== undefined) tokens.start();
  const access = new Access(store, (id) => runner.checkpointDir(id));
  const failures = new FailureLimiter();
  const app = createApp({
    runner,
    generation,
    token: BOOT,
    auth: { tokens, access, quotas, failures },
    extra: [datasetRoutes(root, { workers: 1, waitMs: 30_000, auth: { access, store } })],
    ...opts.app,
  });

  /** A request with `token` (none when null); a body is sent as JSON. */
  const call = (
    token: string | null,
    method: string,
    path: string,
    body?: unknown,
    env?: Record<string, unknown>,
  ) => {
    const headers: Record<string, string> = {};
    if (token !== null) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    return app.request(
      path,
      { method, headers, body: body === undefined ? undefined : JSON.stringify(body) },
      env,
    );
  };
  /** A new token of `user` with `scopes`, made by the bootstrap admin. */
  const mint = async (user: string, scopes: string[], extra: Record<string, unknown> = {}) => {
    const res = await call(BOOT, "POST", "/admin/tokens", { user, scopes, ...extra });
    const body = await res.json();
    assert.equal(res.status, 201, JSON.stringify(body));
    return body as { token: string; id: string };
  };
  /** Submits a small training job as `token`'s user; returns its id. */
  const train = async (token: string, extra: Record<string, unknown> = {}) => {
    const res = await call(token, "POST", "/train", {
      model: "gpt2-tiny",
      dataset: "sotu",
      train_iters: 10,
      batch_size: 2,
      seq_len: 16,
      ...extra,
    });
    const body = await res.json();
    assert.equal(res.status, 202, JSON.stringify(body));
    return body.id as string;
  };
  const cleanup = async () => {
    tokens.stop();
    runner.shutdown();
    if (!opts.store) store.close();
    await Deno.remove(root, { recursive: true });
  };
  return {
    app,
    root,
    store,
    runner,
    workers,
    tokens,
    access,
    quotas,
    generation,
    call,
    mint,
    train,
    cleanup,
  };
}
