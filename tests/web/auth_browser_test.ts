/// <reference lib="dom" />
/**
 * The dashboard's sign-in in headless Chromium, over the multi-user server of tests/_auth.ts
 * served on a loopback port (no GPU needed): a user's token shows their name, scopes and quotas
 * and hides the pages its scopes do not allow; an admin token shows the Admin page, which makes a
 * token (shown once), lists it and revokes it. Skipped without Chromium.
 */

import assert from "node:assert/strict";
// Test-only, pinned in tests/deno.lock (see tests/web/browser_test.ts).
// deno-lint-ignore no-import-prefix
import puppeteer from "npm:puppeteer-core@25.16.0";
import { authServer, BOOT } from "../_auth.ts";

const chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"].find((p) => {
  try {
    return Deno.statSync(p).isFile;
  } catch {
    return false;
  }
});

Deno.test({
  name:
    "dashboard sign-in: the user and quotas shown, pages the token may not use hidden, the Admin page makes and revokes a token",
  ignore: !chromium,
  sanitizeOps: false,
  sanitizeResources: false,
  fn: async () => {
    const t = await authServer();
    const server = Deno.serve({ hostname: "127.0.0.1", port: 0, onListen: () => {} }, t.app.fetch);
    const url = `http://127.0.0.1:${(server.addr as Deno.NetAddr).port}`;
    // The app, built for 127.0.0.1 with no port of its own, takes this Host on any port.
    const browser = await puppeteer.launch({
      executablePath: chromium!,
      headless: true,
      args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
    });
    const pageErrors: string[] = [];
    try {
      const reader = (await t.mint("rita", ["read", "generate"])).token;
      const page = await browser.newPage();
      page.on("pageerror", (e) => pageErrors.push(String(e)));
      const signIn = async (token: string) => {
        // A hash-only navigation keeps the page, and #whoami the previous user's line until the new
        // sign-in's answer replaces it: wait for a line that differs from it.
        const before = await page.$eval("#whoami", (el) => el.textContent).catch(() => "");
        await page.goto(`${url}/#/jobs`);
        await page.waitForSelector("#token-bar.alert:not([hidden])", { timeout: 15_000 });
        await page.type("#token-input", token);
        await page.click('#token-bar button[type="submit"]');
        await page.waitForFunction(
          (prev) => {
            const now = document.getElementById("whoami")!.textContent;
            return now !== "" && now !== prev;
          },
          { timeout: 15_000 },
          before,
        );
      };
      await page.goto(`${url}/`);
      await page.evaluate(() => sessionStorage.clear());
      await signIn(reader);
      const who = await page.$eval("#whoami", (el) => el.textContent);
      assert.equal(
        who,
        "rita · read, generate · 0/20 queued, 0/2 GPUs running, 0/16 streams, 0/86400 GPU-s today",
      );
      const hidden = await page.$$eval(
        "[data-nav]",
        (els) => els.filter((e) => (e as HTMLElement).hidden).map((e) => (e as HTMLElement).dataset.nav),
      );
      assert.deepEqual(hidden, ["train", "admin"]);

      await page.evaluate(() => sessionStorage.clear());
      await signIn(BOOT);
      assert.equal(await page.$eval("#whoami", (el) => el.textContent), "admin (bootstrap token)");
      assert.equal(await page.$eval('[data-nav="admin"]', (el) => (el as HTMLElement).hidden), false);
      await page.goto(`${url}/#/admin`);
      await page.waitForSelector(`#admin-tokens tr[data-token]`, { timeout: 15_000 });
      await page.type("#new-token-user", "dora");
      await page.click("#make-token");
      await page.waitForFunction(() => document.querySelector("#token-made code") !== null, {
        timeout: 15_000,
      });
      const shown = await page.$eval("#token-made code", (el) => el.textContent!);
      assert.match(shown, /^gpt2_[0-9a-f]{12}_[0-9a-f]{64}$/);
      const id = `tok_${shown.slice(5, 17)}`;
      await page.waitForSelector(`tr[data-token="${id}"] button.danger`);
      assert.ok(
        !(await page.$eval("#admin-tokens", (el) => el.textContent!)).includes(shown),
        "listed without it",
      );
      await page.click(`tr[data-token="${id}"] button.danger`);
      await page.waitForFunction(
        (tid: string) => document.querySelector(`tr[data-token="${tid}"] .badge`)?.textContent === "revoked",
        { timeout: 15_000 },
        id,
      );
      assert.equal(t.store.tokens().find((k) => k.id === id)!.revoked_at !== null, true);
      assert.deepEqual(pageErrors, []);
    } finally {
      await browser.close();
      await server.shutdown();
      await t.cleanup();
    }
  },
});
