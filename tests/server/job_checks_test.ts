/**
 * What POST /train refuses at submission rather than failing after queueing (server/jobs/job_checks.ts):
 * splits that cannot be honoured, and a resume_from that does not fit the job.
 */

import { deepStrictEqual as assertEquals, fail } from "node:assert/strict";
import { checkTrainConfig } from "../../server/jobs/job_checks.ts";
import { completeConfig } from "../../job/job_config.ts";
import { TrainRequestSchema } from "../../server/routes/schemas.ts";
import { InvalidJobError } from "../../job/errors.ts";
import { fakeCheckpoint } from "../_auth.ts";
import { prepareDataset } from "../../data/mod.ts";

async function withRoot(fn: (root: string) => Promise<void>) {
  const root = await Deno.makeTempDir({ prefix: "gpt2_checks_" });
  try {
    await fn(root);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
}

/** The field and message of the InvalidJobError `p` rejects with. */
async function refusal(p: Promise<unknown>): Promise<[string, string]> {
  try {
    await p;
  } catch (e) {
    if (e instanceof InvalidJobError) return [e.field, e.message];
    throw e;
  }
  return fail("accepted");
}

/** A request as POST /train completes it. */
const config = (req: Record<string, unknown>) => completeConfig(TrainRequestSchema.parse(req));

const ctx = (root: string) => ({
  root,
  datasetExists: (id: string) => Promise.resolve(id === "sotu" || id === "mydocs"),
});

Deno.test("split: weights that sum to 0 are refused; a prepared dataset keeps the split it was prepared with", async () => {
  await withRoot(async (root) => {
    const check = (req: Record<string, unknown>) =>
      checkTrainConfig(ctx(root), config({ model: "gpt2-tiny", dataset: "sotu", ...req }), 1);
    const [f, m] = await refusal(check({ split: "0,0,0" }));
    assertEquals([f, m], ["split", 'Invalid split "0,0,0": weights sum to 0']);
    // A dataset prepared without a training split (for evaluation) cannot be trained on.
    const noTrain = { ...ctx(root), splitTokens: () => Promise.resolve({ train: 0, valid: 500, test: 500 }) };
    assertEquals(
      await refusal(checkTrainConfig(noTrain, config({ model: "gpt2-tiny", dataset: "mydocs" }), 1)),
      [
        "seq_len",
        'The train split of dataset "mydocs" has 0 tokens, fewer than one sequence of seq_len + 1 = 65',
      ],
    );
    await check({ split: "90,10,0" }); // a built-in is cut at the job's split
    await check({ dataset: "mydocs" }); // the default: the dataset's own split
    const texts = Array.from(
      { length: 40 },
      (_, i) => `Document ${i}: ${"the people of the nation ".repeat(20)}`,
    );
    await prepareDataset(root, { texts }, {
      id: "mydocs",
      min_tokens: 0,
      dedup: false,
      split: "8,1,1",
      seq_len: 16,
    });
    await check({ dataset: "mydocs", split: "8,1,1" }); // its own split, as it was prepared
    await check({ dataset: "mydocs", split: "80,10,10" }); // the same proportions
    assertEquals(await refusal(check({ dataset: "mydocs", split: "100,0,0" })), [
      "split",
      'Dataset "mydocs" keeps the split it was prepared with (8,1,1); split applies to the built-in datasets ' +
      "only: prepare it again (POST /datasets) with the split you want",
    ]);
  });
});

Deno.test("resume_from: another architecture, nothing left to train and a mistyped checkpoint are refused naming the field", async () => {
  await withRoot(async (root) => {
    await fakeCheckpoint(root, "job_aaaaaaaaaaaa"); // gpt2-tiny's dimensions, iteration 5
    const check = (req: Record<string, unknown>) =>
      checkTrainConfig(
        ctx(root),
        config({ model: "gpt2-tiny", dataset: "sotu", resume_from: "job_aaaaaaaaaaaa", ...req }),
        1,
      );
    await check({ train_iters: 6 });
    const [f, m] = await refusal(check({ model: "gpt2-small-test", train_iters: 6 }));
    assertEquals(f, "model");
    assertEquals(m.startsWith('resume_from "job_aaaaaaaaaaaa" is a model with n_layer 2'), true, m);
    assertEquals(
      await refusal(check({ train_iters: 5 })),
      [
        "train_iters",
        'train_iters 5 is not past resume_from "job_aaaaaaaaaaaa", saved at iteration 5: nothing would be trained',
      ],
    );
    assertEquals(
      await refusal(check({ resume_from: "job_aaaaaaaaaaaa/iter_5", train_iters: 6 })),
      [
        "resume_from",
        'Unknown checkpoint "job_aaaaaaaaaaaa/iter_5": job "job_aaaaaaaaaaaa" has iter_0000005',
      ],
    );
  });
});
