/**
 * The GPU host's settings, read once from the environment the server starts it with: how Workers
 * are pinned to GPUs (GPT2_GPU_SELECT, see gpu_select.ts) and how long a graceful stop of its
 * Workers may take (GPT2_SHUTDOWN_S, which the server passes on). Nothing else in host/ reads the
 * environment; the pinning variables it sets for each Worker are not settings.
 */

import { parseSelectMode, type SelectMode } from "./gpu_select.ts";

/** Everything the GPU host reads from the environment. */
export interface HostSettings {
  select: SelectMode;
  /** Milliseconds its Workers get to stop at shutdown. */
  shutdownMs: number;
}

/** Reads the host's settings; throws naming a variable that is invalid. */
export function readHostSettings(env: { get(key: string): string | undefined }): HostSettings {
  const raw = env.get("GPT2_SHUTDOWN_S") ?? "30";
  const seconds = Number(raw);
  if (!(seconds > 0)) throw new Error(`Invalid GPT2_SHUTDOWN_S "${raw}"`);
  return { select: parseSelectMode(env.get("GPT2_GPU_SELECT")), shutdownMs: seconds * 1000 };
}
