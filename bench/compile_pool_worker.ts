/// <reference lib="deno.worker" />
/** A Worker of bench/compile_pool_probe.ts: compiles the WGSL it is sent on a device of its own. */
import { compileAll } from "./compile_pool_probe.ts";

self.onmessage = async (e: MessageEvent<string[]>) => {
  self.postMessage(await compileAll(e.data));
};
