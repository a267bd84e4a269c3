/// <reference lib="dom" />
/**
 * The dashboard in a real browser: Debian's Chromium, headless, driven by puppeteer-core, against
 * the real server (main.ts as a subprocess with a bearer token) training on the CPU adapter. It
 * types the token, gets the API's validation message beside a bad field of the training form,
 * starts a gpt2-tiny job, watches the loss curve gain points while it trains, reloads and finds
 * the curve again, sees the job finish with checkpoints to download, streams a generation in the
 * playground, trains a second job with an evaluation during training (its curve drawn), compares
 * the two (loss and accuracy overlaid by iteration and by tokens, their config differences), and
 * saves screenshots (wide and narrow) under its temporary folder
 * (`DASHBOARD_SCREENSHOTS=<dir>` keeps them there instead). Skipped without a Chromium binary
 * (scripts/test.sh installs one) or a WebGPU adapter.
 */

import assert from "node:assert/strict";
// Test-only, so not in deno.json: `deno task` installs every package of deno.lock before any
// task, the demo's included (tests/e2e/install_test.ts). It is pinned in tests/deno.lock.
// deno-lint-ignore no-import-prefix
import puppeteer, { type Page } from "npm:puppeteer-core@25.16.0";
import { noGpu } from "../_helpers.ts";

const TOKEN = "browser-test-token";

function findChromium(): string | null {
  const candidates = [Deno.env.get("CHROMIUM_PATH"), "/usr/bin/chromium", "/usr/bin/chromium-browser"];
  for (const path of candidates) {
    if (!path) continue;
    try {
      if (Deno.statSync(path).isFile) return path;
    } catch { /* next */ }
  }
  return null;
}

const chromium = findChromium();

/** Starts main.ts on a free loopback port and resolves once it names its URL. */
async function startServer(home: string): Promise<{ url: string; child: Deno.ChildProcess }> {
  const child = new Deno.Command(Deno.execPath(), {
    args: ["run", "-A", "main.ts"],
    cwd: new URL("../..", import.meta.url).pathname,
    env: {
      PORT: "0",
      HOST: "127.0.0.1",
      GPT2_HOME: home,
      GPT2_API_TOKEN: TOKEN,
      DENO_WEBGPU_BACKEND: "vulkan",
    },
    stdout: "piped",
    stderr: "inherit",
  }).spawn();
  const reader = child.stdout.pipeThrough(new TextDecoderStream()).getReader();
  let seen = "";
  for (const end = Date.now() + 60_000; Date.now() < end;) {
    const { value, done } = await reader.read();
    if (done) break;
    seen += value;
    const m = seen.match(/listening on (http:\/\/127\.0\.0\.1:\d+)\//);
    if (m) {
      (async () => {
        while (!(await reader.read().catch(() => ({ done: true }))).done) { /* drain */ }
      })();
      return { url: m[1], child };
    }
  }
  child.kill("SIGKILL");
  throw new Error(`Server did not start: ${seen}`);
}

/** Points drawn in the loss chart. */
function lossPoints(page: Page): Promise<number> {
  return page.$eval('[data-chart="loss"]', (el) => Number((el as HTMLElement).dataset.points));
}

Deno.test({
  name:
    "dashboard in headless Chromium: token, form validation, live loss curve, reload, playground, screenshots",
  ignore: noGpu || chromium === null,
  sanitizeResources: false,
  sanitizeOps: false,
  fn: async () => {
    const home = await Deno.makeTempDir({ prefix: "gpt2_browser_" });
    const shots = Deno.env.get("DASHBOARD_SCREENSHOTS") ?? home;
    await Deno.mkdir(shots, { recursive: true });
    const [server, browser] = await Promise.all([
      startServer(home),
      puppeteer.launch({
        executablePath: chromium!,
        headless: true,
        args: ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
      }),
    ]);
    const pageErrors: string[] = [];
    const page = await browser.newPage();
    try {
      await page.setViewport({ width: 1280, height: 900 });
      page.on("pageerror", (e) => pageErrors.push(String(e)));
      page.on("console", (m) => {
        // A 401 before the token is typed is expected; Chromium logs it as a failed resource.
        if (m.type() === "error" && !m.text().startsWith("Failed to load resource")) {
          pageErrors.push(m.text());
        }
      });

      // The API refuses the page's first request; the token bar asks for the token.
      await page.goto(`${server.url}/#/train`);
      await page.waitForSelector("#token-bar.alert:not([hidden])", { timeout: 15_000 });
      await page.type("#token-input", TOKEN);
      await page.click('#token-bar button[type="submit"]');
      assert.equal(await page.evaluate(() => sessionStorage.getItem("gpt2.token")), TOKEN);

      // A bad field: the API's message appears beside it and nothing is started.
      await page.waitForSelector("#f-batch_size");
      const fill = async (name: string, value: string) => {
        await page.$eval(`#f-${name}`, (el) => ((el as HTMLInputElement).value = ""));
        await page.type(`#f-${name}`, value);
      };
      await fill("model", "gpt2-tiny");
      await fill("train_iters", "12");
      await fill("batch_size", "-4");
      await fill("seq_len", "16");
      await fill("lr", "0.003");
      await page.click("details summary");
      for (const [name, value] of [["log_interval", "2"], ["eval_interval", "6"], ["eval_iters", "1"]]) {
        await fill(name, value);
      }
      await fill("save_interval", "0");
      await page.click("#train-submit");
      await page.waitForFunction(
        () => (document.querySelector('[data-error-for="batch_size"]')?.textContent ?? "") !== "",
        { timeout: 10_000 },
      );
      const fieldError = await page.$eval('[data-error-for="batch_size"]', (el) => el.textContent!);
      assert.match(fieldError, /0/, fieldError); // zod: "Too small: expected number to be >0"
      assert.equal(await page.$eval("#f-batch_size", (el) => el.getAttribute("aria-invalid")), "true");
      assert.equal(await page.$eval('[data-error-for="seq_len"]', (el) => el.textContent), "");
      assert.equal(new URL(page.url()).hash, "#/train");
      await page.screenshot({ path: `${shots}/train_form_error.png` });

      // Fixed: the job starts and its page opens.
      await fill("batch_size", "2");
      await page.click("#train-submit");
      await page.waitForFunction(() => /^#\/jobs\/job_/.test(location.hash), { timeout: 10_000 });
      const jobId = new URL(page.url()).hash.slice("#/jobs/".length);

      // The loss curve gains points while the job trains.
      await page.waitForFunction(
        () => Number(document.querySelector<HTMLElement>('[data-chart="loss"]')?.dataset.points) >= 2,
        { timeout: 90_000 },
      );
      const early = await lossPoints(page);
      await page.waitForFunction(
        (n) => Number(document.querySelector<HTMLElement>('[data-chart="loss"]')?.dataset.points) > n,
        { timeout: 60_000 },
        early,
      );
      const status = await page.$eval("#job-status", (el) => el.textContent);
      assert.ok(status === "running" || status === "succeeded", String(status));

      // A reload draws the history again (replayed from the store), then follows live events.
      const before = await lossPoints(page);
      await page.reload();
      await page.waitForFunction(
        (n) => Number(document.querySelector<HTMLElement>('[data-chart="loss"]')?.dataset.points) >= n,
        { timeout: 30_000 },
        before,
      );

      // The job finishes: final status, memory figure, a checkpoint to download.
      await page.waitForFunction(() => document.querySelector("#job-status")?.textContent === "succeeded", {
        timeout: 120_000,
      });
      await page.waitForSelector('#job-checkpoints a[href$="/model.safetensors"]', { timeout: 10_000 });
      assert.equal(await lossPoints(page), 6); // 12 iterations, a point every 2
      const memory = await page.$eval("#stat-memory b", (el) => el.textContent!);
      assert.match(memory, /\d (KiB|MiB|GiB)$/, memory);
      await page.screenshot({ path: `${shots}/job.png`, fullPage: true });
      assert.ok((await Deno.stat(`${shots}/job.png`)).size > 10_000);
      await page.setViewport({ width: 390, height: 844, isMobile: true });
      await new Promise((r) => setTimeout(r, 300)); // let the charts take the new width
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - innerWidth);
      assert.ok(overflow <= 0, `the job page is ${overflow}px wider than a narrow screen`);
      await page.screenshot({ path: `${shots}/job_narrow.png`, fullPage: true });
      await page.setViewport({ width: 1280, height: 900 });

      // The playground streams a generation from the job's checkpoint.
      await page.goto(`${server.url}/#/playground?model=${jobId}`);
      await page.waitForSelector("#pg-model");
      assert.equal(await page.$eval("#pg-model", (el) => (el as HTMLSelectElement).value), jobId);
      await page.$eval("#pg-max_tokens", (el) => ((el as HTMLInputElement).value = "12"));
      await page.$eval("#pg-temperature", (el) => ((el as HTMLInputElement).value = "0"));
      // Count the distinct token counts the page showed: more than one means the text streamed in.
      await page.evaluate(() => {
        const seen = new Set<string>();
        (globalThis as unknown as { tokenCounts: Set<string> }).tokenCounts = seen;
        const el = document.querySelector<HTMLElement>("#pg-text")!;
        new MutationObserver(() => seen.add(el.dataset.tokens!)).observe(el, {
          childList: true,
          attributes: true,
        });
      });
      await page.click("#pg-go");
      await page.waitForSelector("#pg-finish", { timeout: 60_000 });
      const finish = await page.$eval("#pg-finish b", (el) => el.textContent);
      assert.ok(finish === "length" || finish === "eos", String(finish));
      const text = await page.$eval("#pg-text", (el) => el.textContent!);
      assert.ok(text.length > 0, "no text was generated");
      const counts = await page.evaluate(
        () => [...(globalThis as unknown as { tokenCounts: Set<string> }).tokenCounts],
      );
      assert.ok(counts.length >= 2, `tokens arrived all at once: ${JSON.stringify(counts)}`);
      const tokens = Number(await page.$eval("#pg-text", (el) => (el as HTMLElement).dataset.tokens));
      if (finish === "length") assert.equal(tokens, 12);
      assert.match(await page.$eval("#pg-ttft b", (el) => el.textContent!), /^[\d,]+ ms$/);
      await page.screenshot({ path: `${shots}/playground.png`, fullPage: true });

      // Jobs, datasets and GPUs pages show what the server knows.
      await page.goto(`${server.url}/#/jobs`);
      await page.waitForSelector(`tr[data-job="${jobId}"]`);
      assert.match(
        await page.$eval(`tr[data-job="${jobId}"]`, (el) => el.textContent!),
        /succeeded.*gpt2-tiny.*12 \/ 12/,
      );
      // A second job with an evaluation during training: its curve on its page, then both compared.
      const secondId = await page.evaluate(async (token) => {
        const examples = [
          { context: "The sky is", endings: ["blue.", "a fish."], label: 0 },
          { context: "Water is", endings: ["dry.", "wet.", "made of sand."], label: 1 },
          { context: "A cat says", endings: ["meow.", "moo."], label: 0 },
        ];
        const res = await fetch("/train", {
          method: "POST",
          headers: { "Content-Type": "application/json", Authorization: `Bearer ${token}` },
          body: JSON.stringify({
            model: "gpt2-tiny",
            train_iters: 8,
            batch_size: 2,
            seq_len: 16,
            lr: 0.001,
            log_interval: 2,
            eval_interval: 4,
            eval_iters: 1,
            save_interval: 0,
            eval_tasks: [{ name: "mc", task: "multiple_choice", examples }],
          }),
        });
        return (await res.json()).id as string;
      }, TOKEN);
      await page.goto(`${server.url}/#/jobs/${secondId}`);
      await page.waitForFunction(() => document.querySelector("#job-status")?.textContent === "succeeded", {
        timeout: 120_000,
      });
      await page.waitForFunction(
        () => /mc at iteration 8: accuracy/.test(document.querySelector("#job-log")?.textContent ?? ""),
        { timeout: 10_000 },
      );
      assert.match(await page.$eval("#job-log", (el) => el.textContent!), /mc at iteration 4: accuracy/);
      // The chart's rows are the job's logged iterations (2, 4, 6, 8); the task has points at 4 and 8.
      assert.equal(
        await page.$eval('[data-chart="eval_tasks"]', (el) => (el as HTMLElement).dataset.points),
        "4",
      );
      await page.goto(`${server.url}/#/jobs`);
      await page.waitForSelector(`.compare-pick[data-job="${secondId}"]`);
      assert.equal(await page.$eval("#compare-selected", (el) => el.getAttribute("aria-disabled")), "true");
      await page.click(`.compare-pick[data-job="${jobId}"]`);
      await page.click(`.compare-pick[data-job="${secondId}"]`);
      await page.click("#compare-selected");
      await page.waitForFunction(() => location.hash.startsWith("#/compare?ids="), { timeout: 10_000 });
      const comparePoints = (name: string) =>
        page.$eval(`[data-chart="${name}"]`, (el) => Number((el as HTMLElement).dataset.points));
      await page.waitForSelector('[data-chart="compare-train"]', { timeout: 10_000 });
      assert.equal(await comparePoints("compare-train"), 6); // iterations 2 … 12 of either job
      assert.equal(await comparePoints("compare-eval-mc"), 2);
      const diff = await page.$eval('#compare-config tr[data-field="train_iters"]', (el) => el.textContent!);
      assert.match(diff, /train_iters.*12.*8/);
      assert.equal(await page.$$eval("#compare-final tbody tr", (rows) => rows.length), 2);
      await page.select("#compare-x", "tokens");
      await page.waitForFunction(
        () => document.querySelector('[data-chart="compare-train"]')?.textContent?.includes("tokens seen"),
        { timeout: 10_000 },
      );
      assert.ok((await comparePoints("compare-train")) >= 6);
      await page.screenshot({ path: `${shots}/compare.png`, fullPage: true });
      await page.setViewport({ width: 390, height: 844, isMobile: true });
      await new Promise((r) => setTimeout(r, 300));
      const compareOverflow = await page.evaluate(() => document.documentElement.scrollWidth - innerWidth);
      assert.ok(compareOverflow <= 0, `the compare page is ${compareOverflow}px wider than a narrow screen`);
      await page.setViewport({ width: 1280, height: 900 });

      await page.goto(`${server.url}/#/datasets`);
      await page.waitForSelector('tr[data-dataset="sotu"]');
      // Prepare a dataset from the form: a bad field first, then a good one.
      await page.select("#ds-kind", "texts");
      const docs = Array.from(
        { length: 6 },
        (_, i) => `Document ${i} on the union, its roads and the budget of ${1900 + i}.`,
      );
      await page.type("#ds-source", docs.join("\n---\n"));
      for (
        const [name, value] of [["id", "tiny-texts"], ["min_tokens", "1"], ["split", "8,1,1"], [
          "seq_len",
          "4",
        ]]
      ) {
        await page.type(`#ds-${name}`, value);
      }
      await page.type("#ds-dedup_threshold", "5");
      await page.click('#dataset-form button[type="submit"]');
      await page.waitForFunction(
        () => document.querySelector('[data-error-for="dedup_threshold"]')?.textContent !== "",
        { timeout: 10_000 },
      );
      assert.match(await page.$eval('[data-error-for="dedup_threshold"]', (el) => el.textContent!), /1/);
      await page.$eval("#ds-dedup_threshold", (el) => ((el as HTMLInputElement).value = ""));
      await page.click('#dataset-form button[type="submit"]');
      await page.waitForSelector('tr[data-dataset="tiny-texts"]', { timeout: 30_000 });
      // The table lists the dataset while it is still being prepared: wait for the POST's answer, 201
      // when it was ready within the server's wait (2 s), else 202 and the table shows its progress.
      await page.waitForFunction(
        () => document.querySelector("#ds-result")?.textContent !== "Preparing…",
        { timeout: 30_000 },
      );
      assert.match(
        await page.$eval("#ds-result", (el) => el.textContent!),
        /^Ready: tiny-texts, \d documents|^Preparing tiny-texts \(see the table\)$/,
      );
      await page.waitForFunction(
        () =>
          document.querySelector('tr[data-dataset="tiny-texts"] td:nth-child(2)')?.textContent === "ready",
        { timeout: 30_000 },
      );
      const cells = await page.$$eval(
        'tr[data-dataset="tiny-texts"] td',
        (tds) => tds.map((td) => td.textContent),
      );
      assert.deepEqual(cells.slice(0, 2), ["tiny-texts", "ready"]);
      assert.equal(Number(cells[2]) + Number(cells[8]), 6); // kept + near-duplicates removed
      await page.screenshot({ path: `${shots}/datasets.png`, fullPage: true });
      await page.goto(`${server.url}/#/gpus`);
      await page.waitForSelector('[data-gpu="0"]');
      assert.match(await page.$eval('[data-gpu="0"]', (el) => el.textContent!), /idle/);
      await page.screenshot({ path: `${shots}/gpus.png`, fullPage: true });
      assert.deepEqual(pageErrors, []);
    } catch (e) {
      await page.screenshot({ path: `${shots}/failure.png`, fullPage: true }).catch(() => {});
      throw e;
    } finally {
      await browser.close();
      server.child.kill("SIGKILL");
      await server.child.status;
      await Deno.remove(home, { recursive: true });
    }
  },
});
