/**
 * Polling helper for tests that wait on asynchronous state (workers, streams, the runner).
 */

/** Resolves once `cond()` holds; throws naming `what` after `ms` milliseconds. */
export async function until(
  cond: () => boolean | Promise<boolean>,
  what = "condition",
  ms = 10_000,
  pollMs = 5,
): Promise<void> {
  for (const end = Date.now() + ms; !(await cond());) {
    if (Date.now() > end) throw new Error(`Timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, pollMs));
  }
}
