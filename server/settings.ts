/**
 * The server's settings, read once from the environment: where it listens and keeps its data,
 * the API token, who may call it (hosts, CORS origins), which proxies may name the client, and
 * every resource limit with its default. One module, so the table of limits (docs/security.md) and the
 * code cannot drift apart, and a refusal past a limit can name the setting that raises it.
 */

import { type GpuRoles, parseGpuRoles } from "./gpus/roles.ts";
import { join } from "node:path";
import { makeConfig, paramLayout, presetConfig } from "../model/config.ts";
import { parseRange } from "./addresses.ts";
import { LimitError } from "../job/errors.ts";
import type { ModelDims } from "../job/job.ts";

/** Resource limits; each field's setting is in {@link LIMIT_SETTINGS}. */
export interface Limits {
  /** Jobs waiting (queued or interrupted) across all GPUs; `POST /train` answers 429 past it. */
  maxQueuedJobs: number;
  /** Dataset preparations running at once; `POST /datasets` answers 429 past it. */
  maxPreparations: number;
  /** Tokenize workers per preparation. */
  prepareWorkers: number;
  /** Bytes downloaded for one URL dataset, all URLs together; later URLs fail once it is spent. */
  maxDownloadBytes: number;
  /**
   * Open server-sent event streams from one client: its API token when auth is on, else its
   * address (the forwarded one when the peer is a trusted proxy); 429 past it.
   */
  maxStreamsPerClient: number;
  /** Open server-sent event streams in all; 429 past it. */
  maxStreams: number;
  /** Disk for one job's kept checkpoints (`keep_checkpoints` × checkpoint size); 507 past it. */
  maxCheckpointBytes: number;
  /** Largest request body of the job and generation routes, in bytes. */
  maxBodyBytes: number;
  /** Largest request body of the other routes (dataset uploads), in bytes. */
  maxUploadBytes: number;
}

/** The environment variable that sets each limit. */
export const LIMIT_SETTINGS: Record<keyof Limits, string> = {
  maxQueuedJobs: "GPT2_MAX_QUEUED_JOBS",
  maxPreparations: "GPT2_MAX_PREPARATIONS",
  prepareWorkers: "GPT2_PREPARE_WORKERS",
  maxDownloadBytes: "GPT2_MAX_DOWNLOAD_BYTES",
  maxStreamsPerClient: "GPT2_MAX_STREAMS_PER_CLIENT",
  maxStreams: "GPT2_MAX_STREAMS",
  maxCheckpointBytes: "GPT2_MAX_CHECKPOINT_BYTES",
  maxBodyBytes: "GPT2_MAX_BODY_BYTES",
  maxUploadBytes: "GPT2_MAX_UPLOAD_BYTES",
};

/**
 * Streams one generation engine decodes together by default: `DEFAULT_GENERATION_OPTIONS.maxStreams`
 * of worker/serving.ts, which the HTTP side cannot import (it loads the GPU engine); a
 * test keeps the two equal.
 */
export const ENGINE_MAX_STREAMS = 64;

/** Default limits (docs/security.md); one client may fill an engine's batch. */
export function defaultLimits(cores = navigator.hardwareConcurrency ?? 2): Limits {
  return {
    maxQueuedJobs: 100,
    maxPreparations: 2,
    prepareWorkers: Math.max(1, Math.floor(cores / 2)),
    maxDownloadBytes: 2 * 1024 ** 3,
    maxStreamsPerClient: ENGINE_MAX_STREAMS,
    maxStreams: 256,
    maxCheckpointBytes: 64 * 1024 ** 3,
    maxBodyBytes: 64 * 1024,
    maxUploadBytes: 64 * 1024 * 1024,
  };
}

/**
 * Each user's quotas (server/auth/quotas.ts), the defaults of users an admin gave none of their
 * own; the bootstrap token and a server with no token configured have none.
 */
export interface Quotas {
  /** Jobs waiting (queued or interrupted); `POST /train` and `/evaluate` answer 429 past it. */
  queued_jobs: number;
  /**
   * GPUs (Workers: data_parallel × tensor_parallel per job) the user's running jobs may hold; at it,
   * their further jobs wait in the queue while other users' jobs go.
   */
  running_gpus: number;
  /** Generation streams open at once; `/generate` and `/v1/completions` answer 429 past it. */
  streams: number;
  /** GPU-seconds of jobs per UTC day (Workers × seconds running); submits answer 429 past it. */
  gpu_seconds_per_day: number;
}

/** The environment variable that sets each quota's default. */
export const QUOTA_SETTINGS: Record<keyof Quotas, string> = {
  queued_jobs: "GPT2_QUOTA_QUEUED_JOBS",
  running_gpus: "GPT2_QUOTA_RUNNING_GPUS",
  streams: "GPT2_QUOTA_STREAMS",
  gpu_seconds_per_day: "GPT2_QUOTA_GPU_SECONDS_PER_DAY",
};

/** Default quotas of every user (docs/security.md, "Users, tokens and quotas"). */
export function defaultQuotas(): Quotas {
  return { queued_jobs: 20, running_gpus: 2, streams: 16, gpu_seconds_per_day: 86_400 };
}

/** A limit's value and the setting that raises it, as refusals word it: `GPT2_MAX_STREAMS=256`. */
export function limitName(limits: Limits, key: keyof Limits): string {
  return `${LIMIT_SETTINGS[key]}=${limits[key]}`;
}

/** Server settings, read once from the environment. */
export interface ServerConfig {
  host: string;
  port: number;
  /** Data directory: job store, datasets, checkpoints. */
  home: string;
  /** The only folder `POST /datasets` may read `path` and `url_list` sources from. */
  sources: string;
  token: string | null;
  gpus: number;
  /** Origins allowed to call the API from a browser (CORS); empty: none but the server's own. */
  corsOrigins: string[];
  /** Host names (beyond the bound one and loopback) requests may be addressed to. */
  allowedHosts: string[];
  /** Whether URL sources may reach loopback, private, link-local and multicast addresses. */
  allowPrivateUrls: boolean;
  /**
   * Addresses and CIDR ranges of reverse proxies whose `X-Forwarded-For` or `Forwarded` header
   * names the client (GPT2_TRUSTED_PROXIES); from any other peer those headers are ignored.
   */
  trustedProxies: string[];
  limits: Limits;
  /** Every user's default quotas (GPT2_QUOTA_*). */
  quotas: Quotas;
  /** Seconds a graceful stop may take (GPT2_SHUTDOWN_S, default 30). */
  shutdownSeconds: number;
  /**
   * Seconds a running job's Worker may report nothing before the watchdog replaces it and the job
   * resumes from its newest checkpoint (GPT2_STALL_S, default 600; 0 turns the watchdog off).
   */
  stallSeconds: number;
  /** What each GPU is for (GPT2_GPU_ROLES, default every GPU "any"). */
  roles: GpuRoles;
  /** The Deno that runs the GPU host (GPT2_GPU_HOST_DENO, default this one). */
  hostDeno: string | null;
}

/** The names a loopback-bound server answers to. */
export const LOOPBACK_HOSTS: ReadonlySet<string> = new Set(["127.0.0.1", "::1", "localhost"]);

/** The addresses that bind every interface (a server bound to one answers on loopback too). */
export const WILDCARD_HOSTS: ReadonlySet<string> = new Set(["0.0.0.0", "::", ""]);

type Env = { get(key: string): string | undefined };

/** Whether every character of a token is printable ASCII (what an HTTP header can carry). */
function printable(token: string): boolean {
  return /^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$/.test(token);
}

function readToken(env: Env, readTextFile: (path: string) => string): string | null {
  const file = env.get("GPT2_API_TOKEN_FILE");
  const inline = env.get("GPT2_API_TOKEN");
  if (file && inline) throw new Error("Set GPT2_API_TOKEN or GPT2_API_TOKEN_FILE, not both");
  let token = inline || null;
  if (file) {
    try {
      token = readTextFile(file).replace(/\r?\n$/, "");
    } catch (e) {
      throw new Error(`Cannot read GPT2_API_TOKEN_FILE "${file}": ${(e as Error).message}`);
    }
    if (!token) throw new Error(`GPT2_API_TOKEN_FILE "${file}" is empty`);
  }
  if (token !== null && !printable(token)) {
    throw new Error(
      "Invalid API token: use printable ASCII characters only (no control characters, no leading or trailing spaces)",
    );
  }
  return token;
}

function positive(env: Env, name: string, fallback: number): number {
  const raw = env.get(name);
  if (raw === undefined || raw === "") return fallback;
  const n = Number(raw);
  if (!Number.isSafeInteger(n) || n < 1) {
    throw new Error(`Invalid ${name} "${raw}": expected a positive integer`);
  }
  return n;
}

function list(env: Env, name: string): string[] {
  return (env.get(name) ?? "").split(",").map((s) => s.trim()).filter(Boolean);
}

/**
 * Reads PORT, HOST, GPT2_HOME, GPT2_SOURCES, GPT2_API_TOKEN (or GPT2_API_TOKEN_FILE), GPT2_GPUS,
 * GPT2_CORS_ORIGINS, GPT2_ALLOWED_HOSTS, GPT2_ALLOW_PRIVATE_URLS, GPT2_TRUSTED_PROXIES, the
 * limits of {@link LIMIT_SETTINGS} and the quotas of {@link QUOTA_SETTINGS}; refuses a non-loopback host without a token.
 */
export function readServerConfig(
  env: Env,
  readTextFile: (path: string) => string = Deno.readTextFileSync,
): ServerConfig {
  const host = env.get("HOST") || "127.0.0.1";
  const port = Number(env.get("PORT") ?? "8080");
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new Error(`Invalid PORT "${env.get("PORT")}"`);
  }
  const gpus = Number(env.get("GPT2_GPUS") ?? "1");
  if (!Number.isInteger(gpus) || gpus < 1) throw new Error(`Invalid GPT2_GPUS "${env.get("GPT2_GPUS")}"`);
  const token = readToken(env, readTextFile);
  if (!LOOPBACK_HOSTS.has(host) && !token) {
    throw new Error(`Refusing to bind "${host}" without GPT2_API_TOKEN: set a token or bind 127.0.0.1`);
  }
  const corsOrigins = list(env, "GPT2_CORS_ORIGINS").map((o) => {
    let u: URL;
    try {
      u = new URL(o);
    } catch {
      throw new Error(
        `Invalid GPT2_CORS_ORIGINS entry "${o}": expected an origin such as "https://example.com"`,
      );
    }
    if (u.origin === "null" || `${u.origin}/` !== u.href.replace(/\/?$/, "/")) {
      throw new Error(
        `Invalid GPT2_CORS_ORIGINS entry "${o}": expected an origin such as "https://example.com"`,
      );
    }
    return u.origin;
  });
  const trustedProxies = list(env, "GPT2_TRUSTED_PROXIES");
  const badProxy = trustedProxies.find((e) => parseRange(e) === null);
  if (badProxy !== undefined) {
    throw new Error(
      `Invalid GPT2_TRUSTED_PROXIES entry "${badProxy}": expected an IP address or a CIDR range such as "10.0.0.0/8" or "fd00::/8"`,
    );
  }
  const defaults = defaultLimits();
  const limits = Object.fromEntries(
    (Object.keys(LIMIT_SETTINGS) as Array<keyof Limits>).map((
      k,
    ) => [k, positive(env, LIMIT_SETTINGS[k], defaults[k])]),
  ) as unknown as Limits;
  const quotaDefaults = defaultQuotas();
  const quotas = Object.fromEntries(
    (Object.keys(QUOTA_SETTINGS) as Array<keyof Quotas>).map((k) => [
      k,
      positive(env, QUOTA_SETTINGS[k], quotaDefaults[k]),
    ]),
  ) as unknown as Quotas;
  const home = env.get("GPT2_HOME") || "./.gpt2";
  const allowPrivate = env.get("GPT2_ALLOW_PRIVATE_URLS") ?? "";
  if (!["", "0", "1"].includes(allowPrivate)) {
    throw new Error(`Invalid GPT2_ALLOW_PRIVATE_URLS "${allowPrivate}": expected "0" or "1"`);
  }
  const shutdownSeconds = Number(env.get("GPT2_SHUTDOWN_S") ?? "30");
  if (!(shutdownSeconds > 0)) throw new Error(`Invalid GPT2_SHUTDOWN_S "${env.get("GPT2_SHUTDOWN_S")}"`);
  const stallSeconds = Number(env.get("GPT2_STALL_S") ?? "600");
  if (!(stallSeconds >= 0) || !Number.isFinite(stallSeconds)) {
    throw new Error(
      `Invalid GPT2_STALL_S "${env.get("GPT2_STALL_S")}": expected seconds (0 turns the watchdog off)`,
    );
  }
  return {
    host,
    port,
    home,
    shutdownSeconds,
    stallSeconds,
    sources: env.get("GPT2_SOURCES") || join(home, "sources"),
    token,
    gpus,
    corsOrigins,
    allowedHosts: list(env, "GPT2_ALLOWED_HOSTS").map((h) => h.toLowerCase()),
    allowPrivateUrls: allowPrivate === "1",
    trustedProxies,
    limits,
    quotas,
    roles: parseGpuRoles(env.get("GPT2_GPU_ROLES"), gpus),
    hostDeno: env.get("GPT2_GPU_HOST_DENO") || null,
  };
}

/**
 * Bytes one checkpoint of `model` takes on disk: weights, AdamW's two moments (float32 each),
 * so three times the parameter buffer; null when the model is invalid (the submit names why).
 */
export function checkpointBytes(model: string | ModelDims): number | null {
  try {
    const config = typeof model === "string" ? presetConfig(model) : makeConfig(model);
    return paramLayout(config).totalSize * 4 * 3;
  } catch {
    return null;
  }
}

/**
 * Refuses a training job past a limit: 429 when `waiting` jobs already fill the queue, 507 when
 * its kept checkpoints (`keep_checkpoints` × checkpoint size) would exceed the disk allowed per job.
 */
export function admitTrainJob(
  limits: Limits,
  waiting: number,
  req: { model: string | ModelDims; keep_checkpoints: number },
): void {
  if (waiting >= limits.maxQueuedJobs) {
    throw new LimitError(
      429,
      `Too many queued jobs: ${waiting} are waiting (limit ${
        limitName(limits, "maxQueuedJobs")
      }); retry when one starts`,
    );
  }
  const each = checkpointBytes(req.model);
  if (each !== null && each * req.keep_checkpoints > limits.maxCheckpointBytes) {
    throw new LimitError(
      507,
      `Checkpoints would need ${
        each * req.keep_checkpoints
      } bytes (keep_checkpoints ${req.keep_checkpoints} × ${each} bytes), ` +
        `over the per-job disk limit ${limitName(limits, "maxCheckpointBytes")}: lower keep_checkpoints`,
      "keep_checkpoints",
    );
  }
}

/** Settings of a server that shares its jobs with other hosts (docs/cluster.md). */
export interface ClusterConfig {
  /** PostgreSQL URL (GPT2_DATABASE_URL); null: the embedded SQLite store, one host. */
  databaseUrl: string | null;
  /** Seconds a host's claim on a job lasts without a heartbeat (GPT2_LEASE_S, default 30). */
  leaseSeconds: number;
  /** Checkpoints and datasets on storage every host sees (GPT2_SHARED_DIR); null: GPT2_HOME. */
  sharedDir: string | null;
  /** This host's id (GPT2_HOST_ID, default "<hostname>:<port>"): stable across its restarts. */
  hostId: string;
}

/**
 * Reads GPT2_DATABASE_URL, GPT2_LEASE_S, GPT2_SHARED_DIR and GPT2_HOST_ID. Kept apart from
 * {@link readServerConfig} so a one-host server's settings are what they always were.
 */
export function readClusterConfig(env: Env, hostname: () => string = Deno.hostname): ClusterConfig {
  const url = env.get("GPT2_DATABASE_URL") || null;
  if (url !== null && !/^postgres(ql)?:\/\//.test(url)) {
    throw new Error(
      `Invalid GPT2_DATABASE_URL "${url.replace(/:[^:@/]*@/, ":***@")}": ` +
        `expected postgres://user:password@host:5432/database (unset: the embedded SQLite store)`,
    );
  }
  const rawLease = env.get("GPT2_LEASE_S") ?? "30";
  const leaseSeconds = Number(rawLease);
  if (!(leaseSeconds >= 1) || !Number.isFinite(leaseSeconds)) {
    throw new Error(`Invalid GPT2_LEASE_S "${rawLease}": expected seconds, at least 1`);
  }
  const hostId = env.get("GPT2_HOST_ID") || `${hostname()}:${env.get("PORT") ?? "8080"}`;
  if (!/^[\x21-\x7e]{1,128}$/.test(hostId)) {
    throw new Error(
      `Invalid GPT2_HOST_ID "${hostId}": expected 1 to 128 printable ASCII characters, no spaces`,
    );
  }
  return { databaseUrl: url, leaseSeconds, sharedDir: env.get("GPT2_SHARED_DIR") || null, hostId };
}
