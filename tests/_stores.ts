/**
 * Runs one store test suite on both engines: SQLite (a file in a temp folder) and PostgreSQL (a
 * throwaway cluster from tests/_postgres.ts, one fresh database per case). Each engine is one
 * Deno test whose steps are the cases, so the cluster starts once per file and always stops; the
 * PostgreSQL test is ignored when no PostgreSQL is installed.
 */

import type { JobStoreEngine } from "../server/jobs/job_store.ts";
import { SqliteJobStore } from "../server/jobs/sqlite_store.ts";
import { PostgresJobStore } from "../server/jobs/postgres_store.ts";
import { PostgresBridgeStore } from "../server/jobs/postgres_bridge.ts";
import { POSTGRES_BIN, startPostgres } from "./_postgres.ts";

/** One case's database: open it (again) as often as the case likes. */
export interface FreshDb {
  engine: "sqlite" | "postgres";
  /** The PostgreSQL engine through the bridge that answers at once (server/jobs/postgres_bridge.ts). */
  bridge?: boolean;
  /** The SQLite file's path or the PostgreSQL URL. */
  location: string;
  open(): Promise<JobStoreEngine>;
}

/** A named case of a suite. */
export type StoreCase = [name: string, fn: (db: FreshDb) => Promise<void>];

/**
 * Registers `title (sqlite)` and `title (postgres)`, each running every case on a fresh database;
 * with `bridge`, the PostgreSQL test runs every case again through PostgresBridgeStore (with
 * `asyncPostgres: false`, only through it: for code that takes a store answering at once).
 */
export function storeSuite(
  title: string,
  cases: StoreCase[],
  opts: { bridge?: boolean; asyncPostgres?: boolean } = {},
): void {
  Deno.test(`${title} (sqlite)`, async (t) => {
    for (const [name, fn] of cases) {
      await t.step(name, async () => {
        const dir = await Deno.makeTempDir({ prefix: "gpt2_store_" });
        const location = `${dir}/jobs.sqlite`;
        try {
          await fn({
            engine: "sqlite",
            location,
            open: () => Promise.try(() => new SqliteJobStore(location)),
          });
        } finally {
          await Deno.remove(dir, { recursive: true });
        }
      });
    }
  });
  Deno.test({
    name: `${title} (postgres)`,
    ignore: !POSTGRES_BIN,
    // postgres.js keeps timers on pooled connections until each pool ends; every case ends its pools.
    sanitizeOps: false,
    sanitizeResources: false,
    fn: async (t) => {
      const cluster = await startPostgres();
      try {
        for (const [name, fn] of cases) {
          if (opts.asyncPostgres !== false) {
            await t.step(name, async () => {
              const location = await cluster.database();
              await fn({ engine: "postgres", location, open: () => PostgresJobStore.open(location) });
            });
          }
          if (!opts.bridge) continue;
          await t.step(`${name} (bridge)`, async () => {
            const location = await cluster.database();
            await fn({
              engine: "postgres",
              bridge: true,
              location,
              open: () => Promise.try(() => PostgresBridgeStore.open(location)),
            });
          });
        }
      } finally {
        await cluster.stop();
      }
    },
  });
}
