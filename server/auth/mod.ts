/**
 * Users, tokens, ownership and quotas of the HTTP process (no routes: those are
 * server/routes/auth.ts and server/routes/admin.ts). Re-exports only.
 */

export { Access, SHARED } from "./access.ts";
export { QuotaBook, type Usage } from "./quotas.ts";
export { LOCAL_ADMIN, type Principal, type Refusal, TokenAuth, type TokenView } from "./token_auth.ts";
export {
  hashToken,
  mintToken,
  parseExpiry,
  parseScopes,
  type Scope,
  SCOPES,
  TOKEN_FORM,
  TOKEN_ID,
  tokenIdOf,
  USER_NAME,
} from "./tokens.ts";
