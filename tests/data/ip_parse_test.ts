/**
 * The one IP parser (data/ip.ts), case by case, and its two users agreeing on it: the data
 * pipeline's public-address check (nonPublicRange) and the server's client addresses
 * (parseAddress). Issue 39: the two once held copies that differed on `::` with 8 written groups.
 */

import assert from "node:assert/strict";
import { parseIpv4, parseIpv6 } from "../../data/ip.ts";
import { nonPublicRange } from "../../data/urls.ts";
import { formatAddress, parseAddress } from "../../server/addresses.ts";

/** Input, and the 8 groups (hex) it parses to, or null when it is not an IPv6 address. */
const IPV6: [string, string | null][] = [
  // `::` stands for one or more zero groups.
  ["::", "0:0:0:0:0:0:0:0"],
  ["::1", "0:0:0:0:0:0:0:1"],
  ["1::", "1:0:0:0:0:0:0:0"],
  ["1::8", "1:0:0:0:0:0:0:8"],
  ["1:2:3:4:5:6:7::", "1:2:3:4:5:6:7:0"],
  ["::2:3:4:5:6:7:8", "0:2:3:4:5:6:7:8"],
  ["1:2:3::6:7:8", "1:2:3:0:0:6:7:8"],
  ["1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7:8"],
  // `::` with 8 written groups stands for none: invalid (RFC 4291 §2.2, RFC 5952 §4.2.2).
  ["1:2:3:4:5:6:7:8::", null],
  ["::1:2:3:4:5:6:7:8", null],
  ["1:2:3:4::5:6:7:8", null],
  // `::` at most once; no stray colons.
  ["1::2::3", null],
  ["::1::", null],
  [":::", null],
  [":::1", null],
  ["1:::2", null],
  [":1::", null],
  ["1::2:", null],
  [":1:2:3:4:5:6:7:8", null],
  ["1:2:3:4:5:6:7:8:", null],
  // Too few or too many groups without `::`.
  ["1:2:3:4:5:6:7", null],
  ["1:2:3:4:5:6:7:8:9", null],
  // IPv4 in the last 32 bits.
  ["::ffff:192.0.2.1", "0:0:0:0:0:ffff:c000:201"],
  ["::ffff:c000:201", "0:0:0:0:0:ffff:c000:201"],
  ["::FFFF:192.0.2.1", "0:0:0:0:0:ffff:c000:201"],
  ["64:ff9b::10.0.0.1", "64:ff9b:0:0:0:0:a00:1"],
  ["::1.2.3.4", "0:0:0:0:0:0:102:304"],
  ["1:2:3:4:5:6:1.2.3.4", "1:2:3:4:5:6:102:304"],
  ["1:2:3:4:5:6:7:1.2.3.4", null],
  ["::ffff:1.2.3.256", null],
  ["::ffff:1.2.3", null],
  ["::ffff:1.2.3.4.5", null],
  ["1.2.3.4::", null],
  // The dotted part must be a whole group: `a1.2.3.4` is not `a` followed by 1.2.3.4.
  ["::a1.2.3.4", null],
  ["::ffff1.2.3.4", null],
  // A dotted IPv4 address alone is not IPv6 text (parseIpv4 reads it).
  ["1.2.3.4", null],
  // Case, leading zeros, group length.
  ["FE80::ABCD", "fe80:0:0:0:0:0:0:abcd"],
  ["2001:DB8::Cafe", "2001:db8:0:0:0:0:0:cafe"],
  ["0001:0db8:0000::0001", "1:db8:0:0:0:0:0:1"],
  ["0000::", "0:0:0:0:0:0:0:0"],
  ["12345::", null],
  ["::00001", null],
  // Zones, brackets and space are the callers' to strip.
  ["fe80::1%eth0", null],
  ["[::1]", null],
  [" ::1", null],
  ["::1 ", null],
  // Garbage.
  ["", null],
  [":", null],
  ["hello", null],
  ["g::", null],
  ["::-1", null],
  ["::+1", null],
  ["::0x1", null],
  ["1:2:3:4:5:6:7:8/64", null],
];

const groups = (g: number[] | null) => g && g.map((x) => x.toString(16)).join(":");

Deno.test("parseIpv6() reads RFC 4291 text into 8 groups, `::` standing for at least one", () => {
  for (const [input, want] of IPV6) assert.equal(groups(parseIpv6(input)), want, JSON.stringify(input));
});

Deno.test("parseIpv4() reads dotted decimal into 4 bytes", () => {
  const cases: [string, number[] | null][] = [
    ["192.0.2.1", [192, 0, 2, 1]],
    ["0.0.0.0", [0, 0, 0, 0]],
    ["255.255.255.255", [255, 255, 255, 255]],
    ["010.0.0.1", [10, 0, 0, 1]],
    ["256.0.0.1", null],
    ["1.2.3", null],
    ["1.2.3.4.5", null],
    ["1.2.3.", null],
    ["1..3.4", null],
    ["0001.2.3.4", null],
    ["-1.2.3.4", null],
    ["1.2.3.4 ", null],
    ["::1", null],
    ["", null],
  ];
  for (const [input, want] of cases) assert.deepEqual(parseIpv4(input), want, JSON.stringify(input));
});

Deno.test("nonPublicRange() and parseAddress() accept exactly the addresses the parser does", () => {
  for (const [input, want] of IPV6) {
    if (input.trim() !== input || input.startsWith("[") || input.includes("%")) continue; // the callers strip these
    if (parseIpv4(input)) continue; // IPv4 text: both read it as IPv4
    const bytes = parseAddress(input);
    const asGroups = bytes &&
      Array.from({ length: 8 }, (_, i) => ((bytes[2 * i] << 8) | bytes[2 * i + 1]).toString(16));
    assert.equal(asGroups && asGroups.join(":"), want, `parseAddress(${JSON.stringify(input)})`);
    assert.equal(
      nonPublicRange(input) === "invalid",
      want === null,
      `nonPublicRange(${JSON.stringify(input)})`,
    );
  }
  // The inputs the data pipeline's old copy accepted, as public addresses, and now refuses.
  for (const input of ["1:2:3:4:5:6:7:8::", "::1:2:3:4:5:6:7:8", "[::1:2:3:4:5:6:7:8]", "::a1.2.3.4"]) {
    assert.equal(nonPublicRange(input), "invalid", input);
    assert.equal(parseAddress(input), null, input);
  }
  // Zones and brackets, stripped by both users.
  assert.equal(nonPublicRange("[fe80::1%eth0]"), "link-local");
  assert.equal(formatAddress(parseAddress("[fe80::1%eth0]")!), "fe80:0:0:0:0:0:0:1");
  assert.equal(nonPublicRange("::ffff:192.0.2.1"), "reserved");
  assert.equal(formatAddress(parseAddress("::ffff:c000:201")!), "192.0.2.1");
});
