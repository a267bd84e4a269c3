/**
 * GPT-2 parameter initialisation (as in GPT-2 and Megatron): 2-D weights ~ N(0, 0.02), the two
 * residual output projections ~ N(0, 0.02/sqrt(2 n_layer)), biases 0, LayerNorm weights 1, padded
 * vocabulary rows 0. Deterministic from the seed, drawn tensor by tensor in layout order with a
 * ziggurat sampler fed by the shared counter-based generator.
 */

import { type ModelConfig, paramLayout } from "./config.ts";
import { pcg, Rng } from "./rng.ts";

// Ziggurat tables (Marsaglia & Tsang 2000, 128 layers) for fast standard-normal draws: Box–Muller
// costs a log, a sqrt, a sin and a cos per pair, which alone takes ~12 s for 354M parameters.
const ZIG_R = 3.442619855899;
const ZIG_SCALE = 16777216; // 2^24: draws use a signed 25-bit integer, the low 7 bits pick the layer
const zigK = new Float64Array(128), zigW = new Float64Array(128), zigF = new Float64Array(128);
{
  const vn = 9.91256303526217e-3;
  let dn = ZIG_R, tn = dn;
  const q = vn / Math.exp(-0.5 * dn * dn);
  zigK[0] = (dn / q) * ZIG_SCALE;
  zigK[1] = 0;
  zigW[0] = q / ZIG_SCALE;
  zigW[127] = dn / ZIG_SCALE;
  zigF[0] = 1;
  zigF[127] = Math.exp(-0.5 * dn * dn);
  for (let i = 126; i >= 1; i--) {
    dn = Math.sqrt(-2 * Math.log(vn / dn + Math.exp(-0.5 * dn * dn)));
    zigK[i + 1] = (dn / tn) * ZIG_SCALE;
    tn = dn;
    zigF[i] = Math.exp(-0.5 * dn * dn);
    zigW[i] = dn / ZIG_SCALE;
  }
}

/** A standard normal draw from `rng` by the ziggurat method (one u32 per draw ~98.8% of the time). */
export function normalZiggurat(rng: Rng): number {
  const out = new Float64Array(1);
  fillNormal(out, rng, 1);
  return out[0];
}

// Result of zigSlow (kept out of closures: a captured generator state makes the hot loop ~10x slower).
const zigSlowValue = new Float64Array(1);

/** The rare ziggurat paths (tail and wedges). Returns the new state; the draw (NaN: retry) goes to zigSlowValue. */
function zigSlow(state: number, iz: number, j: number, x: number): number {
  const uniform = () => {
    state = (state + 0x9e3779b9) >>> 0;
    return (pcg(state) + 0.5) / 4294967296;
  };
  if (iz === 0) {
    let tx: number, ty: number;
    do {
      tx = -Math.log(uniform()) / ZIG_R;
      ty = -Math.log(uniform());
    } while (ty + ty < tx * tx);
    zigSlowValue[0] = j > 0 ? ZIG_R + tx : -ZIG_R - tx;
  } else {
    zigSlowValue[0] = zigF[iz] + uniform() * (zigF[iz - 1] - zigF[iz]) < Math.exp(-0.5 * x * x) ? x : NaN;
  }
  return state;
}

/**
 * Fills `dst` with N(0, std²) ziggurat draws from `rng`. The generator's state is stepped locally
 * (exactly as {@link Rng.nextU32} does) and written back, so the draws equal those of repeated
 * {@link normalZiggurat} calls while the hot loop stays free of calls through the class.
 */
export function fillNormal(dst: Float32Array | Float64Array, rng: Rng, std: number): void {
  // in chunks, so V8 optimises zigFill as a whole function (its OSR code runs ~3x slower)
  let state = rng.state;
  for (let i = 0; i < dst.length; i += 65536) state = zigFill(dst.subarray(i, i + 65536), state, std);
  rng.state = state;
}

// The hot loop, kept free of property accesses: V8 otherwise deoptimises its OSR code on the way out.
function zigFill(dst: Float32Array | Float64Array, state: number, std: number): number {
  for (let i = 0; i < dst.length; i++) {
    let x: number;
    for (;;) {
      state = (state + 0x9e3779b9) >>> 0; // Rng.nextU32
      const u = pcg(state);
      const iz = u & 127, j = (u | 0) >> 7; // j: signed 25-bit integer in [-2^24, 2^24)
      x = j * zigW[iz];
      if (Math.abs(j) < zigK[iz]) break; // inside the layer's rectangle: the common case
      state = zigSlow(state, iz, j, x);
      x = zigSlowValue[0];
      if (x === x) break;
    }
    dst[i] = x * std;
  }
  return state;
}

/**
 * GPT-2 initialisation, deterministic in `seed`: 2-D weights ~ N(0, 0.02) except the two residual
 * output projections (attn.c_proj, mlp.c_proj) ~ N(0, 0.02 / sqrt(2 n_layer)); biases 0;
 * LayerNorm weights 1; padded wte rows 0. Normals come from one {@link Rng} (ziggurat draws,
 * {@link normalZiggurat}) tensor by tensor in layout order.
 */
export function initParams(config: ModelConfig, seed: number): Float32Array {
  const layout = paramLayout(config);
  const out = new Float32Array(layout.totalSize);
  const rng = new Rng(seed);
  const residStd = 0.02 / Math.sqrt(2 * config.n_layer);
  for (const t of layout.tensors) {
    if (t.shape.length === 2) {
      const std = /\.c_proj\.weight$/.test(t.name) ? residStd : 0.02;
      // only the real vocabulary rows of wte are drawn; padded rows stay 0
      const n = t.name === "wte.weight" ? config.vocab_size * config.n_embd : t.size;
      fillNormal(out.subarray(t.offset, t.offset + n), rng, std);
    } else if (/ln_\w+\.weight$/.test(t.name)) {
      out.fill(1, t.offset, t.offset + t.size);
    }
  }
  return out;
}
