/**
 * `deno task tokens`: users' API tokens from the command line, on the job store the server uses
 * (`$GPT2_HOME/jobs.sqlite`, or PostgreSQL with GPT2_DATABASE_URL). The same as
 * `POST/GET/DELETE /admin/tokens`, for the first token of a server or when no admin token is at hand.
 *
 *   deno task tokens create --user NAME --scopes read,train,generate [--expires 30d] [--name LABEL]
 *   deno task tokens list [--user NAME]
 *   deno task tokens revoke ID
 *
 * `create` prints the token once, alone on stdout (the rest goes to stderr): the store keeps only
 * its hash. A revocation holds on every running server within one heartbeat.
 */

import { parseArgs } from "node:util";
import { JobStore } from "../server/jobs/mod.ts";
import { readClusterConfig, readServerConfig } from "../server/settings.ts";
import { PostgresBridgeStore } from "../server/jobs/postgres_bridge.ts";
import { parseExpiry, parseScopes, TOKEN_ID, TokenAuth, USER_NAME } from "../server/auth/mod.ts";

const USAGE = `Usage:
  deno task tokens create --user NAME --scopes read,train,generate[,admin] [--expires 30d] [--name LABEL]
  deno task tokens list [--user NAME]
  deno task tokens revoke ID`;

/** Where the command writes: the token itself to `out`, everything else to `err`. */
export interface CliOutput {
  out: (line: string) => void;
  err: (line: string) => void;
}

/** Runs one `tokens` command on `store`; returns the exit code. */
export function tokensCli(args: string[], store: JobStore, io: CliOutput): number {
  let parsed;
  try {
    parsed = parseArgs({
      args,
      allowPositionals: true,
      options: {
        user: { type: "string" },
        scopes: { type: "string" },
        expires: { type: "string" },
        name: { type: "string" },
      },
    });
  } catch (e) {
    io.err(`${(e as Error).message}\n${USAGE}`);
    return 2;
  }
  const [command, ...rest] = parsed.positionals;
  const v = parsed.values;
  const auth = new TokenAuth(store);
  try {
    if (command === "create" && rest.length === 0) {
      if (!v.user || !USER_NAME.test(v.user)) {
        throw new Error(`Invalid --user "${v.user ?? ""}": use 1-64 letters, digits, '.', '_' or '-'`);
      }
      const scopes = parseScopes(v.scopes ?? "");
      const expiresAt = v.expires === undefined ? null : parseExpiry(v.expires);
      const { token, record } = auth.create({ user: v.user, name: v.name, scopes, expiresAt });
      store.addAudit({
        user: null,
        action: "token.create",
        target: record.id,
        detail: { user: record.user, scopes, via: "cli" },
      });
      io.err(
        `Token ${record.id} for user "${record.user}" (scopes ${scopes.join(",")}${
          expiresAt ? `, expires ${expiresAt}` : ", no expiry"
        }); it is shown only now:`,
      );
      io.out(token);
      return 0;
    }
    if (command === "list" && rest.length === 0) {
      const rows = auth.list(v.user);
      io.out(["ID", "USER", "NAME", "SCOPES", "CREATED", "EXPIRES", "LAST USED", "STATE"].join("\t"));
      const now = Date.now();
      for (const t of rows) {
        const state = t.revoked_at
          ? "revoked"
          : t.expires_at && Date.parse(t.expires_at) <= now
          ? "expired"
          : "active";
        io.out(
          [
            t.id,
            t.user,
            t.name || "-",
            t.scopes.join(","),
            t.created_at,
            t.expires_at ?? "-",
            t.last_used_at ?? "-",
            state,
          ]
            .join("\t"),
        );
      }
      return 0;
    }
    if (command === "revoke" && rest.length === 1) {
      const id = rest[0];
      const known = TOKEN_ID.test(id) && auth.list().find((t) => t.id === id);
      if (!known) throw new Error(`Token "${id.slice(0, 40)}" not found: see deno task tokens list`);
      if (auth.revoke(id)) {
        store.addAudit({
          user: null,
          action: "token.revoke",
          target: id,
          detail: { user: known.user, via: "cli" },
        });
        io.err(`Revoked ${id} (user "${known.user}"): every server refuses it within one heartbeat`);
      } else io.err(`Token ${id} was revoked already`);
      return 0;
    }
  } catch (e) {
    io.err((e as Error).message);
    return 1;
  }
  io.err(USAGE);
  return 2;
}

if (import.meta.main) {
  let store: JobStore;
  try {
    const config = readServerConfig(Deno.env);
    const cluster = readClusterConfig(Deno.env);
    // A data folder the server has not made yet (the first token of a new server).
    if (!cluster.databaseUrl) Deno.mkdirSync(config.home, { recursive: true });
    store = cluster.databaseUrl
      ? PostgresBridgeStore.open(cluster.databaseUrl)
      : new JobStore(`${config.home}/jobs.sqlite`);
  } catch (e) {
    console.error((e as Error).message);
    Deno.exit(1);
  }
  const code = tokensCli(Deno.args, store, { out: (l) => console.log(l), err: (l) => console.error(l) });
  store.close();
  Deno.exit(code);
}
