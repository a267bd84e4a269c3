/**
 * The job store's schema, shared by its two engines (server/jobs/sqlite_store.ts and
 * server/jobs/postgres_store.ts): the ordered migrations, written once in SQLite's SQL and
 * translated for PostgreSQL by a few fixed rewrites ({@link postgresDialect}), so both engines
 * run the same migrations and no schema can drift between them. The statements that read and
 * write it are server/jobs/store_sql.ts's.
 *
 * Version 1 is the first release's schema (`create if not exists`, so a directory it wrote is
 * adopted as it is); 2 adds the status index and the readiness probe's table; 3 adds what
 * several hosts on one database need: the lease on each job (holder, fencing epoch, expiry in
 * milliseconds of the database's clock), the Workers a job needs (placement) and the hosts; 4
 * adds users: each job's owner, hashed tokens, owned resources and the audit trail.
 */

import { FINISHED_STATUSES, type JobStatus, type TrainConfig } from "../../job/job.ts";
import type { Lease } from "./job_store.ts";

const SCHEMA_V1 = `
create table if not exists jobs (
  seq integer primary key autoincrement,
  id text not null unique,
  status text not null,
  gpu integer not null,
  config text not null,
  created_at text not null,
  started_at text,
  finished_at text,
  iteration integer not null default 0,
  metrics text not null,
  error text,
  cancel_requested integer not null default 0,
  resumes integer not null default 0,
  resumed_from text,
  last_checkpoint text
);
create index if not exists jobs_queue on jobs(gpu, status, seq);
create table if not exists metrics (
  job_id text not null,
  iteration integer not null,
  split text not null,
  loss real not null,
  perplexity real,
  lr real,
  tokens_per_s real,
  at text not null
);
create index if not exists metrics_job on metrics(job_id, iteration);
create table if not exists events (
  id integer primary key autoincrement,
  job_id text not null,
  type text not null,
  data text not null,
  at text not null
);
create index if not exists events_job on events(job_id, id);
`;

/** Ordered migrations: entry i brings the schema from version i to i + 1 (SQLite's SQL). */
export const MIGRATIONS: readonly string[] = [
  SCHEMA_V1,
  // 2: listing by status pages on (status, seq); a one-row table the readiness probe writes.
  `create index if not exists jobs_status on jobs(status, seq);
   create table if not exists probe (id integer primary key check (id = 1), at text not null);`,
  // 3: several hosts on one database. A job is held under a lease: host_id holds it until
  // lease_until (ms, the database's clock); lease_epoch grows by one at every claim and fences
  // every write of the holder. workers = data_parallel × tensor_parallel, what a host must have
  // free to claim it. hosts: each server's GPUs, free Workers, state and last heartbeat.
  `alter table jobs add column host_id text;
   alter table jobs add column lease_epoch bigint not null default 0;
   alter table jobs add column lease_until bigint;
   alter table jobs add column workers integer not null default 1;
   create table if not exists hosts (
     id text primary key,
     gpus integer not null,
     free integer not null,
     state text not null,
     started_at text not null,
     seen_ms bigint not null,
     info text not null
   );`,
  // 4: several users (server/auth/). A job belongs to its owner (null: made before users
  // existed, or with no token configured; only admins see it). Tokens are kept as the SHA-256 of
  // the token, never the token; revoked_at set revokes one on every host. resources: who owns
  // what is not a job (a dataset from an upload, a resharded copy), owner '*' for shared; audit:
  // who created, cancelled or deleted what.
  `alter table jobs add column owner text;
   create index if not exists jobs_owner on jobs(owner, status, seq);
   create table if not exists users (
     name text primary key,
     created_at text not null,
     quotas text not null
   );
   create table if not exists tokens (
     id text primary key,
     hash text not null unique,
     name text not null,
     user_name text not null,
     scopes text not null,
     created_at text not null,
     expires_at text,
     last_used_at text,
     revoked_at text
   );
   create table if not exists resources (
     kind text not null,
     id text not null,
     owner text not null,
     created_at text not null,
     primary key (kind, id, owner)
   );
   create table if not exists audit (
     id integer primary key autoincrement,
     at text not null,
     user_name text,
     action text not null,
     target text,
     detail text not null
   );`,
];

/** The schema version this server writes. */
export const SCHEMA_VERSION = MIGRATIONS.length;

/**
 * A migration in PostgreSQL's SQL. The rewrites are the whole difference between the engines:
 * SQLite's autoincrement key becomes an identity column, `real` (4 bytes in PostgreSQL, 8 in
 * SQLite) becomes `double precision`, and the metrics table, which SQLite orders by its implicit
 * rowid, gets an explicit `rowid` so both engines order the history with the same query.
 */
export function postgresDialect(sql: string): string {
  return sql
    .replaceAll("integer primary key autoincrement", "bigint generated by default as identity primary key")
    .replace(/\breal\b/g, "double precision")
    .replace(
      "create table if not exists metrics (",
      "create table if not exists metrics (\n  rowid bigint generated always as identity,",
    );
}

/** A write refused because the writer's lease on the job is gone (another host claimed it). */
export class LeaseLostError extends Error {
  constructor(readonly lease: Lease) {
    super(
      `Job "${lease.job_id}" is no longer held by host "${lease.host_id}" (lease epoch ${lease.epoch}): ` +
        `another host took it over, so this host stops it and writes nothing more to it`,
    );
    this.name = "LeaseLostError";
  }
}

/**
 * The job store cannot be reached now: PostgreSQL down, restarting or cut off, or SQLite's disk
 * full, locked or failing. A state that passes, not a fault of the call: the runner buffers what
 * may wait, routes answer 503, and `/health` shows it.
 */
export class StoreUnavailableError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "StoreUnavailableError";
  }
}

/**
 * postgres.js connection errors (its own codes and the socket's), and SQLSTATEs of a server that
 * is going away or not yet there: class 08 (connection exception), 57P01-57P03 (admin or crash
 * shutdown, cannot connect now), 53300 (too many connections).
 */
const PG_UNREACHABLE = new RegExp(
  "^(CONNECTION_(CLOSED|ENDED|DESTROYED)|CONNECT_TIMEOUT|E(CONNREFUSED|CONNRESET|PIPE|TIMEDOUT|HOSTUNREACH|NETUNREACH|AI_AGAIN)|ENOTFOUND|08...|57P0[123]|53300)$",
);
/** SQLite's primary result codes for a database it cannot use now: BUSY, LOCKED, IOERR, FULL, CANTOPEN. */
const SQLITE_UNAVAILABLE = new Set([5, 6, 10, 13, 14]);

/** Whether `e` says the job store is unreachable now (see {@link StoreUnavailableError}). */
export function isStoreUnavailable(e: unknown): boolean {
  if (e instanceof StoreUnavailableError) return true;
  const err = e as { code?: unknown; errcode?: unknown } | null;
  if (!err || typeof err !== "object") return false;
  if (err.code === "ERR_SQLITE_ERROR" && typeof err.errcode === "number") {
    return SQLITE_UNAVAILABLE.has(err.errcode & 0xff);
  }
  return typeof err.code === "string" && PG_UNREACHABLE.test(err.code);
}

/** Whether a job can no longer change. */
export function isFinished(status: JobStatus): boolean {
  return FINISHED_STATUSES.includes(status);
}

/** GPU Workers a job takes on one host: data_parallel × tensor_parallel. */
export function workersOf(config: TrainConfig): number {
  return (config.data_parallel ?? 1) * (config.tensor_parallel ?? 1);
}
