/**
 * Evaluation task files by name (`examples_file` of a multiple-choice evaluation): a JSONL file
 * `$GPT2_HOME/tasks/<name>.jsonl` copied there by the user (converted HellaSwag, PIQA, ARC…), else
 * one shipped with the code in data/tasks/ (`example_choice`). Names are ids, never paths, so a
 * request cannot read outside those folders. The lines are parsed by model/multiple_choice.ts.
 */

import { join } from "node:path";
import { PathOutsideRootError, resolveUnderRoot } from "./store.ts";

/** Valid task file names: as dataset ids (letters, digits, `-`, `_`, `.` not leading), no extension. */
export const TASK_FILE_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

/** A task file that neither the data directory nor the code has. */
export class TaskFileNotFoundError extends Error {
  constructor(name: string) {
    super(
      `Unknown task file "${name}": expected $GPT2_HOME/tasks/${name}.jsonl or a shipped one (example_choice)`,
    );
    this.name = "TaskFileNotFoundError";
  }
}

/** The folder of the data directory's task files. */
export function tasksDir(root: string): string {
  return join(root, "tasks");
}

/** The text of task file `name` (see the file's header). Throws TaskFileNotFoundError, or a RangeError for a bad name. */
export async function readTaskFile(root: string, name: string): Promise<string> {
  if (!TASK_FILE_RE.test(name) || name.includes("..")) {
    throw new RangeError(`Invalid task file name "${name}": use 1-64 letters, digits, ".", "-" or "_"`);
  }
  try {
    return await Deno.readTextFile(await resolveUnderRoot(root, join("tasks", `${name}.jsonl`)));
  } catch (e) {
    if (e instanceof PathOutsideRootError) throw e;
  }
  try {
    return await Deno.readTextFile(new URL(`./tasks/${name}.jsonl`, import.meta.url));
  } catch {
    throw new TaskFileNotFoundError(name);
  }
}
