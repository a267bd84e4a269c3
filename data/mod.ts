/**
 * The data pipeline's public surface: URL filtering, download, merge, cleaning, MinHash dedup,
 * GPT-2 tokenization, splitting, the dataset store and the training sampler.
 *
 * Import from here, not from the individual files, so internals can move freely.
 */
export { BUILTIN_NAMES, builtinDocuments, type BuiltinName, isBuiltinName } from "./builtin.ts";
export {
  DEFAULT_USER_AGENT,
  type DownloadCounts,
  type DownloadFailure,
  type DownloadOptions,
  type DownloadProgress,
  downloadUrls,
  type WebDocument,
} from "./download.ts";
export { type ExtractedText, extractMainText } from "./extract.ts";
export {
  DEFAULT_MAX_JSON_DEPTH,
  emptyMergeCounts,
  type FileIssue,
  JSON_EXTENSIONS,
  jsonTooDeep,
  type MergeCounts,
  type MergeOptions,
  mergeToLooseJson,
  parseJsonLine,
  readDocuments,
  readLineBytes,
  type ReadPosition,
  type SourceDocument,
  startPosition,
  TEXT_EXTENSIONS,
} from "./merge.ts";
export {
  candidateProbability,
  DEFAULT_MINHASH,
  estimateJaccard,
  LSH_MAX_DOCUMENTS,
  LSH_RECALL_AT_THRESHOLD,
  LSH_RESIDENT_PAGES,
  lshBands,
  LshIndex,
  minhashFromWords,
  type MinHashParams,
  minhashSignature,
  packSignature,
} from "./minhash.ts";
export {
  checkReplace,
  DatasetExistsError,
  type DatasetPlan,
  type DatasetSource,
  planDataset,
  prepareDataset,
  type PrepareOptions,
  type Progress,
  workDir,
} from "./prepare.ts";
export { Sampler, type SamplerOptions, type SamplerState } from "./sampler.ts";
export { type EvalBatches, evalBatches, windowCount } from "./eval_windows.ts";
export { DEFAULT_SPLIT, parseSplitWeights, splitSizes } from "./split.ts";
export {
  checkDatasetId,
  DATASET_ID_RE,
  datasetDir,
  type DatasetInfo,
  datasetsDir,
  getDataset,
  listDatasets,
  loadDocumentIndex,
  loadSplit,
  PathOutsideRootError,
  resolveUnderRoot,
  type SplitCounts,
  type SplitName,
  SPLITS,
} from "./store.ts";
export { cleanText, type DecodedText, decodeUtf8, looksBinary } from "./text.ts";
export {
  createTokenizePool,
  type PoolOptions,
  type TokenizePool,
  type WorkerConfig,
  type WorkerResult,
} from "./tokenize_pool.ts";
export {
  checkPublicUrl,
  DEFAULT_BLACKLIST,
  filterUrls,
  NON_TEXT_EXTENSIONS,
  nonPublicRange,
  normalizeUrl,
  type PublicUrlOptions,
  resolveHost,
  type UrlCounts,
  urlExtension,
  type UrlFilterOptions,
  UrlRefusedError,
} from "./urls.ts";
export { readTaskFile, TASK_FILE_RE, TaskFileNotFoundError, tasksDir } from "./tasks.ts";
export {
  CHAT_EOT,
  CHAT_ROLES,
  CHAT_TEMPLATE,
  type ChatIssue,
  type ChatMessage,
  type ChatRole,
  type ChatSplit,
  type ChatTokens,
  checkMessages,
  encodeChat,
  joinChats,
  packChats,
  type PackedBatch,
  packedBatch,
  packedEvalBatches,
  type PackedRows,
  parseChatJsonl,
  renderChat,
} from "./chat.ts";
export {
  CHAT_DATASET_FORMAT,
  ChatDatasetError,
  type ChatOnError,
  isChatDataset,
  loadChatSplit,
} from "./chat_dataset.ts";
export { PackedSampler } from "./packed_sampler.ts";
