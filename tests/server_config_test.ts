/**
 * readServerConfig(): defaults, environment overrides, and the refusal to bind beyond loopback
 * without an API token.
 */

import assert from "node:assert/strict";
import { readServerConfig } from "../main.ts";

const env = (vars: Record<string, string>) => ({ get: (k: string) => vars[k] });

Deno.test("readServerConfig() defaults to 127.0.0.1:8080 and ./.gpt2 without a token", () => {
  assert.deepEqual(readServerConfig(env({})), {
    host: "127.0.0.1",
    port: 8080,
    home: "./.gpt2",
    token: null,
    gpus: 1,
  });
});

Deno.test("readServerConfig() reads PORT, HOST, GPT2_HOME, GPT2_API_TOKEN and GPT2_GPUS", () => {
  assert.deepEqual(
    readServerConfig(
      env({ PORT: "0", HOST: "0.0.0.0", GPT2_HOME: "/data", GPT2_API_TOKEN: "t", GPT2_GPUS: "2" }),
    ),
    { host: "0.0.0.0", port: 0, home: "/data", token: "t", gpus: 2 },
  );
});

Deno.test("readServerConfig() refuses a non-loopback host without GPT2_API_TOKEN and bad numbers", () => {
  assert.throws(() => readServerConfig(env({ HOST: "0.0.0.0" })), {
    message: 'Refusing to bind "0.0.0.0" without GPT2_API_TOKEN: set a token or bind 127.0.0.1',
  });
  assert.throws(() => readServerConfig(env({ PORT: "http" })), { message: 'Invalid PORT "http"' });
  assert.throws(() => readServerConfig(env({ GPT2_GPUS: "0" })), { message: 'Invalid GPT2_GPUS "0"' });
});
