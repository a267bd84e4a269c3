/**
 * Text generation on the GPU with a KV cache, for several streams at once.
 *
 * A prompt is prefilled in one forward pass (the training graph, planned for batch 1 at a length
 * bucket, without gradients), its keys and values copied into the stream's cache slot, and the
 * first token sampled on the GPU. Decode steps then process every stream together (one row per
 * stream), sampling on the GPU and feeding the token back through the state buffer, so a whole
 * chunk of tokens costs one submission and one readback.
 */

import { type ModelConfig, paramLayout } from "./config.ts";
import { createStorage, type GpuContext, GpuError, readBuffers } from "./device.ts";
import { buildModel, destroyModel, type GpuModel } from "./model.ts";
import { encodeOps, makeOp, type Op, type OpKind, PipelineCache, type View } from "./ops.ts";
import { chooseTile, matmulBindings, matmulGrid, type MatmulSpec, matmulWgsl } from "./kernels/matmul.ts";
import { layernormForwardWgsl } from "./kernels/layernorm.ts";
import { attentionDecodeWgsl, type DecodeSpec, embedDecodeWgsl, kvWriteWgsl } from "./kernels/decode.ts";
import { PARAM_WORDS, sampleWgsl, STATE_WORDS } from "./kernels/sample.ts";
import {
  chooseKSplit,
  GEMV_MAX_ROWS,
  type GemvEpilogue,
  gemvPartialWgsl,
  gemvReduceBindings,
  gemvReduceWgsl,
  type GemvSpec,
} from "./kernels/gemv.ts";

/** How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. */
export interface SamplingParams {
  temperature: number;
  top_k: number;
  top_p: number;
  seed: number;
}

/** Generator sizing. */
export interface GeneratorOptions {
  /** Streams decoded together (concurrent requests). */
  streams: number;
  /** Most tokens a stream gets per `decode` call. */
  chunk: number;
}

const BUCKETS = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/** Generates from one model on one GPU. */
export class Generator {
  readonly config: ModelConfig;
  readonly opts: GeneratorOptions;
  #ctx: GpuContext;
  #cache: PipelineCache;
  #params: GPUBuffer;
  #state: GPUBuffer;
  #sampling: GPUBuffer;
  #out: GPUBuffer;
  #sel: GPUBuffer;
  #kc: GPUBuffer[] = [];
  #vc: GPUBuffer[] = [];
  #decode: Op[] = [];
  #buffers: GPUBuffer[] = [];
  #prefills = new Map<number, { model: GpuModel; ops: Op[] }>();
  #pending: Op[] = [];

  private constructor(
    ctx: GpuContext,
    config: ModelConfig,
    opts: GeneratorOptions,
    cache: PipelineCache,
    bufs: {
      params: GPUBuffer;
      state: GPUBuffer;
      sampling: GPUBuffer;
      out: GPUBuffer;
      sel: GPUBuffer;
    },
  ) {
    this.#ctx = ctx;
    this.config = config;
    this.opts = opts;
    this.#cache = cache;
    this.#params = bufs.params;
    this.#state = bufs.state;
    this.#sampling = bufs.sampling;
    this.#out = bufs.out;
    this.#sel = bufs.sel;
  }

  /** Uploads `params` (flat layout) and plans the decode graph. */
  static async create(
    ctx: GpuContext,
    config: ModelConfig,
    params: Float32Array,
    opts: GeneratorOptions,
  ): Promise<Generator> {
    const layout = paramLayout(config);
    if (params.length !== layout.totalSize) {
      throw new GpuError(
        "Cannot load parameters",
        `${params.length} floats, the model needs ${layout.totalSize}`,
      );
    }
    if (!(opts.streams >= 1 && opts.chunk >= 1)) {
      throw new RangeError("Generator needs at least one stream and chunk of 1");
    }
    const buffers: GPUBuffer[] = [];
    const alloc = async (label: string, bytes: number) => {
      const b = await createStorage(ctx, label, bytes);
      buffers.push(b);
      return b;
    };
    const p = await alloc("gen.params", params.byteLength);
    ctx.device.queue.writeBuffer(p, 0, params.buffer as ArrayBuffer, params.byteOffset, params.byteLength);
    const S = opts.streams;
    const g = new Generator(ctx, config, opts, new PipelineCache(ctx), {
      params: p,
      state: await alloc("gen.state", S * STATE_WORDS * 4),
      sampling: await alloc("gen.sampling", S * PARAM_WORDS * 4),
      out: await alloc("gen.out", S * opts.chunk * 4),
      sel: await alloc("gen.sel", 16),
    });
    g.#buffers = buffers;
    await g.#planDecode(alloc);
    return g;
  }

  async #planDecode(alloc: (label: string, bytes: number) => Promise<GPUBuffer>): Promise<void> {
    const ctx = this.#ctx, c = this.config, S = this.opts.streams;
    const C = c.n_embd, H = c.n_head, D = C / H, L = c.n_layer, Vp = c.padded_vocab_size;
    const spec: DecodeSpec = { S, H, D, Tmax: c.n_positions };
    if (c.n_positions * 4 + 256 * 20 > ctx.limits.maxComputeWorkgroupStorageSize) {
      throw new GpuError(
        "Generator",
        `n_positions ${c.n_positions} needs more workgroup memory than the device has`,
      );
    }
    const layout = paramLayout(c);
    const P = (name: string): View => {
      const t = layout.byName.get(name)!;
      return { buffer: this.#params, offset: t.offset * 4, size: t.size * 4 };
    };
    const V = (buffer: GPUBuffer): View => ({ buffer });
    const f = (n: number) => alloc("gen.act", Math.max(16, n * 4));
    const x = await f(S * C), x2 = await f(S * C), ln = await f(S * C), stats = await f(S * 2);
    const qkv = await f(S * 3 * C), y = await f(S * C), fch = await f(S * 4 * C), fcg = await f(S * 4 * C);
    const logits = await f(S * Vp);
    for (let l = 0; l < L; l++) {
      this.#kc.push(await alloc(`gen.k${l}`, S * H * c.n_positions * D * 4));
      this.#vc.push(await alloc(`gen.v${l}`, S * H * c.n_positions * D * 4));
    }
    const op = async (
      kind: OpKind,
      label: string,
      code: string,
      views: View[],
      grid: [number, number] | [number],
    ) => makeOp(ctx, await this.#cache.get(label, code), { label, phase: "forward", kind, views, grid });
    const mm = async (label: string, s: MatmulSpec, views: Record<string, View>) => {
      const tile = chooseTile(s, ctx.limits.maxComputeInvocationsPerWorkgroup);
      return await op(
        "matmul_fwd",
        label,
        matmulWgsl(s, tile),
        matmulBindings(s).map((n) => views[n]),
        matmulGrid(s, tile),
      );
    };
    const base = { transA: false, transB: false, bias: true } as const;
    const C4g = Math.ceil((S * C) / 4 / 64);
    // Linear layers: the skinny gemv (split over K, then summed with the epilogue) for few streams.
    const useGemv = S <= GEMV_MAX_ROWS;
    const shapes = [[3 * C, C], [C, C], [4 * C, C], [C, 4 * C]];
    const partFloats = Math.max(...shapes.map(([n, k]) => chooseKSplit(n, k) * S * n));
    const part = useGemv ? await f(partFloats) : null;
    const lnOp = (src: GPUBuffer, w: string, b: string, label: string) =>
      op("layernorm", label, layernormForwardWgsl(C), [V(src), P(w), P(b), V(ln), V(stats)], [S]);
    /**
     * One linear layer. `fuse.ln` names the LayerNorm before it (views.A is then its raw input),
     * `fuse.kv` the layer whose KV cache the qkv output feeds. The skinny gemv fuses both; the
     * tiled matmul (many streams) runs them as separate kernels.
     */
    const lin = async (
      label: string,
      s: MatmulSpec,
      views: Record<string, View>,
      fuse: { ln?: [string, string]; kv?: number } = {},
    ): Promise<Op[]> => {
      if (!part) {
        const out: Op[] = [];
        if (fuse.ln) out.push(await lnOp(views.A.buffer, fuse.ln[0], fuse.ln[1], label + ".ln"));
        out.push(await mm(label, s, fuse.ln ? { ...views, A: V(ln) } : views));
        if (fuse.kv !== undefined) {
          const l = fuse.kv;
          out.push(
            await op("attention_fwd", label + ".kv", kvWriteWgsl(spec, { append: true }), [
              V(this.#state),
              views.out,
              V(this.#kc[l]),
              V(this.#vc[l]),
            ], [C4g]),
          );
        }
        return out;
      }
      const g: GemvSpec = {
        M: s.M,
        N: s.N,
        K: s.K,
        bias: s.bias,
        epilogue: s.epilogue as GemvEpilogue,
        KS: chooseKSplit(s.N, s.K),
        ln: !!fuse.ln,
        kv: fuse.kv !== undefined ? { H, D, Tmax: c.n_positions } : undefined,
      };
      const all: Record<string, View> = { ...views, part: V(part) };
      if (fuse.kv !== undefined) {
        Object.assign(all, { state: V(this.#state), kc: V(this.#kc[fuse.kv]), vc: V(this.#vc[fuse.kv]) });
      }
      const partViews = [views.A, views.B, V(part), ...(fuse.ln ? [P(fuse.ln[0]), P(fuse.ln[1])] : [])];
      return [
        await op("matmul_fwd", label + ".gemv", gemvPartialWgsl(g), partViews, [Math.ceil(s.N / 128), g.KS]),
        await op("matmul_fwd", label + ".sum", gemvReduceWgsl(g), gemvReduceBindings(g).map((n) => all[n]), [
          Math.ceil((s.M * s.N) / 4 / 64),
        ]),
      ];
    };
    const ops: Op[] = [];
    ops.push(
      await op("embedding", "dec.embed", embedDecodeWgsl(spec), [
        V(this.#state),
        P("wte.weight"),
        P("wpe.weight"),
        V(x),
      ], [C4g]),
    );
    for (let l = 0; l < L; l++) {
      const p = `h.${l}.`;
      ops.push(
        ...await lin(`dec.l${l}.qkv`, { ...base, M: S, N: 3 * C, K: C, epilogue: "store" }, {
          A: V(x),
          B: P(p + "attn.c_attn.weight"),
          bias: P(p + "attn.c_attn.bias"),
          out: V(qkv),
        }, { ln: [p + "ln_1.weight", p + "ln_1.bias"], kv: l }),
      );
      ops.push(
        await op("attention_fwd", `dec.l${l}.attn`, attentionDecodeWgsl(spec), [
          V(this.#state),
          V(qkv),
          V(this.#kc[l]),
          V(this.#vc[l]),
          V(y),
        ], [S, H]),
      );
      ops.push(
        ...await lin(`dec.l${l}.proj`, { ...base, M: S, N: C, K: C, epilogue: "residual" }, {
          A: V(y),
          B: P(p + "attn.c_proj.weight"),
          bias: P(p + "attn.c_proj.bias"),
          res: V(x),
          out: V(x2),
        }),
      );
      ops.push(
        ...await lin(`dec.l${l}.fc`, { ...base, M: S, N: 4 * C, K: C, epilogue: "gelu" }, {
          A: V(x2),
          B: P(p + "mlp.c_fc.weight"),
          bias: P(p + "mlp.c_fc.bias"),
          out: V(fch),
          out2: V(fcg),
        }, { ln: [p + "ln_2.weight", p + "ln_2.bias"] }),
      );
      ops.push(
        ...await lin(`dec.l${l}.fcproj`, { ...base, M: S, N: C, K: 4 * C, epilogue: "residual" }, {
          A: V(fcg),
          B: P(p + "mlp.c_proj.weight"),
          bias: P(p + "mlp.c_proj.bias"),
          res: V(x2),
          out: V(x),
        }),
      );
    }
    ops.push(await lnOp(x, "ln_f.weight", "ln_f.bias", "dec.lnf"));
    ops.push(
      await mm("dec.lm_head", {
        M: S,
        N: Vp,
        K: C,
        transA: false,
        transB: true,
        bias: false,
        epilogue: "store",
      }, {
        A: V(ln),
        B: P("wte.weight"),
        out: V(logits),
      }),
    );
    const sample = sampleWgsl({
      V: c.vocab_size,
      Vp,
      streams: S,
      chunk: this.opts.chunk,
      rows: "stream",
      maxPos: c.n_positions - 1,
    });
    ops.push(
      await op("elementwise", "dec.sample", sample, [
        V(logits),
        V(this.#state),
        V(this.#sampling),
        V(this.#out),
      ], [S]),
    );
    this.#decode = ops;
  }

  async #prefillPlan(len: number): Promise<{ model: GpuModel; ops: Op[] }> {
    const c = this.config;
    const Tb = BUCKETS.find((b) => b >= len && b <= c.n_positions) ?? c.n_positions;
    let plan = this.#prefills.get(Tb);
    if (plan) return plan;
    const ctx = this.#ctx;
    const model = await buildModel(
      ctx,
      { config: c, B: 1, T: Tb, attnDropout: 0, hiddenDropout: 0 },
      { train: false, params: this.#params },
    );
    const D = c.n_embd / c.n_head;
    const spec: DecodeSpec = { S: this.opts.streams, H: c.n_head, D, Tmax: c.n_positions };
    const ops: Op[] = [...model.forward];
    for (let l = 0; l < c.n_layer; l++) {
      const code = kvWriteWgsl(spec, { prefillRows: Tb });
      ops.push(makeOp(ctx, await this.#cache.get("prefill.kv", code), {
        label: `prefill.l${l}.kv`,
        phase: "forward",
        kind: "attention_fwd",
        views: [{ buffer: this.#sel }, { buffer: model.layers[l].qkv }, { buffer: this.#kc[l] }, {
          buffer: this.#vc[l],
        }],
        grid: [Math.ceil((Tb * c.n_embd) / 4 / 64)],
      }));
    }
    const code = sampleWgsl({
      V: c.vocab_size,
      Vp: c.padded_vocab_size,
      streams: this.opts.streams,
      chunk: this.opts.chunk,
      rows: "prefill",
      maxPos: c.n_positions - 1,
    });
    ops.push(makeOp(ctx, await this.#cache.get("prefill.sample", code), {
      label: "prefill.sample",
      phase: "forward",
      kind: "elementwise",
      views: [{ buffer: model.logits }, { buffer: this.#state }, { buffer: this.#sampling }, {
        buffer: this.#out,
      }, {
        buffer: this.#sel,
      }],
      grid: [1],
    }));
    plan = { model, ops };
    this.#prefills.set(Tb, plan);
    return plan;
  }

  /**
   * Starts stream `slot` on `prompt` (1 … n_positions−1 tokens): prefills its cache and samples its
   * first token, which the next `decode` returns first. Nothing is submitted until `decode`.
   */
  async prefill(slot: number, prompt: ArrayLike<number>, sampling: SamplingParams): Promise<void> {
    const c = this.config, len = prompt.length;
    if (!(slot >= 0 && slot < this.opts.streams)) throw new RangeError(`Stream slot ${slot} is out of range`);
    if (len < 1 || len >= c.n_positions) {
      throw new RangeError(`Prompt of ${len} tokens must have 1 to ${c.n_positions - 1} tokens`);
    }
    // Prefills are submitted one at a time: each uses the shared `sel` and bucket buffers.
    if (this.#pending.length) this.#flushPrefill();
    const plan = await this.#prefillPlan(len);
    const Tb = plan.model.shape.T;
    const tokens = new Uint32Array(Tb + 1);
    for (let i = 0; i < len; i++) {
      const t = prompt[i];
      if (!(Number.isInteger(t) && t >= 0 && t < c.vocab_size)) {
        throw new RangeError(`Prompt token ${t} at ${i} is outside the vocabulary`);
      }
      tokens[i] = t;
    }
    const q = this.#ctx.device.queue;
    q.writeBuffer(plan.model.tokens, 0, tokens);
    q.writeBuffer(this.#sel, 0, new Uint32Array([len - 1, slot, len, 0]));
    q.writeBuffer(
      this.#state,
      slot * STATE_WORDS * 4,
      new Uint32Array([prompt[len - 1], len - 1, sampling.seed >>> 0, 0]),
    );
    const sp = new Uint32Array(PARAM_WORDS), spf = new Float32Array(sp.buffer);
    spf[0] = sampling.temperature;
    sp[1] = sampling.top_k >>> 0;
    spf[2] = sampling.top_p;
    q.writeBuffer(this.#sampling, slot * PARAM_WORDS * 4, sp);
    this.#pending = plan.ops;
  }

  #flushPrefill(): void {
    const enc = this.#ctx.device.createCommandEncoder();
    encodeOps(enc, this.#pending);
    this.#ctx.device.queue.submit([enc.finish()]);
    this.#pending = [];
  }

  /**
   * Runs any pending prefill and `steps` decode steps for all streams in one submission, then reads
   * back what each stream produced since the last call: the prefill's first token (if any) and one
   * token per step. Returns one array per stream.
   */
  async decode(steps: number): Promise<Uint32Array[]> {
    const S = this.opts.streams, chunk = this.opts.chunk;
    if (!(steps >= 0 && steps + (this.#pending.length ? 1 : 0) <= chunk)) {
      throw new RangeError(`Decode of ${steps} steps exceeds the chunk of ${chunk} tokens`);
    }
    const enc = this.#ctx.device.createCommandEncoder();
    if (this.#pending.length) {
      encodeOps(enc, this.#pending);
      this.#pending = [];
    }
    for (let i = 0; i < steps; i++) encodeOps(enc, this.#decode);
    this.#ctx.device.queue.submit([enc.finish()]);
    // State and tokens in one readback.
    const [sbuf, obuf] = await readBuffers(this.#ctx, [{ buffer: this.#state }, { buffer: this.#out }]);
    const state = new Uint32Array(sbuf), out = new Uint32Array(obuf);
    const res: Uint32Array[] = [];
    for (let s = 0; s < S; s++) {
      res.push(out.slice(s * chunk, s * chunk + Math.min(state[s * STATE_WORDS + 3], chunk)));
      state[s * STATE_WORDS + 3] = 0;
    }
    // Nothing runs on the GPU now: write the state back with every stream's count reset.
    this.#ctx.device.queue.writeBuffer(this.#state, 0, state);
    return res;
  }

  /** Frees the GPU buffers. */
  destroy(): void {
    for (const { model } of this.#prefills.values()) destroyModel(model);
    for (const b of this.#buffers) b.destroy();
  }
}
