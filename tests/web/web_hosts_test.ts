/**
 * The dashboard's GPUs page lists the hosts sharing the job store (issue 29): one row per host
 * from `/health`'s `hosts`, with its state, GPUs, free Workers, heartbeat age and the jobs it
 * holds, each linking to the job; nothing for a lone host. Rendered into linkedom's DOM.
 */

import assert from "node:assert/strict";
import { parseHTML } from "linkedom";

/** What the test reads of a linkedom element. */
interface El {
  textContent: string | null;
  getAttribute(name: string): string | null;
  querySelectorAll(selector: string): Iterable<El>;
}

Deno.test("hostsTable() renders a row per host with its jobs linked, and nothing for one host", async () => {
  // deno-lint-ignore no-explicit-any
  const dom: any = parseHTML("<!doctype html><html><body></body></html>");
  Object.assign(globalThis, { document: dom.document, Node: dom.Node });
  try {
    const { hostsTable } = await import("../../web/view_gpus.js");
    const hosts = [
      { id: "host-a", state: "ready", gpus: 1, free: 0, lease_age_s: 0.4, jobs: ["job_1", "job_2"] },
      { id: "host-b", state: "draining", gpus: 2, free: 2, lease_age_s: 12.25, jobs: [] },
    ];
    const [title, wrap] = hostsTable(hosts) as El[];
    assert.equal(title.textContent, "Hosts");
    const rows = [...wrap.querySelectorAll("tbody tr")].map((r: El) =>
      [...r.querySelectorAll("td")].map((c: El) => c.textContent!.trim())
    );
    assert.deepEqual(rows, [
      ["host-a", "ready", "1", "0", "0.4 s ago", "job_1 job_2"],
      ["host-b", "draining", "2", "2", "12.3 s ago", "none"],
    ]);
    assert.deepEqual(
      [...wrap.querySelectorAll("a")].map((a: El) => a.getAttribute("href")),
      ["#/jobs/job_1", "#/jobs/job_2"],
    );
    assert.deepEqual(hostsTable([hosts[0]]), []);
  } finally {
    for (const k of ["document", "Node"]) delete (globalThis as Record<string, unknown>)[k];
  }
});
