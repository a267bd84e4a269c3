/**
 * GPU roles (`GPT2_GPU_ROLES`): what each GPU is for, one entry per GPU index, comma-separated.
 * An entry is `train`, `generate`, or `any` (also `train+generate`); GPUs past the list are `any`.
 * With `GPT2_GPU_ROLES=train,generate` GPU 0 trains and GPU 1 serves generation. Generation
 * prefers a GPU that is not training at the moment; training goes only where `train` is allowed.
 */

/** What a GPU may do. */
export type GpuRole = "train" | "generate";

/** Roles per GPU index. */
export type GpuRoles = ReadonlySet<GpuRole>[];

const ALL: ReadonlySet<GpuRole> = new Set<GpuRole>(["train", "generate"]);

/**
 * Parses a roles list for `gpus` GPUs. Throws RangeError naming the bad entry, for an unknown
 * role, a list longer than the GPUs, or a list that leaves no GPU able to generate or to train.
 */
export function parseGpuRoles(spec: string | undefined, gpus: number): GpuRoles {
  const roles: ReadonlySet<GpuRole>[] = Array.from({ length: gpus }, () => ALL);
  if (!spec?.trim()) return roles;
  const entries = spec.split(",").map((s) => s.trim().toLowerCase());
  if (entries.length > gpus) {
    throw new RangeError(`GPT2_GPU_ROLES "${spec}" names ${entries.length} GPUs, there are ${gpus}`);
  }
  entries.forEach((e, i) => {
    if (e === "any" || e === "" || e === "train+generate" || e === "generate+train") roles[i] = ALL;
    else if (e === "train" || e === "generate") roles[i] = new Set<GpuRole>([e]);
    else throw new RangeError(`GPT2_GPU_ROLES entry "${e}" for GPU ${i} must be train, generate or any`);
  });
  for (const role of ["train", "generate"] as const) {
    if (!roles.some((r) => r.has(role))) {
      throw new RangeError(`GPT2_GPU_ROLES "${spec}" leaves no GPU to ${role}`);
    }
  }
  return roles;
}

/** GPU indices that may run training jobs, in order (for the runner's placement). */
export function trainingGpus(roles: GpuRoles): number[] {
  return roles.flatMap((r, i) => (r.has("train") ? [i] : []));
}

/** GPU indices that may serve generation, in order. */
export function generationGpus(roles: GpuRoles): number[] {
  return roles.flatMap((r, i) => (r.has("generate") ? [i] : []));
}
