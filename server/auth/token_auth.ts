/**
 * Who a request is: checks a presented bearer token against the bootstrap token(s)
 * (GPT2_API_TOKEN, an admin with no user) and the users' tokens in the job store, in constant
 * time. The store's tokens are held in memory by id and reloaded every `refreshMs` (one
 * heartbeat), so a check costs a hash and a comparison, never a database call, and a token
 * revoked on any host stops working here within one reload (at once when revoked here); one made
 * on another host works here at once (an unknown id reloads, at most every 250 ms). When a
 * token was last used is kept in memory and written at the next reload, not per request, and its
 * requests per route class become one "token.use" audit event a minute.
 */

import { Buffer } from "node:buffer";
import { createHash, timingSafeEqual } from "node:crypto";
import type { JobStore, TokenRecord } from "../jobs/job_store.ts";
import { hashToken, mintToken, type Scope, SCOPES, tokenIdOf } from "./tokens.ts";

/** The caller of a request. */
export interface Principal {
  /** The user; null for the bootstrap token or a server with no token configured (an admin). */
  user: string | null;
  /** The token's public id; null for the bootstrap token or none. */
  tokenId: string | null;
  scopes: ReadonlySet<Scope>;
  /** Holds the admin scope: sees and may do everything. */
  admin: boolean;
}

/** Every request of a server with no token configured (loopback only), and the bootstrap token's. */
export const LOCAL_ADMIN: Principal = Object.freeze({
  user: null,
  tokenId: null,
  scopes: new Set<Scope>(SCOPES),
  admin: true,
});

/** A token as lists show it: everything but its hash. */
export type TokenView = Omit<TokenRecord, "hash">;

/** Why a presented token was refused. */
export type Refusal = "invalid" | "revoked" | "expired";

interface Cached {
  record: TokenRecord;
  hash: Buffer;
  principal: Principal;
}

/** Least time between reloads caused by tokens of unknown ids (ms). */
const MISS_RELOAD_MS = 250;

const sha = (s: string) => createHash("sha256").update(s).digest();
/** Compared against when a token names no known id, so a miss costs what a hit does. */
const DUMMY = sha("no such token");

/** Checks tokens; creates, lists and revokes users' tokens. */
export class TokenAuth {
  #store: JobStore;
  #bootstrap: Buffer[];
  #byId = new Map<string, Cached>();
  #used = new Map<string, string>();
  /** Users' tokens in the store, revoked and expired ones included. */
  #made = 0;
  /** Whether the tokens were ever read: until then every request needs a token (never open by failure). */
  #loaded = false;
  #timer: ReturnType<typeof setInterval> | null = null;
  #refreshMs: number;
  #now: () => number;
  #onError: (e: Error) => void;
  /** Requests per token and route class since the last "token.use" audit events. */
  #uses = new Map<string, { user: string | null; classes: Map<string, number> }>();
  #usesSince: number;
  #useAuditMs: number;
  /** Since a reload failed (logged once), null while reloads succeed. */
  #failing: string | null = null;
  /** When a token of an id not held here last made the tokens reload (performance.now() ms). */
  #missReload = -Infinity;

  constructor(
    store: JobStore,
    opts: {
      /** GPT2_API_TOKEN (any one of several): an admin with no user. */
      bootstrap?: readonly string[];
      /** Between reloads of the store's tokens (default 1000 ms; a host's heartbeat in a cluster). */
      refreshMs?: number;
      now?: () => number;
      /** A reload failed (the store is away): the tokens last read stay in force. */
      onError?: (e: Error) => void;
      /** How often each token's requests per route class become a "token.use" audit event (default 60 s). */
      useAuditMs?: number;
    } = {},
  ) {
    this.#store = store;
    this.#bootstrap = (opts.bootstrap ?? []).filter((t) => t !== "").map(sha);
    this.#refreshMs = opts.refreshMs ?? 1000;
    this.#now = opts.now ?? Date.now;
    this.#useAuditMs = opts.useAuditMs ?? 60_000;
    this.#usesSince = this.#now();
    this.#onError = opts.onError ??
      ((e) =>
        console.error(
          `Cannot reload the API tokens: ${e.message}; the tokens last read stay in force until it can`,
        ));
    try {
      this.refresh();
    } catch (e) {
      this.#onError(e as Error);
    }
  }

  /**
   * Whether requests need a token: one is configured (GPT2_API_TOKEN), any user token was ever
   * made (revoking the last one does not open the server again), or the tokens could not be read yet.
   */
  get required(): boolean {
    return this.#bootstrap.length > 0 || this.#made > 0 || !this.#loaded;
  }

  /** Starts reloading every `refreshMs`. */
  start(): this {
    this.#timer ??= setInterval(() => {
      try {
        this.refresh();
        if (this.#failing !== null) console.log(`API tokens reloaded again (failing since ${this.#failing})`);
        this.#failing = null;
      } catch (e) {
        // Once per outage, not once per heartbeat.
        if (this.#failing === null) this.#onError(e as Error);
        this.#failing ??= new Date(this.#now()).toISOString();
      }
    }, this.#refreshMs);
    return this;
  }

  /** Stops reloading and writes the pending last-used times and use counts. */
  stop(): void {
    if (this.#timer !== null) clearInterval(this.#timer);
    this.#timer = null;
    try {
      this.#flush(true);
    } catch { /* the store is away or closed: those times are lost, nothing else */ }
  }

  /** Counts a request of `p`'s token to a route of class `cls` (the "token.use" audit events). */
  noteUse(p: Principal, cls: string): void {
    if (p.tokenId === null) return;
    let u = this.#uses.get(p.tokenId);
    if (!u) this.#uses.set(p.tokenId, u = { user: p.user, classes: new Map() });
    u.classes.set(cls, (u.classes.get(cls) ?? 0) + 1);
  }

  /** Writes the pending last-used times and reloads every token from the store. */
  refresh(): void {
    this.#flush();
    const next = new Map<string, Cached>();
    for (const record of this.#store.tokens()) {
      next.set(record.id, {
        record,
        hash: Buffer.from(record.hash, "hex"),
        principal: Object.freeze({
          user: record.user,
          tokenId: record.id,
          scopes: new Set(record.scopes as Scope[]),
          admin: record.scopes.includes("admin"),
        }),
      });
    }
    this.#byId = next;
    this.#made = next.size;
    this.#loaded = true;
  }

  #flush(all = false): void {
    if (this.#used.size > 0) {
      const uses = [...this.#used].map(([id, at]) => ({ id, at }));
      this.#used.clear();
      this.#store.touchTokens(uses);
    }
    const now = this.#now();
    if (this.#uses.size === 0 || (!all && now - this.#usesSince < this.#useAuditMs)) return;
    const since = new Date(this.#usesSince).toISOString();
    const uses = [...this.#uses];
    this.#uses.clear();
    this.#usesSince = now;
    for (const [id, u] of uses) {
      this.#store.addAudit({
        user: u.user,
        action: "token.use",
        target: id,
        detail: { since, requests: Object.fromEntries(u.classes) },
      });
    }
  }

  /**
   * The principal of `presented`, or why it is refused. Every bootstrap token is compared, and a
   * user token's hash is compared with the stored one (its id only picks which), each in constant
   * time; an unknown id is compared against a dummy, so the time does not tell ids apart.
   */
  check(presented: string): Principal | Refusal {
    const digest = sha(presented);
    let bootstrap = false;
    for (const b of this.#bootstrap) if (timingSafeEqual(digest, b)) bootstrap = true;
    if (bootstrap) return LOCAL_ADMIN;
    const id = tokenIdOf(presented);
    let hit = id === null ? undefined : this.#byId.get(id);
    if (id !== null && !hit && this.#reloadOnMiss()) hit = this.#byId.get(id);
    const same = timingSafeEqual(digest, hit?.hash ?? DUMMY);
    if (!hit || !same) return "invalid";
    if (hit.record.revoked_at !== null) return "revoked";
    const now = this.#now();
    if (hit.record.expires_at !== null && Date.parse(hit.record.expires_at) <= now) return "expired";
    this.#used.set(hit.record.id, new Date(now).toISOString());
    return hit.principal;
  }

  /**
   * A token of the right form whose id is not held here may have been made on another host since
   * the last reload: reload now, at most once per {@link MISS_RELOAD_MS} (wrong tokens are limited
   * per address besides, server/routes/auth.ts). Returns whether it reloaded.
   */
  #reloadOnMiss(): boolean {
    const now = performance.now();
    if (now - this.#missReload < MISS_RELOAD_MS) return false;
    this.#missReload = now;
    try {
      this.refresh();
      return true;
    } catch (e) {
      this.#onError(e as Error);
      return false;
    }
  }

  /** Makes a token for `user` (made if new); returns the token, shown only now, and its record. */
  create(opts: { user: string; name?: string; scopes: Scope[]; expiresAt?: string | null }): {
    token: string;
    record: TokenView;
  } {
    const { token, id, hash } = mintToken();
    this.#store.putUser(opts.user);
    const record: TokenRecord = {
      id,
      hash,
      name: opts.name ?? "",
      user: opts.user,
      scopes: [...opts.scopes],
      created_at: new Date(this.#now()).toISOString(),
      expires_at: opts.expiresAt ?? null,
      last_used_at: null,
      revoked_at: null,
    };
    this.#store.createToken(record);
    this.refresh();
    return { token, record: view(record) };
  }

  /** Every token (revoked and expired ones too), without hashes; only `user`'s when given. */
  list(user?: string): TokenView[] {
    return this.#store.tokens().filter((t) => user === undefined || t.user === user).map(view);
  }

  /** Revokes token `id` here at once and, through the store, on every host within a reload. */
  revoke(id: string): boolean {
    const done = this.#store.revokeToken(id, new Date(this.#now()).toISOString());
    this.refresh();
    return done;
  }

  /** The hash a presented token is kept under (for tests and the CLI). */
  static hash(token: string): string {
    return hashToken(token);
  }
}

function view(t: TokenRecord): TokenView {
  const { hash: _, ...rest } = t;
  return rest;
}
