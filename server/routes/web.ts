/**
 * The dashboard's static files: `GET /` is web/index.html, `GET /web/<file>` a file of web/, and
 * `GET /web/vendor/<file>` uPlot's script and stylesheet from node_modules (installed from npm with
 * the other dependencies, so nothing is fetched from the internet at run time). `GET /web/meta.json`
 * describes the API for the forms: model presets, built-in datasets and the JSON Schema of
 * `POST /train`, generated from the zod schema so the form never drifts from the validation.
 * Mounted ahead of the bearer-token check: these files hold no data, and the page is where a
 * user types the token. Missing files are HTTPExceptions, so the app's one error handler shapes them.
 */

import { Hono } from "hono";
import { HTTPException } from "hono/http-exception";
import { z } from "zod";
import { PRESET_NAMES } from "../../model/config.ts";
import { BUILTIN_NAMES } from "../../data/mod.ts";
import { TrainRequestSchema } from "./schemas.ts";

const WEB_DIR = new URL("../../web/", import.meta.url);
const VENDOR = new Map([
  ["uPlot.iife.min.js", new URL("../../node_modules/uplot/dist/uPlot.iife.min.js", import.meta.url)],
  ["uPlot.min.css", new URL("../../node_modules/uplot/dist/uPlot.min.css", import.meta.url)],
]);
const TYPES: Record<string, string> = {
  html: "text/html; charset=utf-8",
  js: "text/javascript; charset=utf-8",
  css: "text/css; charset=utf-8",
  svg: "image/svg+xml",
  json: "application/json",
};
const FILE_RE = /^[a-z0-9_]+\.(html|js|css|svg)$/;
// Same origin only: scripts, styles, API calls. uPlot sets inline styles from script.
const CSP = "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; " +
  "connect-src 'self'; frame-ancestors 'none'";

/** The dashboard routes. Files are read once and kept in memory. */
export function webRoutes(): Hono {
  const app = new Hono();
  const cache = new Map<string, Uint8Array>();
  const serve = async (url: URL, name: string): Promise<Response> => {
    let body = cache.get(url.href);
    if (!body) {
      try {
        body = await Deno.readFile(url);
      } catch (e) {
        if (!(e instanceof Deno.errors.NotFound)) throw e;
        const message = url.pathname.includes("/node_modules/")
          ? `Dashboard file "${name}" is missing from node_modules: run \`deno install\``
          : `No dashboard file "${name}"`;
        throw new HTTPException(404, { message });
      }
      cache.set(url.href, body);
    }
    return new Response(body as Uint8Array<ArrayBuffer>, {
      headers: {
        "Content-Type": TYPES[name.slice(name.lastIndexOf(".") + 1)],
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
      },
    });
  };

  app.get("/", () => serve(new URL("index.html", WEB_DIR), "index.html"));
  app.get("/web/meta.json", (c) =>
    c.json({
      presets: PRESET_NAMES,
      builtin_datasets: BUILTIN_NAMES,
      train_schema: z.toJSONSchema(TrainRequestSchema, { io: "input" }),
    }));
  app.get("/web/vendor/:file", (c) => {
    const file = c.req.param("file");
    const url = VENDOR.get(file);
    if (!url) throw new HTTPException(404, { message: `No dashboard file "vendor/${file}"` });
    return serve(url, file);
  });
  app.get("/web/:file", (c) => {
    const file = c.req.param("file");
    if (!FILE_RE.test(file)) throw new HTTPException(404, { message: `No dashboard file "${file}"` });
    return serve(new URL(file, WEB_DIR), file);
  });
  return app;
}
