/**
 * One server per data directory: two servers sharing a job store would both "recover" the same
 * interrupted job and train it twice. An exclusive advisory lock (flock) on `<home>/server.lock`
 * is held for the life of the process; the kernel drops it when the process dies, even by SIGKILL,
 * so a crash never leaves a stale lock behind.
 */

/** Takes the data directory's lock or throws naming it; keep the returned file open while serving. */
export async function lockDataDir(home: string, waitMs = 500): Promise<Deno.FsFile> {
  const path = `${home}/server.lock`;
  const file = await Deno.open(path, { read: true, write: true, create: true });
  const got = await Promise.race([
    file.lock(true).then(() => true),
    new Promise<boolean>((r) => setTimeout(() => r(false), waitMs)),
  ]);
  if (!got) {
    throw new Error(`Cannot use data directory "${home}": another server holds "${path}"`);
  }
  await file.truncate();
  await file.write(new TextEncoder().encode(`${Deno.pid}\n`));
  return file;
}
