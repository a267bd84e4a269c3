/**
 * CPU reference of GPT-2 training in plain TypeScript (float64, simple loops, llm.c style).
 *
 * Why: the WebGPU engine is checked against this file, so it favours being obviously correct over
 * being fast. Every layer is a pair `x_forward(out, inp..., B, T, C)` / `x_backward(dinp, dweight,
 * ..., B, T, C)` working on flat Float64Arrays; parameters and gradients use the flat layout of
 * {@link paramLayout} (weights stored [in, out], so a linear layer is out = inp @ W + b). Dropout
 * masks are never stored: they are recomputed from (seed, step, site, element index) with the
 * counter-based hash of model/rng.ts, bit-identical to the GPU kernels. `initParams` is the GPT-2
 * initialisation shared by the engine and the reference.
 */

import { type ModelConfig, paramLayout } from "../../model/config.ts";
import { dropKeep, dropoutKey, dropoutSite, dropThreshold } from "../../model/rng.ts";
import type { AdamWConfig } from "../../model/schedule.ts";

/** Token windows: B rows of T+1 ids (inputs are the first T, targets the last T). */
export type TokenArray = Uint16Array | Int32Array;

/** LayerNorm epsilon (GPT-2's). */
export const LN_EPS = 1e-5;

/** Dropout settings of one forward pass; masks are a pure function of (seed, step, site, index). */
export interface ReferenceOptions {
  /** Dropout seed. */
  seed: number;
  /** Training step (0-based); part of every dropout key. */
  step: number;
  /** Dropout probability on the attention probabilities (after softmax). */
  attnDropout: number;
  /** Dropout probability on the embedding and on the two residual-branch outputs of each block. */
  hiddenDropout: number;
  /**
   * SFT's loss mask (B·T, 1 where position t's target counts): the loss is the mean over those
   * positions only, and the others get no gradient. Absent: every position counts.
   */
  lossMask?: Uint8Array;
}

const DEFAULT_OPTIONS: ReferenceOptions = { seed: 0, step: 0, attnDropout: 0, hiddenDropout: 0 };

// ----------------------------------------------------------------------------------------------
// Parameter views

/** Views of one transformer block's tensors. */
export interface LayerViews {
  ln1w: Float64Array; // (C)
  ln1b: Float64Array; // (C)
  qkvw: Float64Array; // (C, 3C)
  qkvb: Float64Array; // (3C)
  attprojw: Float64Array; // (C, C)
  attprojb: Float64Array; // (C)
  ln2w: Float64Array; // (C)
  ln2b: Float64Array; // (C)
  fcw: Float64Array; // (C, 4C)
  fcb: Float64Array; // (4C)
  fcprojw: Float64Array; // (4C, C)
  fcprojb: Float64Array; // (C)
}

/** Views of every parameter tensor (or of its gradient) in a flat layout buffer. */
export interface ParamViews {
  wte: Float64Array; // (Vp, C)
  wpe: Float64Array; // (maxT, C)
  layers: LayerViews[];
  lnfw: Float64Array; // (C)
  lnfb: Float64Array; // (C)
}

/** Splits a flat buffer in {@link paramLayout} order into named subarray views (no copies). */
export function paramViews(config: ModelConfig, buf: Float64Array): ParamViews {
  const layout = paramLayout(config);
  if (buf.length !== layout.totalSize) {
    throw new RangeError(`Parameter buffer has ${buf.length} floats, the layout needs ${layout.totalSize}`);
  }
  const view = (name: string) => {
    const t = layout.byName.get(name);
    if (!t) throw new Error(`No tensor named ${name} in the layout`);
    return buf.subarray(t.offset, t.offset + t.size);
  };
  const layers: LayerViews[] = [];
  for (let l = 0; l < config.n_layer; l++) {
    const p = `h.${l}.`;
    layers.push({
      ln1w: view(p + "ln_1.weight"),
      ln1b: view(p + "ln_1.bias"),
      qkvw: view(p + "attn.c_attn.weight"),
      qkvb: view(p + "attn.c_attn.bias"),
      attprojw: view(p + "attn.c_proj.weight"),
      attprojb: view(p + "attn.c_proj.bias"),
      ln2w: view(p + "ln_2.weight"),
      ln2b: view(p + "ln_2.bias"),
      fcw: view(p + "mlp.c_fc.weight"),
      fcb: view(p + "mlp.c_fc.bias"),
      fcprojw: view(p + "mlp.c_proj.weight"),
      fcprojb: view(p + "mlp.c_proj.bias"),
    });
  }
  return {
    wte: view("wte.weight"),
    wpe: view("wpe.weight"),
    layers,
    lnfw: view("ln_f.weight"),
    lnfb: view("ln_f.bias"),
  };
}

// ----------------------------------------------------------------------------------------------
// Layers

/** out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]. */
export function encoder_forward(
  out: Float64Array, // (B,T,C)
  inp: Int32Array, // (B,T) token ids
  wte: Float64Array, // (Vp,C)
  wpe: Float64Array, // (maxT,C)
  B: number,
  T: number,
  C: number,
): void {
  for (let b = 0; b < B; b++) {
    for (let t = 0; t < T; t++) {
      const o = (b * T + t) * C, ix = inp[b * T + t] * C, ip = t * C;
      for (let c = 0; c < C; c++) out[o + c] = wte[ix + c] + wpe[ip + c];
    }
  }
}

/** Accumulates the embedding gradient into the rows of wte and wpe that were read. */
export function encoder_backward(
  dwte: Float64Array, // (Vp,C)
  dwpe: Float64Array, // (maxT,C)
  dout: Float64Array, // (B,T,C)
  inp: Int32Array, // (B,T)
  B: number,
  T: number,
  C: number,
): void {
  for (let b = 0; b < B; b++) {
    for (let t = 0; t < T; t++) {
      const o = (b * T + t) * C, ix = inp[b * T + t] * C, ip = t * C;
      for (let c = 0; c < C; c++) {
        dwte[ix + c] += dout[o + c];
        dwpe[ip + c] += dout[o + c];
      }
    }
  }
}

/** Inverted dropout: out[i] = keep(i) ? inp[i] / (1-p) : 0 with the hash mask of `key`; p = 0 copies. */
export function dropout_forward(
  out: Float64Array, // (N)
  inp: Float64Array, // (N)
  N: number,
  p: number,
  key: number,
): void {
  if (p === 0) {
    if (out !== inp) out.set(inp.subarray(0, N));
    return;
  }
  const threshold = dropThreshold(p), scale = 1 / (1 - p);
  for (let i = 0; i < N; i++) out[i] = dropKeep(i, key, threshold) ? inp[i] * scale : 0;
}

/** dinp[i] += keep(i) ? dout[i] / (1-p) : 0 (same mask as the forward). */
export function dropout_backward(
  dinp: Float64Array, // (N)
  dout: Float64Array, // (N)
  N: number,
  p: number,
  key: number,
): void {
  if (p === 0) {
    for (let i = 0; i < N; i++) dinp[i] += dout[i];
    return;
  }
  const threshold = dropThreshold(p), scale = 1 / (1 - p);
  for (let i = 0; i < N; i++) if (dropKeep(i, key, threshold)) dinp[i] += dout[i] * scale;
}

/** LayerNorm over C (biased variance, eps {@link LN_EPS}); saves mean and 1/std per position. */
export function layernorm_forward(
  out: Float64Array, // (B,T,C)
  mean: Float64Array, // (B,T)
  rstd: Float64Array, // (B,T)
  inp: Float64Array, // (B,T,C)
  weight: Float64Array, // (C)
  bias: Float64Array, // (C)
  B: number,
  T: number,
  C: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * C;
    let m = 0;
    for (let c = 0; c < C; c++) m += inp[o + c];
    m /= C;
    let v = 0;
    for (let c = 0; c < C; c++) v += (inp[o + c] - m) ** 2;
    v /= C;
    const s = 1 / Math.sqrt(v + LN_EPS);
    for (let c = 0; c < C; c++) out[o + c] = (inp[o + c] - m) * s * weight[c] + bias[c];
    mean[bt] = m;
    rstd[bt] = s;
  }
}

/** Accumulates LayerNorm gradients into dinp, dweight and dbias. */
export function layernorm_backward(
  dinp: Float64Array, // (B,T,C)
  dweight: Float64Array, // (C)
  dbias: Float64Array, // (C)
  dout: Float64Array, // (B,T,C)
  inp: Float64Array, // (B,T,C)
  weight: Float64Array, // (C)
  mean: Float64Array, // (B,T)
  rstd: Float64Array, // (B,T)
  B: number,
  T: number,
  C: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * C, m = mean[bt], s = rstd[bt];
    // two reductions: mean of (w * dout) and mean of (w * dout * norm)
    let dnormMean = 0, dnormNormMean = 0;
    for (let c = 0; c < C; c++) {
      const norm = (inp[o + c] - m) * s, dnorm = weight[c] * dout[o + c];
      dnormMean += dnorm;
      dnormNormMean += dnorm * norm;
    }
    dnormMean /= C;
    dnormNormMean /= C;
    for (let c = 0; c < C; c++) {
      const norm = (inp[o + c] - m) * s, dnorm = weight[c] * dout[o + c];
      dbias[c] += dout[o + c];
      dweight[c] += norm * dout[o + c];
      dinp[o + c] += (dnorm - dnormMean - norm * dnormNormMean) * s;
    }
  }
}

/** out = inp @ weight + bias, weight stored [in, out] (Hugging Face Conv1D layout). */
export function matmul_forward(
  out: Float64Array, // (B,T,OC)
  inp: Float64Array, // (B,T,C)
  weight: Float64Array, // (C,OC)
  bias: Float64Array | null, // (OC)
  B: number,
  T: number,
  C: number,
  OC: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * OC, ii = bt * C;
    for (let j = 0; j < OC; j++) out[o + j] = bias ? bias[j] : 0;
    for (let c = 0; c < C; c++) {
      const a = inp[ii + c], w = c * OC;
      for (let j = 0; j < OC; j++) out[o + j] += a * weight[w + j];
    }
  }
}

/** Accumulates dinp += dout @ weight^T, dweight += inp^T @ dout, dbias += sum of dout. */
export function matmul_backward(
  dinp: Float64Array, // (B,T,C)
  dweight: Float64Array, // (C,OC)
  dbias: Float64Array | null, // (OC)
  dout: Float64Array, // (B,T,OC)
  inp: Float64Array, // (B,T,C)
  weight: Float64Array, // (C,OC)
  B: number,
  T: number,
  C: number,
  OC: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * OC, ii = bt * C;
    if (dbias) { for (let j = 0; j < OC; j++) dbias[j] += dout[o + j]; }
    for (let c = 0; c < C; c++) {
      const a = inp[ii + c], w = c * OC;
      let d = 0;
      for (let j = 0; j < OC; j++) {
        d += dout[o + j] * weight[w + j];
        dweight[w + j] += a * dout[o + j];
      }
      dinp[ii + c] += d;
    }
  }
}

/**
 * Causal multi-head self-attention. qkv rows are [q | k | v], head h owning columns h*hd..(h+1)*hd
 * of each. att gets the softmax probabilities (zero above the diagonal), attDrop the probabilities
 * after dropout (element index ((b*NH + h)*T + i)*T + j), out the heads concatenated in order.
 */
export function attention_forward(
  out: Float64Array, // (B,T,C)
  att: Float64Array, // (B,NH,T,T)
  attDrop: Float64Array, // (B,NH,T,T), may be att itself when p = 0
  qkv: Float64Array, // (B,T,3C)
  B: number,
  T: number,
  C: number,
  NH: number,
  p: number,
  key: number,
): void {
  const hd = C / NH, C3 = 3 * C, scale = 1 / Math.sqrt(hd);
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < NH; h++) {
      for (let i = 0; i < T; i++) {
        const q = (b * T + i) * C3 + h * hd, a = ((b * NH + h) * T + i) * T;
        let max = -Infinity;
        for (let j = 0; j <= i; j++) {
          const k = (b * T + j) * C3 + C + h * hd;
          let s = 0;
          for (let d = 0; d < hd; d++) s += qkv[q + d] * qkv[k + d];
          s *= scale;
          att[a + j] = s;
          if (s > max) max = s;
        }
        let sum = 0;
        for (let j = 0; j <= i; j++) {
          const e = Math.exp(att[a + j] - max);
          att[a + j] = e;
          sum += e;
        }
        for (let j = 0; j < T; j++) att[a + j] = j <= i ? att[a + j] / sum : 0;
      }
    }
  }
  dropout_forward(attDrop, att, B * NH * T * T, p, key);
  out.fill(0, 0, B * T * C);
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < NH; h++) {
      for (let i = 0; i < T; i++) {
        const o = (b * T + i) * C + h * hd, a = ((b * NH + h) * T + i) * T;
        for (let j = 0; j <= i; j++) {
          const v = (b * T + j) * C3 + 2 * C + h * hd, w = attDrop[a + j];
          for (let d = 0; d < hd; d++) out[o + d] += w * qkv[v + d];
        }
      }
    }
  }
}

/** Accumulates the gradient of {@link attention_forward} into dqkv. */
export function attention_backward(
  dqkv: Float64Array, // (B,T,3C)
  dout: Float64Array, // (B,T,C)
  qkv: Float64Array, // (B,T,3C)
  att: Float64Array, // (B,NH,T,T) softmax probabilities
  attDrop: Float64Array, // (B,NH,T,T) after dropout
  B: number,
  T: number,
  C: number,
  NH: number,
  p: number,
  key: number,
): void {
  const hd = C / NH, C3 = 3 * C, scale = 1 / Math.sqrt(hd);
  const dattDrop = new Float64Array(T), datt = new Float64Array(T);
  const threshold = p > 0 ? dropThreshold(p) : 0, keepScale = 1 / (1 - p);
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < NH; h++) {
      for (let i = 0; i < T; i++) {
        const o = (b * T + i) * C + h * hd, a = ((b * NH + h) * T + i) * T;
        const q = (b * T + i) * C3 + h * hd;
        // y_i = sum_j attDrop_ij v_j
        for (let j = 0; j <= i; j++) {
          const v = (b * T + j) * C3 + 2 * C + h * hd;
          let s = 0;
          for (let d = 0; d < hd; d++) {
            s += dout[o + d] * qkv[v + d];
            dqkv[v + d] += attDrop[a + j] * dout[o + d];
          }
          dattDrop[j] = s;
        }
        // through the dropout on the probabilities
        for (let j = 0; j <= i; j++) {
          datt[j] = p === 0 ? dattDrop[j] : dropKeep(a + j, key, threshold) ? dattDrop[j] * keepScale : 0;
        }
        // through the softmax: ds_j = P_j (dP_j - sum_k P_k dP_k)
        let dot = 0;
        for (let j = 0; j <= i; j++) dot += att[a + j] * datt[j];
        for (let j = 0; j <= i; j++) {
          const ds = att[a + j] * (datt[j] - dot) * scale;
          const k = (b * T + j) * C3 + C + h * hd;
          for (let d = 0; d < hd; d++) {
            dqkv[q + d] += ds * qkv[k + d];
            dqkv[k + d] += ds * qkv[q + d];
          }
        }
      }
    }
  }
}

const GELU_SCALE = Math.sqrt(2 / Math.PI);

/** GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
export function gelu_forward(
  out: Float64Array, // (N)
  inp: Float64Array, // (N)
  N: number,
): void {
  for (let i = 0; i < N; i++) {
    const x = inp[i];
    out[i] = 0.5 * x * (1 + Math.tanh(GELU_SCALE * (x + 0.044715 * x * x * x)));
  }
}

/** Accumulates dinp += gelu'(inp) * dout. */
export function gelu_backward(
  dinp: Float64Array, // (N)
  inp: Float64Array, // (N)
  dout: Float64Array, // (N)
  N: number,
): void {
  for (let i = 0; i < N; i++) {
    const x = inp[i];
    const th = Math.tanh(GELU_SCALE * (x + 0.044715 * x * x * x));
    const grad = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * GELU_SCALE * (1 + 3 * 0.044715 * x * x);
    dinp[i] += grad * dout[i];
  }
}

/** Tied LM head over all Vp rows of wte: out[bt, v] = inp[bt, :] · wte[v, :]. */
export function lmhead_forward(
  out: Float64Array, // (B,T,Vp)
  inp: Float64Array, // (B,T,C)
  wte: Float64Array, // (Vp,C)
  B: number,
  T: number,
  C: number,
  Vp: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * Vp, ii = bt * C;
    for (let v = 0; v < Vp; v++) {
      const w = v * C;
      let s = 0;
      for (let c = 0; c < C; c++) s += inp[ii + c] * wte[w + c];
      out[o + v] = s;
    }
  }
}

/**
 * Accumulates the LM-head gradient. Only the first V (real) columns are visited: the loss ignores
 * the padded columns, so their dlogits are exactly 0 and padded wte rows get no gradient.
 */
export function lmhead_backward(
  dinp: Float64Array, // (B,T,C)
  dwte: Float64Array, // (Vp,C)
  dout: Float64Array, // (B,T,Vp)
  inp: Float64Array, // (B,T,C)
  wte: Float64Array, // (Vp,C)
  B: number,
  T: number,
  C: number,
  V: number,
  Vp: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * Vp, ii = bt * C;
    for (let v = 0; v < V; v++) {
      const d = dout[o + v], w = v * C;
      if (d === 0) continue;
      for (let c = 0; c < C; c++) {
        dinp[ii + c] += d * wte[w + c];
        dwte[w + c] += d * inp[ii + c];
      }
    }
  }
}

/** Per-position cross-entropy, softmax over the real vocabulary [0, V) only. */
export function crossentropy_forward(
  losses: Float64Array, // (B,T)
  logits: Float64Array, // (B,T,Vp)
  targets: Int32Array, // (B,T)
  B: number,
  T: number,
  V: number,
  Vp: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * Vp;
    let max = -Infinity;
    for (let v = 0; v < V; v++) if (logits[o + v] > max) max = logits[o + v];
    let sum = 0;
    for (let v = 0; v < V; v++) sum += Math.exp(logits[o + v] - max);
    losses[bt] = Math.log(sum) + max - logits[o + targets[bt]];
  }
}

/** dlogits = (softmax(logits[:V]) - onehot(target)) * dloss over [0, V); padded columns get 0. */
export function crossentropy_softmax_backward(
  dlogits: Float64Array, // (B,T,Vp)
  logits: Float64Array, // (B,T,Vp)
  targets: Int32Array, // (B,T)
  dloss: number, // d(mean loss)/d(loss at one position) = 1/(B*T)
  B: number,
  T: number,
  V: number,
  Vp: number,
): void {
  for (let bt = 0; bt < B * T; bt++) {
    const o = bt * Vp;
    let max = -Infinity;
    for (let v = 0; v < V; v++) if (logits[o + v] > max) max = logits[o + v];
    let sum = 0;
    for (let v = 0; v < V; v++) sum += Math.exp(logits[o + v] - max);
    for (let v = 0; v < V; v++) dlogits[o + v] = (Math.exp(logits[o + v] - max) / sum) * dloss;
    for (let v = V; v < Vp; v++) dlogits[o + v] = 0;
    dlogits[o + targets[bt]] -= dloss;
  }
}

// ----------------------------------------------------------------------------------------------
// The model

/** Activations of one block saved for the backward pass. */
interface LayerCache {
  resid: Float64Array; // (B,T,C) block input
  ln1: Float64Array; // (B,T,C)
  ln1Mean: Float64Array; // (B,T)
  ln1Rstd: Float64Array; // (B,T)
  qkv: Float64Array; // (B,T,3C)
  att: Float64Array; // (B,NH,T,T)
  attDrop: Float64Array; // (B,NH,T,T)
  atty: Float64Array; // (B,T,C)
  resid2: Float64Array; // (B,T,C)
  ln2: Float64Array; // (B,T,C)
  ln2Mean: Float64Array; // (B,T)
  ln2Rstd: Float64Array; // (B,T)
  fc: Float64Array; // (B,T,4C) before GELU
  gelu: Float64Array; // (B,T,4C)
}

/** Everything {@link referenceBackward} needs from the forward pass. */
export interface ForwardCache {
  config: ModelConfig;
  B: number;
  T: number;
  opts: ReferenceOptions;
  inputs: Int32Array; // (B,T)
  targets: Int32Array; // (B,T)
  layers: LayerCache[];
  residL: Float64Array; // (B,T,C) output of the last block
  lnf: Float64Array; // (B,T,C)
  lnfMean: Float64Array; // (B,T)
  lnfRstd: Float64Array; // (B,T)
  logits: Float64Array; // (B,T,Vp)
}

/** Result of {@link referenceForward}. */
export interface ForwardResult {
  /** (B,T,Vp) logits over every padded row of wte. */
  logits: Float64Array;
  /** Mean cross-entropy over the B*T positions (softmax over the real vocabulary). */
  loss: number;
  cache: ForwardCache;
}

function splitTokens(
  config: ModelConfig,
  tokens: TokenArray,
  B: number,
  T: number,
): [Int32Array, Int32Array] {
  if (!Number.isInteger(B) || B <= 0 || !Number.isInteger(T) || T <= 0) {
    throw new RangeError(`Batch size and sequence length must be positive integers, got B=${B} T=${T}`);
  }
  if (T > config.n_positions) {
    throw new RangeError(`Sequence length ${T} exceeds n_positions ${config.n_positions}`);
  }
  if (tokens.length !== B * (T + 1)) {
    throw new RangeError(`Expected ${B * (T + 1)} tokens (B*(T+1)), got ${tokens.length}`);
  }
  const inputs = new Int32Array(B * T), targets = new Int32Array(B * T);
  for (let b = 0; b < B; b++) {
    for (let t = 0; t < T; t++) {
      inputs[b * T + t] = tokens[b * (T + 1) + t];
      targets[b * T + t] = tokens[b * (T + 1) + t + 1];
    }
  }
  for (const id of tokens) {
    if (!(id >= 0 && id < config.vocab_size)) {
      throw new RangeError(`Token id ${id} is outside the vocabulary [0, ${config.vocab_size})`);
    }
  }
  return [inputs, targets];
}

/** Forward pass and mean loss; `tokens` holds B windows of T+1 ids (targets are shifted by one). */
export function referenceForward(
  config: ModelConfig,
  params: Float64Array, // (totalSize) flat layout
  tokens: TokenArray, // (B, T+1)
  B: number,
  T: number,
  opts: Partial<ReferenceOptions> = {},
): ForwardResult {
  const o: ReferenceOptions = { ...DEFAULT_OPTIONS, ...opts };
  const [inputs, targets] = splitTokens(config, tokens, B, T);
  const C = config.n_embd, NH = config.n_head, V = config.vocab_size, Vp = config.padded_vocab_size;
  const BT = B * T, BTC = BT * C;
  const P = paramViews(config, params);
  const key = (site: number) => dropoutKey(o.seed, o.step, site);

  const emb = new Float64Array(BTC);
  encoder_forward(emb, inputs, P.wte, P.wpe, B, T, C);
  let resid = new Float64Array(BTC);
  dropout_forward(resid, emb, BTC, o.hiddenDropout, key(dropoutSite.embedding));

  const layers: LayerCache[] = [];
  const tmp = new Float64Array(BTC);
  for (let l = 0; l < config.n_layer; l++) {
    const w = P.layers[l];
    const ln1 = new Float64Array(BTC), ln1Mean = new Float64Array(BT), ln1Rstd = new Float64Array(BT);
    layernorm_forward(ln1, ln1Mean, ln1Rstd, resid, w.ln1w, w.ln1b, B, T, C);
    const qkv = new Float64Array(BT * 3 * C);
    matmul_forward(qkv, ln1, w.qkvw, w.qkvb, B, T, C, 3 * C);
    const att = new Float64Array(B * NH * T * T);
    const attDrop = o.attnDropout === 0 ? att : new Float64Array(B * NH * T * T);
    const atty = new Float64Array(BTC);
    attention_forward(atty, att, attDrop, qkv, B, T, C, NH, o.attnDropout, key(dropoutSite.attnProbs(l)));
    matmul_forward(tmp, atty, w.attprojw, w.attprojb, B, T, C, C);
    dropout_forward(tmp, tmp, BTC, o.hiddenDropout, key(dropoutSite.attnProj(l)));
    const resid2 = new Float64Array(BTC);
    for (let i = 0; i < BTC; i++) resid2[i] = resid[i] + tmp[i];
    const ln2 = new Float64Array(BTC), ln2Mean = new Float64Array(BT), ln2Rstd = new Float64Array(BT);
    layernorm_forward(ln2, ln2Mean, ln2Rstd, resid2, w.ln2w, w.ln2b, B, T, C);
    const fc = new Float64Array(BT * 4 * C), gelu = new Float64Array(BT * 4 * C);
    matmul_forward(fc, ln2, w.fcw, w.fcb, B, T, C, 4 * C);
    gelu_forward(gelu, fc, BT * 4 * C);
    matmul_forward(tmp, gelu, w.fcprojw, w.fcprojb, B, T, 4 * C, C);
    dropout_forward(tmp, tmp, BTC, o.hiddenDropout, key(dropoutSite.mlpProj(l)));
    const resid3 = new Float64Array(BTC);
    for (let i = 0; i < BTC; i++) resid3[i] = resid2[i] + tmp[i];
    layers.push({
      resid,
      ln1,
      ln1Mean,
      ln1Rstd,
      qkv,
      att,
      attDrop,
      atty,
      resid2,
      ln2,
      ln2Mean,
      ln2Rstd,
      fc,
      gelu,
    });
    resid = resid3;
  }

  const lnf = new Float64Array(BTC), lnfMean = new Float64Array(BT), lnfRstd = new Float64Array(BT);
  layernorm_forward(lnf, lnfMean, lnfRstd, resid, P.lnfw, P.lnfb, B, T, C);
  const logits = new Float64Array(BT * Vp);
  lmhead_forward(logits, lnf, P.wte, B, T, C, Vp);
  const losses = new Float64Array(BT);
  crossentropy_forward(losses, logits, targets, B, T, V, Vp);
  let loss = 0;
  const mask = o.lossMask;
  if (mask) {
    let count = 0;
    for (let i = 0; i < BT; i++) {
      loss += mask[i] ? losses[i] : 0;
      count += mask[i] ? 1 : 0;
    }
    loss = count > 0 ? loss / count : 0;
  } else {
    for (let i = 0; i < BT; i++) loss += losses[i];
    loss /= BT;
  }

  const cache: ForwardCache = {
    config,
    B,
    T,
    opts: o,
    inputs,
    targets,
    layers,
    residL: resid,
    lnf,
    lnfMean,
    lnfRstd,
    logits,
  };
  return { logits, loss, cache };
}

/** Gradient of the mean loss with respect to every parameter, as a fresh flat-layout buffer. */
export function referenceBackward(
  config: ModelConfig,
  params: Float64Array, // (totalSize) the same parameters the forward pass saw
  cache: ForwardCache,
): Float64Array {
  const { B, T, opts: o, inputs, targets } = cache;
  const C = config.n_embd, NH = config.n_head, V = config.vocab_size, Vp = config.padded_vocab_size;
  const BT = B * T, BTC = BT * C;
  const P = paramViews(config, params);
  const grads = new Float64Array(params.length);
  const G = paramViews(config, grads);
  const key = (site: number) => dropoutKey(o.seed, o.step, site);

  const dlogits = new Float64Array(BT * Vp);
  crossentropy_softmax_backward(dlogits, cache.logits, targets, 1 / BT, B, T, V, Vp);
  if (o.lossMask) {
    // d(masked mean)/d(loss at t) = mask[t] / count: rescale each row's 1/BT gradient.
    const mask = o.lossMask, count = mask.reduce((a, m) => a + (m ? 1 : 0), 0);
    for (let bt = 0; bt < BT; bt++) {
      const f = mask[bt] && count > 0 ? BT / count : 0;
      for (let v = 0; v < Vp; v++) dlogits[bt * Vp + v] *= f;
    }
  }
  const dlnf = new Float64Array(BTC);
  lmhead_backward(dlnf, G.wte, dlogits, cache.lnf, P.wte, B, T, C, V, Vp);
  // dresid: gradient flowing down the residual stream
  let dresid = new Float64Array(BTC);
  layernorm_backward(
    dresid,
    G.lnfw,
    G.lnfb,
    dlnf,
    cache.residL,
    P.lnfw,
    cache.lnfMean,
    cache.lnfRstd,
    B,
    T,
    C,
  );

  for (let l = config.n_layer - 1; l >= 0; l--) {
    const w = P.layers[l], g = G.layers[l], a = cache.layers[l];
    // resid3 = resid2 + dropout(gelu @ fcprojw + fcprojb)
    const dresid2 = dresid; // the residual passes the gradient through unchanged
    const dproj = new Float64Array(BTC);
    dropout_backward(dproj, dresid, BTC, o.hiddenDropout, key(dropoutSite.mlpProj(l)));
    const dgelu = new Float64Array(BT * 4 * C), dfc = new Float64Array(BT * 4 * C);
    matmul_backward(dgelu, g.fcprojw, g.fcprojb, dproj, a.gelu, w.fcprojw, B, T, 4 * C, C);
    gelu_backward(dfc, a.fc, dgelu, BT * 4 * C);
    const dln2 = new Float64Array(BTC);
    matmul_backward(dln2, g.fcw, g.fcb, dfc, a.ln2, w.fcw, B, T, C, 4 * C);
    layernorm_backward(dresid2, g.ln2w, g.ln2b, dln2, a.resid2, w.ln2w, a.ln2Mean, a.ln2Rstd, B, T, C);
    // resid2 = resid + dropout(atty @ attprojw + attprojb)
    const dattproj = new Float64Array(BTC);
    dropout_backward(dattproj, dresid2, BTC, o.hiddenDropout, key(dropoutSite.attnProj(l)));
    const datty = new Float64Array(BTC);
    matmul_backward(datty, g.attprojw, g.attprojb, dattproj, a.atty, w.attprojw, B, T, C, C);
    const dqkv = new Float64Array(BT * 3 * C);
    attention_backward(
      dqkv,
      datty,
      a.qkv,
      a.att,
      a.attDrop,
      B,
      T,
      C,
      NH,
      o.attnDropout,
      key(dropoutSite.attnProbs(l)),
    );
    const dln1 = new Float64Array(BTC);
    matmul_backward(dln1, g.qkvw, g.qkvb, dqkv, a.ln1, w.qkvw, B, T, C, 3 * C);
    const dresid1 = new Float64Array(dresid2);
    layernorm_backward(dresid1, g.ln1w, g.ln1b, dln1, a.resid, w.ln1w, a.ln1Mean, a.ln1Rstd, B, T, C);
    dresid = dresid1;
  }

  const demb = new Float64Array(BTC);
  dropout_backward(demb, dresid, BTC, o.hiddenDropout, key(dropoutSite.embedding));
  encoder_backward(G.wte, G.wpe, demb, inputs, B, T, C);
  return grads;
}

/** Forward and backward in one call. */
export function referenceLossAndGrads(
  config: ModelConfig,
  params: Float64Array, // (totalSize)
  tokens: TokenArray, // (B, T+1)
  B: number,
  T: number,
  opts: Partial<ReferenceOptions> = {},
): { loss: number; logits: Float64Array; grads: Float64Array } {
  const { loss, logits, cache } = referenceForward(config, params, tokens, B, T, opts);
  return { loss, logits, grads: referenceBackward(config, params, cache) };
}

// ----------------------------------------------------------------------------------------------
// Optimiser and initialisation

/**
 * One AdamW step in place on params, m and v (and grads, when clipped). `step` is 0-based; bias
 * correction uses t = step + 1. Returns the global gradient norm measured before clipping.
 */
export function referenceAdamWStep(
  config: ModelConfig,
  params: Float64Array, // (totalSize)
  grads: Float64Array, // (totalSize), scaled in place by the clip coefficient
  m: Float64Array, // (totalSize) first moment
  v: Float64Array, // (totalSize) second moment
  step: number,
  lr: number,
  adamw: AdamWConfig,
): { gradNorm: number } {
  const layout = paramLayout(config);
  for (const [name, a] of [["params", params], ["grads", grads], ["m", m], ["v", v]] as const) {
    if (a.length !== layout.totalSize) {
      throw new RangeError(`AdamW ${name} has ${a.length} floats, the layout needs ${layout.totalSize}`);
    }
  }
  let sumSq = 0;
  for (let i = 0; i < grads.length; i++) sumSq += grads[i] * grads[i];
  const gradNorm = Math.sqrt(sumSq);
  if (adamw.clip_grad > 0) {
    const clipCoef = adamw.clip_grad / (gradNorm + 1e-6);
    if (clipCoef < 1) { for (let i = 0; i < grads.length; i++) grads[i] *= clipCoef; }
  }
  const t = step + 1;
  const { beta1: b1, beta2: b2, eps } = adamw;
  const c1 = 1 - b1 ** t, c2 = 1 - b2 ** t;
  for (const spec of layout.tensors) {
    const wd = spec.decay ? adamw.weight_decay : 0;
    for (let i = spec.offset; i < spec.offset + spec.size; i++) {
      const g = grads[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const mhat = m[i] / c1, vhat = v[i] / c2;
      params[i] -= lr * (mhat / (Math.sqrt(vhat) + eps) + wd * params[i]);
    }
  }
  return { gradNorm };
}

/** Greedy continuation of `prompt` by `n` tokens (argmax over the real vocabulary, full forward each step). */
export function referenceGreedy(
  config: ModelConfig,
  params: Float64Array,
  prompt: number[],
  n: number,
): number[] {
  const seq = [...prompt];
  for (let i = 0; i < n; i++) {
    const T = seq.length;
    const { logits } = referenceForward(config, params, Int32Array.from([...seq, 0]), 1, T);
    const row = logits.subarray((T - 1) * config.padded_vocab_size, T * config.padded_vocab_size);
    let best = 0;
    for (let v = 1; v < config.vocab_size; v++) if (row[v] > row[best]) best = v;
    seq.push(best);
  }
  return seq.slice(prompt.length);
}

export { fillNormal, initParams, normalZiggurat } from "../../model/init.ts";
