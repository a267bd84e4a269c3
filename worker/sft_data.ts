/**
 * SFT's data (objective "sft"): the three splits of a chat dataset (data/chat_dataset.ts), each
 * packed into rows of seq_len + 1 tokens with loss masks (data/chat.ts packChats), and a line for
 * the job's log saying how many conversations were cut at a turn boundary or dropped.
 */
import { isChatDataset, loadChatSplit, packChats, type PackedRows } from "../data/mod.ts";
import { getDataset } from "../data/store.ts";
import type { TrainConfig } from "../job/job.ts";

/** Packed splits of a chat dataset and the report of its packing. */
export interface SftData {
  train: PackedRows;
  valid: PackedRows;
  test: PackedRows;
  /** One line: rows, assistant targets, conversations cut and dropped per split. */
  report: string;
  /** Some conversation was cut or dropped. */
  warn: boolean;
}

/** Loads and packs the chat dataset of an SFT job; throws naming the dataset when it is not one. */
export async function loadSftData(
  root: string,
  c: Pick<TrainConfig, "dataset" | "seq_len">,
): Promise<SftData> {
  const info = await getDataset(root, c.dataset);
  if (!info) throw new Error(`Unknown dataset "${c.dataset}"`);
  if (!isChatDataset(info)) {
    throw new Error(
      `Dataset "${c.dataset}" holds no conversations: objective "sft" needs a chat dataset ` +
        `(POST /datasets with "format": "chat")`,
    );
  }
  const [train, valid, test] = await Promise.all(
    (["train", "valid", "test"] as const).map(async (s) =>
      packChats(await loadChatSplit(root, c.dataset, s), c.seq_len)
    ),
  );
  if (train.rows === 0) {
    throw new Error(
      `No conversation of dataset "${c.dataset}" fits seq_len ${c.seq_len} with an assistant turn: raise seq_len`,
    );
  }
  const parts = ([["train", train], ["valid", valid], ["test", test]] as const).map(([name, p]) =>
    `${name} ${p.rows} rows, ${
      p.mask.reduce((a, m) => a + m, 0)
    } assistant targets, ${p.cut} cut, ${p.dropped} dropped`
  );
  const cut = train.cut + valid.cut + test.cut, dropped = train.dropped + valid.dropped + test.dropped;
  return {
    train,
    valid,
    test,
    report: `SFT data "${c.dataset}" packed at seq_len ${c.seq_len}: ${parts.join("; ")}` +
      (cut + dropped > 0
        ? ` (${cut} conversations longer than seq_len + 1 tokens cut at a turn boundary, ${dropped} dropped: ` +
          `no assistant turn fits)`
        : ""),
    warn: cut + dropped > 0,
  };
}
