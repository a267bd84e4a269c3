/**
 * readServerConfig(): defaults, environment overrides, the refusal to bind beyond loopback
 * without an API token, tokens of any printable characters (inline or from a file), CORS
 * origins, limits and users' default quotas.
 */

import assert from "node:assert/strict";
import { defaultLimits, defaultQuotas, readServerConfig } from "../../server/settings.ts";

const env = (vars: Record<string, string>) => ({ get: (k: string) => vars[k] });
const noFile = (path: string): string => {
  throw new Error(`No such file "${path}"`);
};

Deno.test("readServerConfig() defaults to 127.0.0.1:8080, ./.gpt2 and its sources folder, without a token", () => {
  assert.deepEqual(readServerConfig(env({}), noFile), {
    host: "127.0.0.1",
    port: 8080,
    home: "./.gpt2",
    sources: ".gpt2/sources",
    token: null,
    gpus: 1,
    corsOrigins: [],
    allowedHosts: [],
    allowPrivateUrls: false,
    trustedProxies: [],
    limits: defaultLimits(),
    quotas: defaultQuotas(),
    shutdownSeconds: 30,
    stallSeconds: 600,
    roles: [new Set(["train", "generate"])],
    hostDeno: null,
  });
});

Deno.test("readServerConfig() reads GPT2_GPU_ROLES and GPT2_GPU_HOST_DENO, naming a bad role", () => {
  const c = readServerConfig(
    env({ GPT2_GPUS: "2", GPT2_GPU_ROLES: "train,generate", GPT2_GPU_HOST_DENO: "/opt/deno" }),
    noFile,
  );
  assert.deepEqual(c.roles, [new Set(["train"]), new Set(["generate"])]);
  assert.equal(c.hostDeno, "/opt/deno");
  assert.throws(
    () => readServerConfig(env({ GPT2_GPU_ROLES: "sing" }), noFile),
    /GPT2_GPU_ROLES entry "sing"/,
  );
});

Deno.test("readServerConfig() reads GPT2_SHUTDOWN_S and refuses a value that is not positive", () => {
  assert.equal(readServerConfig(env({ GPT2_SHUTDOWN_S: "5" }), noFile).shutdownSeconds, 5);
  assert.throws(() => readServerConfig(env({ GPT2_SHUTDOWN_S: "0" }), noFile), {
    message: 'Invalid GPT2_SHUTDOWN_S "0"',
  });
});

Deno.test("readServerConfig() reads GPT2_STALL_S (0 turns the watchdog off) and refuses a bad value", () => {
  assert.equal(readServerConfig(env({ GPT2_STALL_S: "90" }), noFile).stallSeconds, 90);
  assert.equal(readServerConfig(env({ GPT2_STALL_S: "0" }), noFile).stallSeconds, 0);
  for (const bad of ["-1", "soon", "Infinity"]) {
    assert.throws(() => readServerConfig(env({ GPT2_STALL_S: bad }), noFile), /Invalid GPT2_STALL_S/);
  }
});

Deno.test("readServerConfig() reads PORT, HOST, GPT2_HOME, GPT2_SOURCES, GPT2_API_TOKEN, GPT2_GPUS and limits", () => {
  const c = readServerConfig(
    env({
      PORT: "0",
      HOST: "0.0.0.0",
      GPT2_HOME: "/data",
      GPT2_SOURCES: "/corpora",
      GPT2_API_TOKEN: "t",
      GPT2_GPUS: "2",
      GPT2_CORS_ORIGINS: "https://a.example, http://localhost:3000",
      GPT2_ALLOWED_HOSTS: "GPU-Box.lan",
      GPT2_ALLOW_PRIVATE_URLS: "1",
      GPT2_MAX_QUEUED_JOBS: "7",
      GPT2_MAX_STREAMS: "3",
    }),
    noFile,
  );
  assert.deepEqual(
    [c.host, c.port, c.home, c.sources, c.token, c.gpus, c.corsOrigins, c.allowedHosts, c.allowPrivateUrls],
    ["0.0.0.0", 0, "/data", "/corpora", "t", 2, ["https://a.example", "http://localhost:3000"], [
      "gpu-box.lan",
    ], true],
  );
  assert.equal(c.limits.maxQueuedJobs, 7);
  assert.equal(c.limits.maxStreams, 3);
  assert.equal(c.limits.maxPreparations, defaultLimits().maxPreparations);
});

Deno.test("readServerConfig() accepts tokens of any printable characters, inline or from GPT2_API_TOKEN_FILE", () => {
  const token = "p@ss!w0rd #$%&'()*,;<=>?[]^`{|}~\"\\";
  assert.equal(readServerConfig(env({ GPT2_API_TOKEN: token }), noFile).token, token);
  const files: Record<string, string> = { "/run/secrets/token": `${token}\n` };
  const read = (p: string) => files[p] ?? noFile(p);
  assert.equal(readServerConfig(env({ GPT2_API_TOKEN_FILE: "/run/secrets/token" }), read).token, token);
  assert.throws(() => readServerConfig(env({ GPT2_API_TOKEN_FILE: "/nope" }), read), {
    message: 'Cannot read GPT2_API_TOKEN_FILE "/nope": No such file "/nope"',
  });
  assert.throws(
    () => readServerConfig(env({ GPT2_API_TOKEN: "tab\there" }), noFile),
    /^Error: Invalid API token/,
  );
  assert.throws(
    () => readServerConfig(env({ GPT2_API_TOKEN: "caf\u00e9" }), noFile),
    /^Error: Invalid API token/,
  );
  assert.throws(
    () => readServerConfig(env({ GPT2_API_TOKEN: "a", GPT2_API_TOKEN_FILE: "/run/secrets/token" }), read),
    { message: "Set GPT2_API_TOKEN or GPT2_API_TOKEN_FILE, not both" },
  );
});

Deno.test("readServerConfig() refuses a non-loopback host without a token, bad numbers and bad origins", () => {
  assert.throws(() => readServerConfig(env({ HOST: "0.0.0.0" }), noFile), {
    message: 'Refusing to bind "0.0.0.0" without GPT2_API_TOKEN: set a token or bind 127.0.0.1',
  });
  assert.throws(() => readServerConfig(env({ PORT: "http" }), noFile), { message: 'Invalid PORT "http"' });
  assert.throws(() => readServerConfig(env({ GPT2_GPUS: "0" }), noFile), {
    message: 'Invalid GPT2_GPUS "0"',
  });
  assert.throws(() => readServerConfig(env({ GPT2_MAX_STREAMS: "-1" }), noFile), {
    message: 'Invalid GPT2_MAX_STREAMS "-1": expected a positive integer',
  });
  assert.throws(() => readServerConfig(env({ GPT2_CORS_ORIGINS: "https://a.example/path" }), noFile), {
    message:
      'Invalid GPT2_CORS_ORIGINS entry "https://a.example/path": expected an origin such as "https://example.com"',
  });
});

Deno.test("readServerConfig() reads the users' default quotas from GPT2_QUOTA_*, naming a bad one", () => {
  const c = readServerConfig(
    env({ GPT2_QUOTA_QUEUED_JOBS: "5", GPT2_QUOTA_RUNNING_GPUS: "1", GPT2_QUOTA_STREAMS: "4" }),
    noFile,
  );
  assert.deepEqual(c.quotas, { ...defaultQuotas(), queued_jobs: 5, running_gpus: 1, streams: 4 });
  assert.throws(
    () => readServerConfig(env({ GPT2_QUOTA_GPU_SECONDS_PER_DAY: "lots" }), noFile),
    /^Error: Invalid GPT2_QUOTA_GPU_SECONDS_PER_DAY "lots": expected a positive integer$/,
  );
});
