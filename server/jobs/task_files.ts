/**
 * What an evaluation reads on the server, checked when it is submitted (`POST /evaluate`, and
 * `eval_tasks` of `POST /train`) rather than when it runs: a multiple-choice task file exists and
 * every example in it is good, a perplexity dataset exists. Mistakes are InvalidJobErrors naming
 * the field (a 400).
 */

import { readTaskFile } from "../../data/mod.ts";
import { InvalidJobError } from "../../job/errors.ts";
import { checkedChoiceJsonl } from "../../model/multiple_choice.ts";

/** The data fields of an evaluation that name something on the server. */
interface EvalData {
  examples_file?: string;
  dataset?: string;
}

/**
 * Checks `c`'s task file and dataset under `root`; `prefix` is the fields' path ("" for `POST
 * /evaluate`, "eval_tasks.N." for a training job's task).
 */
export async function checkEvalData(
  root: string,
  c: EvalData,
  prefix: string,
  datasetExists: (id: string) => Promise<boolean>,
): Promise<void> {
  if (c.examples_file !== undefined) {
    try {
      checkedChoiceJsonl(await readTaskFile(root, c.examples_file), `${c.examples_file}.jsonl`);
    } catch (e) {
      throw new InvalidJobError(`${prefix}examples_file`, (e as Error).message);
    }
  }
  if (c.dataset !== undefined && !(await datasetExists(c.dataset))) {
    throw new InvalidJobError(`${prefix}dataset`, `Unknown dataset "${c.dataset}"`);
  }
}
