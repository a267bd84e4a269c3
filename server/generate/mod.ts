/** Generation in the HTTP process: the manager placing generations on the GPU pool, and text streaming. Re-exports only. */

export * from "./text_stream.ts";
export * from "./generation_manager.ts";
