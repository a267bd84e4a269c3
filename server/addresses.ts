/**
 * IP addresses and ranges for GPT2_TRUSTED_PROXIES, and the client that a chain of trusted
 * proxies reports. Addresses are compared as 16 bytes, IPv4 as IPv4-mapped IPv6
 * (::ffff:a.b.c.d), so a dual-stack socket's "::ffff:10.0.0.1" is inside "10.0.0.0/8".
 * The client is the right-most hop of `X-Forwarded-For` (or, without it, of RFC 7239
 * `Forwarded: for=`) that is not itself a trusted proxy, as nginx's `real_ip_recursive` takes it:
 * a client can write anything to the left of what its first proxy appends, never to the right.
 */

import { parseIpv4, parseIpv6 } from "../data/ip.ts";

/** An address as 16 bytes (IPv4 mapped into IPv6). */
export type Address = Uint8Array;

/** An address range: the addresses sharing the first `bits` bits of `bytes`. */
export interface AddressRange {
  bytes: Address;
  /** Prefix length over all 128 bits (an IPv4 /8 is 104). */
  bits: number;
}

/** The 16 bytes of an IPv4 or IPv6 address (brackets and a zone such as `%eth0` allowed), or null. */
export function parseAddress(text: string): Address | null {
  const bare = text.trim().replace(/^\[(.*)\]$/, "$1").replace(/%[^%]*$/, "");
  const out = new Uint8Array(16);
  const v4 = parseIpv4(bare);
  if (v4) {
    out.set([0xff, 0xff, ...v4], 10);
    return out;
  }
  const g = parseIpv6(bare);
  if (!g) return null;
  g.forEach((x, i) => out.set([x >> 8, x & 255], 2 * i));
  return out;
}

/** An address as text: dotted for IPv4 (mapped ones included), else eight hex groups. */
export function formatAddress(a: Address): string {
  if (a.subarray(0, 10).every((x) => x === 0) && a[10] === 0xff && a[11] === 0xff) {
    return a.subarray(12).join(".");
  }
  return Array.from({ length: 8 }, (_, i) => ((a[2 * i] << 8) | a[2 * i + 1]).toString(16)).join(":");
}

/** `10.0.0.0/8`, `fd00::/8` or a single address (all its bits); null when it is neither. */
export function parseRange(entry: string): AddressRange | null {
  const m = /^([^/]+?)(?:\/(\d{1,3}))?$/.exec(entry.trim());
  if (!m) return null;
  const bytes = parseAddress(m[1]);
  if (!bytes) return null;
  const v4 = parseIpv4(m[1].trim()) !== null;
  const bits = m[2] === undefined ? 128 : Number(m[2]) + (v4 ? 96 : 0);
  return bits <= 128 && (!v4 || bits >= 96) ? { bytes, bits } : null;
}

function inRange(a: Address, r: AddressRange): boolean {
  const whole = r.bits >> 3, rest = r.bits & 7;
  for (let i = 0; i < whole; i++) if (a[i] !== r.bytes[i]) return false;
  if (rest === 0) return true;
  const mask = (0xff << (8 - rest)) & 0xff;
  return (a[whole] & mask) === (r.bytes[whole] & mask);
}

/** A set of address ranges, such as the trusted proxies. */
export class AddressRanges {
  readonly #ranges: AddressRange[];

  /** Throws RangeError naming the first entry that is not an address or CIDR range. */
  constructor(entries: readonly string[]) {
    this.#ranges = entries.map((e) => {
      const r = parseRange(e);
      if (!r) {
        throw new RangeError(
          `Invalid address range "${e}": expected an IP address or a CIDR range such as "10.0.0.0/8" or "fd00::/8"`,
        );
      }
      return r;
    });
  }

  /** How many ranges there are. */
  get size(): number {
    return this.#ranges.length;
  }

  /** Whether `a` is inside one of the ranges. */
  has(a: Address): boolean {
    return this.#ranges.some((r) => inRange(a, r));
  }
}

/** One hop as a proxy writes it: an address, `1.2.3.4:80`, `[::1]:80`, quoted or not; null otherwise. */
function hop(text: string): Address | null {
  const s = text.trim().replace(/^"(.*)"$/, "$1");
  const bracketed = /^\[([^\]]+)\](?::\d+)?$/.exec(s);
  if (bracketed) return parseAddress(bracketed[1]);
  const v4port = /^(\d+\.\d+\.\d+\.\d+):\d+$/.exec(s);
  return parseAddress(v4port ? v4port[1] : s);
}

/** The hops of an `X-Forwarded-For` value, left to right; one that is not an address is null. */
export function xForwardedFor(value: string): (Address | null)[] {
  return value.split(",").filter((s) => s.trim() !== "").map(hop);
}

/**
 * The `for=` hops of an RFC 7239 `Forwarded` value, left to right; an element without one, or
 * with `unknown` or an obfuscated name (`_hidden`), is null. Commas and semicolons inside quoted
 * strings do not split.
 */
export function forwardedFor(value: string): (Address | null)[] {
  const elements: string[][] = [[]];
  let pair = "", quoted = false;
  for (let i = 0; i < value.length; i++) {
    const ch = value[i];
    if (quoted && ch === "\\") {
      pair += ch + (value[++i] ?? "");
    } else if (!quoted && (ch === ";" || ch === ",")) {
      elements[elements.length - 1].push(pair);
      pair = "";
      if (ch === ",") elements.push([]);
    } else {
      if (ch === '"') quoted = !quoted;
      pair += ch;
    }
  }
  elements[elements.length - 1].push(pair);
  return elements
    .filter((pairs) => pairs.some((p) => p.trim() !== ""))
    .map((pairs) => {
      const f = pairs.map((p) => p.trim()).find((p) => /^for=/i.test(p));
      return f === undefined ? null : hop(f.slice(4).replace(/\\(.)/g, "$1"));
    });
}

/**
 * The client behind `peer`. Unless `peer` is a trusted proxy, `peer` itself. Otherwise the hops
 * are read from the right: the first that is not a trusted proxy is the client; one that cannot
 * be read stops the walk at the trusted proxy that reported it; when every hop is trusted, the
 * left-most.
 */
export function forwardedClient(
  peer: Address,
  hops: readonly (Address | null)[],
  trusted: AddressRanges,
): Address {
  let client = peer;
  if (!trusted.has(peer)) return peer;
  for (let i = hops.length - 1; i >= 0; i--) {
    const h = hops[i];
    if (h === null) return client;
    client = h;
    if (!trusted.has(h)) return h;
  }
  return client;
}
