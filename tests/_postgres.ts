/**
 * A throwaway PostgreSQL cluster for tests: `initdb` in a temp folder, `pg_ctl start` on a free
 * loopback port (trust authentication, fsync off), a fresh database per test, `pg_ctl stop` and
 * the folder removed at the end. Finds Debian's binaries (/usr/lib/postgresql/N/bin) when they
 * are not on PATH; scripts/test.sh installs them on CI. initdb refuses to run as root, so as
 * root the cluster runs as the `postgres` user (Debian's package creates it) through `runuser`.
 *
 * Tests that need it skip with `ignore: !POSTGRES_BIN` when no PostgreSQL is installed.
 */

import postgres from "postgres";

function findBin(): string | null {
  const dirs = (Deno.env.get("PATH") ?? "").split(":");
  try {
    const versions = [...Deno.readDirSync("/usr/lib/postgresql")].map((e) => e.name)
      .sort((a, b) => Number(b) - Number(a));
    dirs.push(...versions.map((v) => `/usr/lib/postgresql/${v}/bin`));
  } catch {
    // not Debian's layout
  }
  for (const d of dirs) {
    if (isPostgresBin(d)) return Deno.realPathSync(`${d}/initdb`).replace(/\/initdb$/, "");
  }
  return null;
}

/** The folder with initdb and pg_ctl, or null when PostgreSQL is not installed. */
export const POSTGRES_BIN: string | null = findBin();

/** A running throwaway cluster. */
export interface PgCluster {
  /** URL of the `postgres` database (superuser, trust). */
  url: string;
  /** Creates an empty database and returns its URL. */
  database(): Promise<string>;
  /** Stops the server and removes its folder. */
  stop(): Promise<void>;
  /** Stops the server as a crash or `pg_ctl stop -m immediate` does, keeping its data (an outage). */
  halt(): Promise<void>;
  /** Starts a halted server again on the same port and data. */
  resume(): Promise<void>;
}

/** Where a cluster's binaries are, when not found by themselves (bench/hosts_bench.ts's `--pg-bin`). */
export interface PostgresOptions {
  /** Folder holding initdb, pg_ctl and postgres (default: {@link POSTGRES_BIN}). */
  bin?: string;
  /** Folder of shared libraries those binaries need, put first on their LD_LIBRARY_PATH. */
  libDir?: string;
  /**
   * Commit synchronously (default: off, for speed), so a server stopped with `halt()` (immediate,
   * as a crash) loses no committed write, as a real database would not.
   */
  durable?: boolean;
}

/** Whether `bin` holds initdb and pg_ctl. */
export function isPostgresBin(bin: string): boolean {
  try {
    return Deno.statSync(`${bin}/initdb`).isFile && Deno.statSync(`${bin}/pg_ctl`).isFile;
  } catch {
    return false;
  }
}

async function run(cmd: string[], asUser: string | null, libDir?: string): Promise<string> {
  const argv = asUser ? ["runuser", "-u", asUser, "--", ...cmd] : cmd;
  const lib = Deno.env.get("LD_LIBRARY_PATH");
  const env: Record<string, string> = libDir ? { LD_LIBRARY_PATH: lib ? `${libDir}:${lib}` : libDir } : {};
  const out = await new Deno.Command(argv[0], { args: argv.slice(1), env, stdout: "piped", stderr: "piped" })
    .output();
  const text = new TextDecoder().decode(out.stdout) + new TextDecoder().decode(out.stderr);
  if (!out.success) throw new Error(`Cannot run "${argv.join(" ")}" (exit ${out.code}): ${text.trim()}`);
  return text;
}

function freePort(): number {
  const l = Deno.listen({ hostname: "127.0.0.1", port: 0 });
  const port = (l.addr as Deno.NetAddr).port;
  l.close();
  return port;
}

let databases = 0;

/**
 * Starts a cluster (about a second). Throws naming the step that failed. As root it runs as the
 * `postgres` user, or `nobody` where there is none (then the binaries must be readable by all).
 */
export async function startPostgres(opts: PostgresOptions = {}): Promise<PgCluster> {
  const bin = opts.bin ?? POSTGRES_BIN;
  if (!bin) throw new Error("Cannot start PostgreSQL: no initdb found (apt-get install postgresql)");
  if (!isPostgresBin(bin)) throw new Error(`Cannot start PostgreSQL: no initdb and pg_ctl in "${bin}"`);
  const libDir = opts.libDir;
  const root = Deno.uid() === 0;
  const dir = await Deno.makeTempDir({ prefix: "gpt2_pg_" });
  let user: string | null = null;
  if (root) {
    user = await run(["id", "-u", "postgres"], null).then(() => "postgres", () => "nobody");
    const uid = Number((await run(["id", "-u", user], null)).trim());
    const gid = Number((await run(["id", "-g", user], null)).trim());
    await Deno.chown(dir, uid, gid);
  }
  const data = `${dir}/data`;
  const port = freePort();
  await run(
    [
      `${bin}/initdb`,
      "-D",
      data,
      "-A",
      "trust",
      "-U",
      "postgres",
      "--no-sync",
      "-E",
      "UTF8",
    ],
    user,
    libDir,
  );
  const options = `-p ${port} -k ${dir} -c listen_addresses=127.0.0.1 -c fsync=off ` +
    `${opts.durable ? "" : "-c synchronous_commit=off "}-c full_page_writes=off -c max_connections=200`;
  const start = () =>
    run([`${bin}/pg_ctl`, "-D", data, "-o", options, "-l", `${dir}/log`, "-w", "start"], user, libDir);
  await start();
  const url = `postgres://postgres@127.0.0.1:${port}/postgres`;
  const admin = postgres(url, { max: 1, onnotice: () => {} });
  return {
    url,
    async database() {
      const name = `t${Deno.pid}_${++databases}`;
      await admin.unsafe(`create database ${name}`);
      return `postgres://postgres@127.0.0.1:${port}/${name}`;
    },
    async halt() {
      await run([`${bin}/pg_ctl`, "-D", data, "-m", "immediate", "-w", "stop"], user, libDir);
    },
    async resume() {
      await start();
    },
    async stop() {
      await admin.end({ timeout: 1 });
      await run([`${bin}/pg_ctl`, "-D", data, "-m", "immediate", "-w", "stop"], user, libDir).catch(
        () => {},
      );
      await Deno.remove(dir, { recursive: true });
    },
  };
}
