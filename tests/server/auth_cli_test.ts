/**
 * `deno task tokens` (scripts/tokens.ts): create prints the token once, alone on stdout, and the
 * store keeps its hash; list shows every token's state without it; revoke revokes once; bad
 * arguments exit non-zero with the usage. Once through the real command line on a data folder.
 */

import assert from "node:assert/strict";
import { tokensCli } from "../../scripts/tokens.ts";
import { hashToken, TOKEN_FORM } from "../../server/auth/mod.ts";
import { JobStore } from "../../server/jobs/mod.ts";

function run(store: JobStore, ...args: string[]) {
  const out: string[] = [], err: string[] = [];
  const code = tokensCli(args, store, { out: (l) => out.push(l), err: (l) => err.push(l) });
  return { code, out, err };
}

Deno.test("tokensCli() creates (printing the token once), lists and revokes tokens; bad arguments exit non-zero", () => {
  const store = new JobStore(":memory:");
  try {
    const made = run(
      store,
      "create",
      "--user",
      "alice",
      "--scopes",
      "read,train,generate",
      "--expires",
      "30d",
    );
    assert.equal(made.code, 0, made.err.join("\n"));
    assert.equal(made.out.length, 1);
    const token = made.out[0];
    assert.match(token, TOKEN_FORM);
    assert.match(
      made.err[0],
      /^Token tok_[0-9a-f]{12} for user "alice" \(scopes read,train,generate, expires \d{4}-/,
    );
    const [record] = store.tokens();
    assert.equal(record.hash, hashToken(token));
    assert.deepEqual(store.audit().map((e) => e.action), ["token.create"]);

    const listed = run(store, "list");
    assert.equal(listed.code, 0);
    assert.equal(listed.out.length, 2);
    assert.match(listed.out[1], new RegExp(`^${record.id}\\talice\\t-\\tread,train,generate\\t.*\\tactive$`));
    assert.ok(!listed.out.join("\n").includes(token));

    const revoked = run(store, "revoke", record.id);
    assert.equal(revoked.code, 0);
    assert.match(revoked.err[0], /^Revoked tok_/);
    assert.match(run(store, "list").out[1], /\trevoked$/);
    assert.match(run(store, "revoke", record.id).err[0], /was revoked already$/);

    for (
      const [args, code, message] of [
        [
          ["create", "--user", "alice", "--scopes", "read,root"],
          1,
          /^Unknown scope "root": expected some of read, train, generate, admin$/,
        ],
        [["create", "--user", "bad name", "--scopes", "read"], 1, /^Invalid --user "bad name"/],
        [["create", "--user", "bob"], 1, /^No scopes given/],
        [["create", "--user", "bob", "--scopes", "read", "--expires", "soon"], 1, /^Invalid expiry "soon"/],
        [["revoke", "tok_000000000000"], 1, /^Token "tok_000000000000" not found/],
        [["rotate"], 2, /^Usage:/],
        [["list", "--color"], 2, /Unknown option/],
      ] as Array<[string[], number, RegExp]>
    ) {
      const r = run(store, ...args);
      assert.equal(r.code, code, args.join(" "));
      assert.match(r.err[0], message);
    }
    assert.equal(store.tokens().length, 1);
  } finally {
    store.close();
  }
});

Deno.test("deno task tokens create prints the token on stdout alone, into $GPT2_HOME's job store (made if new)", async () => {
  const root = await Deno.makeTempDir({ prefix: "gpt2_tokens_cli_" });
  const home = `${root}/not-made-yet`;
  try {
    const out = await new Deno.Command(Deno.execPath(), {
      args: [
        "run",
        "-A",
        "scripts/tokens.ts",
        "create",
        "--user",
        "ops",
        "--scopes",
        "admin",
        "--name",
        "ci",
      ],
      cwd: new URL("../..", import.meta.url).pathname,
      env: { GPT2_HOME: home },
      stdout: "piped",
      stderr: "piped",
    }).output();
    const stdout = new TextDecoder().decode(out.stdout);
    assert.equal(out.code, 0, new TextDecoder().decode(out.stderr));
    const token = stdout.trim();
    assert.match(token, TOKEN_FORM);
    assert.equal(stdout, `${token}\n`);
    const store = new JobStore(`${home}/jobs.sqlite`);
    try {
      const [t] = store.tokens();
      assert.deepEqual([t.user, t.name, t.scopes, t.hash], ["ops", "ci", ["admin"], hashToken(token)]);
    } finally {
      store.close();
    }
  } finally {
    await Deno.remove(root, { recursive: true });
  }
});
