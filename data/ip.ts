/**
 * IP address text, parsed once for the whole service: the data pipeline's public-address (SSRF)
 * checks (data/urls.ts) and the HTTP process's client addresses and trusted proxies
 * (server/addresses.ts) both read addresses here. It lives under data/ because server/ may import
 * data/ but not the other way round, and it imports nothing, so loading it loads no pipeline code.
 * Brackets, a zone (`%eth0`), a port or surrounding space are the callers' to strip.
 */

/** The 4 bytes of a dotted-decimal IPv4 address (`192.0.2.1`), or null. */
export function parseIpv4(text: string): number[] | null {
  const parts = text.split(".");
  if (parts.length !== 4 || parts.some((p) => !/^\d{1,3}$/.test(p) || Number(p) > 255)) return null;
  return parts.map(Number);
}

/**
 * The 8 16-bit groups of an IPv6 address in RFC 4291 §2.2 text form, or null if `text` is not one.
 * Hex digits in either case, 1 to 4 of them a group; the last 32 bits may be written as a dotted
 * IPv4 address (`::ffff:192.0.2.1`). `::` stands for one or more zero groups (RFC 4291 §2.2,
 * RFC 5952 §4.2.2), so it appears at most once, and with it at most 7 groups are written.
 */
export function parseIpv6(text: string): number[] | null {
  let s = text.toLowerCase();
  const dotted = /(?:^|:)(\d+\.\d+\.\d+\.\d+)$/.exec(s);
  if (dotted) {
    const b = parseIpv4(dotted[1]);
    if (!b) return null;
    s = s.slice(0, s.length - dotted[1].length) +
      `${((b[0] << 8) | b[1]).toString(16)}:${((b[2] << 8) | b[3]).toString(16)}`;
  }
  const halves = s.split("::");
  if (halves.length > 2) return null;
  const part = (h: string) => (h === "" ? [] : h.split(":"));
  const head = part(halves[0]), tail = halves.length === 2 ? part(halves[1]) : [];
  const fill = 8 - head.length - tail.length;
  if (halves.length === 1 ? fill !== 0 : fill < 1) return null;
  const groups = [...head, ...Array<string>(fill).fill("0"), ...tail];
  if (groups.some((g) => !/^[0-9a-f]{1,4}$/.test(g))) return null;
  return groups.map((g) => parseInt(g, 16));
}
