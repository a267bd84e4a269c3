/**
 * Test helper for the API's one error shape: asserts a response's status and that its body is
 * exactly `{error: {message, type, param, code}}`, and returns the inner error for more checks.
 */

import { deepStrictEqual as assertEquals, match as assertMatch, ok as assert } from "node:assert/strict";

/** The inner error of the one shape. */
export interface ApiErrorBody {
  message: string;
  type: string;
  param: string | null;
  code: string | null;
}

/** Asserts `res` is a `status` answer in the one error shape (and `expect`'s fields, when given). */
export async function apiError(
  res: Response,
  status: number,
  expect: { message?: string | RegExp; param?: string | null; code?: string | null; type?: string } = {},
): Promise<ApiErrorBody> {
  const text = await res.text();
  assertEquals(res.status, status, text);
  assert((res.headers.get("Content-Type") ?? "").startsWith("application/json"), text);
  const body = JSON.parse(text);
  assertEquals(Object.keys(body), ["error"], text);
  const e = body.error as ApiErrorBody;
  assertEquals(Object.keys(e).sort(), ["code", "message", "param", "type"], text);
  assert(typeof e.message === "string" && /^[A-Z"]/.test(e.message) && !e.message.endsWith("."), text);
  assert(typeof e.type === "string" && e.type.length > 0, text);
  assert(e.param === null || typeof e.param === "string", text);
  assert(e.code === null || typeof e.code === "string", text);
  if (expect.message instanceof RegExp) assertMatch(e.message, expect.message);
  else if (expect.message !== undefined) assertEquals(e.message, expect.message);
  if (expect.param !== undefined) assertEquals(e.param, expect.param);
  if (expect.code !== undefined) assertEquals(e.code, expect.code);
  if (expect.type !== undefined) assertEquals(e.type, expect.type);
  return e;
}
