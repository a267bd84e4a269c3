/**
 * readClusterConfig() (server/settings.ts): a one-host server by default (SQLite, GPT2_HOME),
 * the PostgreSQL URL, lease, shared folder and host id when set, and refusals that name the
 * setting (without the URL's password).
 */

import assert from "node:assert/strict";
import { readClusterConfig } from "../../server/settings.ts";

const env = (vars: Record<string, string>) => ({ get: (k: string) => vars[k] });

Deno.test("readClusterConfig() defaults to one host on SQLite and reads the shared settings when set", () => {
  assert.deepEqual(readClusterConfig(env({}), () => "gpu1"), {
    databaseUrl: null,
    leaseSeconds: 30,
    sharedDir: null,
    hostId: "gpu1:8080",
  });
  assert.deepEqual(
    readClusterConfig(
      env({
        GPT2_DATABASE_URL: "postgres://gpt2:pw@db:5432/gpt2",
        GPT2_LEASE_S: "5",
        GPT2_SHARED_DIR: "/mnt/shared",
        PORT: "9000",
      }),
      () => "gpu2",
    ),
    {
      databaseUrl: "postgres://gpt2:pw@db:5432/gpt2",
      leaseSeconds: 5,
      sharedDir: "/mnt/shared",
      hostId: "gpu2:9000",
    },
  );
  assert.equal(readClusterConfig(env({ GPT2_HOST_ID: "rack3-a" }), () => "x").hostId, "rack3-a");
});

Deno.test("readClusterConfig() refuses a bad URL (password hidden), lease or host id", () => {
  assert.throws(() => readClusterConfig(env({ GPT2_DATABASE_URL: "mysql://u:secret@db/x" }), () => "h"), {
    message:
      'Invalid GPT2_DATABASE_URL "mysql://u:***@db/x": expected postgres://user:password@host:5432/database (unset: the embedded SQLite store)',
  });
  assert.throws(() => readClusterConfig(env({ GPT2_LEASE_S: "0.5" }), () => "h"), {
    message: 'Invalid GPT2_LEASE_S "0.5": expected seconds, at least 1',
  });
  assert.throws(() => readClusterConfig(env({ GPT2_HOST_ID: "a b" }), () => "h"), {
    message: 'Invalid GPT2_HOST_ID "a b": expected 1 to 128 printable ASCII characters, no spaces',
  });
});
