/**
 * Small deterministic fixtures for the data pipeline tests: distinct pseudo-English documents
 * from a seeded generator, near-duplicate variants, and a temporary data root.
 */

const WORDS = (
  "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they " +
  "you were her she there been one all we their has would when if so no what up out more said about into than them " +
  "can only other time new some could these two may first then do any like my now over such our man me even most " +
  "made after also did many off before must well back through years much where your way down should because each " +
  "just those people how too little state good very make world still own see men work long get here between both life " +
  "being under never day same another know while last might us great old year come since against go came right used " +
  "take three nation congress government law power public war peace treaty commerce trade revenue citizens union"
).split(" ");

/** splitmix32 PRNG in [0, 1). */
export function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x9e3779b9) >>> 0;
    let z = Math.imul(s ^ (s >>> 16), 0x85ebca6b);
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
    return ((z ^ (z >>> 16)) >>> 0) / 4294967296;
  };
}

/** `count` distinct documents of about `words` words each. */
export function makeDocs(count: number, words = 120, seed = 1): string[] {
  const rand = rng(seed);
  return Array.from({ length: count }, () => {
    const out: string[] = [];
    for (let i = 0; i < words; i++) {
      let w = WORDS[Math.floor(rand() * WORDS.length)];
      if (i % 12 === 0) w = w[0].toUpperCase() + w.slice(1);
      out.push(i % 12 === 11 ? w + "." : w);
    }
    return out.join(" ");
  });
}

/** A near-duplicate of `text`: every `every`-th word replaced. */
export function nearDuplicate(text: string, every = 40): string {
  return text.split(" ").map((w, i) => (i % every === every - 1 ? "changed" : w)).join(" ");
}

/** Run `fn` with a fresh temporary data root, removed afterwards. */
export async function withRoot<T>(fn: (root: string) => Promise<T>): Promise<T> {
  const root = await Deno.makeTempDir({ prefix: "gpt2-data-test-" });
  try {
    return await fn(root);
  } finally {
    await Deno.remove(root, { recursive: true });
  }
}
