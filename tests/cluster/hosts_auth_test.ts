/**
 * Two hosts on one PostgreSQL (a throwaway cluster, tests/_postgres.ts), each its own server
 * (tests/_auth.ts) over its own job store connection, reloading tokens every heartbeat: a token
 * made on host A works on B within one heartbeat, and once revoked on A it is refused on A at once
 * and on B within one heartbeat; jobs keep their owner across hosts. Skipped without PostgreSQL.
 */

import assert from "node:assert/strict";
import { POSTGRES_BIN, startPostgres } from "../_postgres.ts";
import { PostgresBridgeStore } from "../../server/jobs/postgres_bridge.ts";
import { authServer, BOOT } from "../_auth.ts";

const HEARTBEAT_MS = 300;

Deno.test({
  name: "a token revoked on host A is refused on host B within one heartbeat; ownership holds across hosts",
  ignore: !POSTGRES_BIN,
  sanitizeOps: false,
  sanitizeResources: false,
  fn: async () => {
    const pg = await startPostgres();
    const stores: PostgresBridgeStore[] = [];
    const servers: Array<Awaited<ReturnType<typeof authServer>>> = [];
    try {
      const url = await pg.database();
      for (let i = 0; i < 2; i++) {
        const store = PostgresBridgeStore.open(url);
        stores.push(store);
        servers.push(await authServer({ store, refreshMs: HEARTBEAT_MS }));
      }
      const [a, b] = servers;
      const alice = await a.mint("alice", ["read", "train"]);
      const bob = await a.mint("bob", ["read"]);
      let peer = 0;
      const status = async (t: typeof a, token: string, path = "/jobs") => {
        // Each poll from its own address: wrong tokens from one address are limited.
        const res = await t.call(token, "GET", path, undefined, {
          remoteAddr: { hostname: `10.0.0.${++peer % 250}` },
        });
        await res.body?.cancel();
        return res.status;
      };
      /** Ms until `t` answers `want`, polling every 10 ms (fails past two heartbeats). */
      const within = async (t: typeof a, token: string, want: number) => {
        const t0 = performance.now();
        while ((await status(t, token)) !== want) {
          assert.ok(performance.now() - t0 < 2 * HEARTBEAT_MS, `host B still answers otherwise than ${want}`);
          await new Promise((r) => setTimeout(r, 10));
        }
        return performance.now() - t0;
      };
      assert.equal(await status(a, alice.token), 200, "host A knows its token at once");
      assert.equal(await status(b, alice.token), 200, "host B reloads for a token of an id it does not hold");

      const id = await a.train(alice.token);
      assert.equal((await (await b.call(alice.token, "GET", `/jobs/${id}`)).json()).owner, "alice");
      assert.equal(await status(b, bob.token, `/jobs/${id}`), 404);

      const revoked = await a.call(BOOT, "DELETE", `/admin/tokens/${alice.id}`);
      assert.equal(revoked.status, 200);
      assert.equal(await status(a, alice.token), 401, "refused on host A at once");
      const took = await within(b, alice.token, 401);
      assert.ok(took <= HEARTBEAT_MS + 100, `host B refused it after ${took} ms`);
      assert.equal(await status(b, bob.token), 200, "other tokens are unaffected");
    } finally {
      for (const s of servers) await s.cleanup();
      for (const s of stores) s.close();
      await pg.stop();
    }
  },
});
