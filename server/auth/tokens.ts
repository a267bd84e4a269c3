/**
 * What a user token is, apart from where it is kept: its scopes, its form, minting one, its hash,
 * and reading the command line's and the API's words for them (`read,train`, `30d`). A token is
 * `gpt2_<id>_<secret>`: the id (12 hex digits) is public (lists and revocations name it as
 * `tok_<id>`), the secret is 32 random bytes; the store keeps the SHA-256 of the whole token and
 * never the token, which is shown once, when it is made.
 */

import { createHash } from "node:crypto";

/** What a token may do; `train` includes evaluation and datasets, `admin` everything. */
export const SCOPES = ["read", "train", "generate", "admin"] as const;
export type Scope = typeof SCOPES[number];

/** A user name: letters, digits, `.`, `_`, `-`, starting with a letter or digit (64 at most). */
export const USER_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

/** The form of a user token (the id is group 1). */
export const TOKEN_FORM = /^gpt2_([0-9a-f]{12})_[0-9a-f]{64}$/;

/** Public id of a token: `tok_<id>`. */
export const TOKEN_ID = /^tok_[0-9a-f]{12}$/;

/** SHA-256 of a token, hex: what the store keeps. */
export function hashToken(token: string): string {
  return createHash("sha256").update(token).digest("hex");
}

/** A new token: the token itself (shown once), its public id and its hash. */
export function mintToken(): { token: string; id: string; hash: string } {
  const hex = (n: number) =>
    Array.from(crypto.getRandomValues(new Uint8Array(n)), (b) => b.toString(16).padStart(2, "0")).join("");
  const short = hex(6);
  const token = `gpt2_${short}_${hex(32)}`;
  return { token, id: `tok_${short}`, hash: hashToken(token) };
}

/** The public id of a token of {@link TOKEN_FORM}, or null for any other string. */
export function tokenIdOf(token: string): string | null {
  const m = TOKEN_FORM.exec(token);
  return m ? `tok_${m[1]}` : null;
}

/** Scopes from `read,train` (or a list); throws naming an unknown one. */
export function parseScopes(value: string | readonly string[]): Scope[] {
  const words = (typeof value === "string" ? value.split(",") : [...value]).map((s) => s.trim()).filter(
    Boolean,
  );
  if (words.length === 0) throw new Error(`No scopes given: expected some of ${SCOPES.join(", ")}`);
  for (const w of words) {
    if (!(SCOPES as readonly string[]).includes(w)) {
      throw new Error(`Unknown scope "${w.slice(0, 40)}": expected some of ${SCOPES.join(", ")}`);
    }
  }
  return SCOPES.filter((s) => words.includes(s));
}

const UNITS: Record<string, number> = { m: 60_000, h: 3_600_000, d: 86_400_000 };

/** When a token given `--expires 30d` (or `12h`, `90m`, or an ISO time) expires, as an ISO time. */
export function parseExpiry(value: string, nowMs = Date.now()): string {
  const m = /^(\d{1,6})([mhd])$/.exec(value.trim());
  if (m) {
    const ms = Number(m[1]) * UNITS[m[2]];
    if (ms <= 0) throw new Error(`Invalid expiry "${value}": expected a positive duration`);
    return new Date(nowMs + ms).toISOString();
  }
  const at = Date.parse(value);
  if (!/^\d{4}-\d{2}-\d{2}/.test(value) || Number.isNaN(at)) {
    throw new Error(
      `Invalid expiry "${
        value.slice(0, 40)
      }": expected a duration such as "30d", "12h" or "90m", or an ISO time`,
    );
  }
  if (at <= nowMs) throw new Error(`Invalid expiry "${value}": it is in the past`);
  return new Date(at).toISOString();
}
