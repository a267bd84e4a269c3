/**
 * Data and tensor parallelism between the Workers of one GPU host: rank groups (groups.ts), the
 * shared-memory allreduce, reduce-scatter and all-gather (allreduce.ts), and the GPU <-> host
 * path of a gradient bucket (exchange.ts, kernels in exchange_kernels.ts), and the tensor-parallel
 * shard specs (model/shard.ts, pure). The GPU host makes a job's buffers (host/comms.ts). Knows
 * WebGPU buffers and SharedArrayBuffers, never HTTP or SQL.
 *
 * Import from here, not from the individual files, so internals can move freely.
 */
export {
  abortCommBuffer,
  type CommAlgorithm,
  commBufferBytes,
  type CommDtype,
  CommError,
  type CommShape,
  createCommBuffer,
  f32BitsToBf16,
  f32BitsToF16,
  type Payload,
  RingComm,
  type RingCommOptions,
  shardRange,
} from "./allreduce.ts";
export {
  type Bucket,
  BucketExchange,
  type ExchangeOptions,
  type ExchangeTiming,
  type ReducePath,
  sharedSource,
  Stager,
  type StagerOptions,
} from "./exchange.ts";
export {
  dataParallelGroups,
  type ParallelLayout,
  parallelLayout,
  type RankGroup,
  type RankGroups,
  rankGroups,
  tensorParallelGroups,
} from "./groups.ts";
export {
  CONTROL_WORDS,
  createControlBuffer,
  GradientReducer,
  joinU32,
  RankControl,
  type ReducerOptions,
  type ReduceTiming,
  splitU32,
  wireDtype,
} from "./data_parallel.ts";
export {
  DistributedOptimizer,
  type ZeroBucket,
  zeroBuckets,
  type ZeroModel,
  type ZeroOptions,
} from "./zero.ts";
export {
  checkTensorParallel,
  cutShard,
  mergeParams,
  mergeShards,
  readSlices,
  shardLayout,
  shardSlices,
  type ShardSpec,
  shardSpecs,
  type Slice,
  type SplitKind,
  splitParams,
  tensorParallelConfig,
  tensorParallelVocab,
  vocabShard,
  type VocabSizes,
  vocabSizes,
  writeSlices,
} from "../../model/shard.ts";
export { TensorParallelExchange, type TensorParallelTiming } from "./tensor_parallel.ts";
