/**
 * Text hygiene shared by every stage: Unicode normalisation, control-character stripping,
 * binary detection and lossy-but-counted UTF-8 decoding.
 *
 * Kept free of I/O and of the tokenizer so the tokenize workers can import it cheaply and the
 * cleaning rules are the same whether a document came from a file, a URL or the HTTP body.
 */

/** Control characters removed by {@link cleanText}: C0 (except tab and newline), DEL, C1, BOM and U+FFFD. */
// deno-lint-ignore no-control-regex -- stripping control characters is the point
const CONTROL_RE = /[\u0000-\u0008\u000B\u000C\u000E-\u001F\u007F-\u009F\uFEFF\uFFFD]/g;
/** Runs of three or more newlines (after trailing-space removal) collapse to one blank line. */
const BLANK_RUN_RE = /\n{3,}/g;
/** Spaces and tabs at the end of a line. */
const TRAILING_WS_RE = /[ \t]+\n/g;

/**
 * Normalise a document for training: NFC normalisation, CRLF/CR to LF, control characters and
 * replacement characters stripped, trailing spaces removed, blank-line runs collapsed, trimmed.
 */
export function cleanText(text: string): string {
  let t = text;
  if (t.indexOf("\r") >= 0) t = t.replace(/\r\n?/g, "\n");
  t = t.normalize("NFC");
  t = t.replace(CONTROL_RE, "");
  if (t.indexOf(" \n") >= 0 || t.indexOf("\t\n") >= 0) t = t.replace(TRAILING_WS_RE, "\n");
  if (t.indexOf("\n\n\n") >= 0) t = t.replace(BLANK_RUN_RE, "\n\n");
  return t.trim();
}

/** Whether bytes look binary: a NUL byte in the first 8 KiB (the heuristic git and grep use). */
export function looksBinary(bytes: Uint8Array): boolean {
  const n = Math.min(bytes.length, 8192);
  for (let i = 0; i < n; i++) if (bytes[i] === 0) return true;
  return false;
}

/** The result of {@link decodeUtf8}: the text and whether invalid sequences were replaced. */
export interface DecodedText {
  /** Decoded text; invalid sequences become U+FFFD (later stripped by {@link cleanText}). */
  text: string;
  /** True when the bytes were not valid UTF-8. */
  invalid: boolean;
}

/** Decoders shared by {@link decodeUtf8} (a one-shot `decode` keeps no state between calls). */
const STRICT = new TextDecoder("utf-8", { fatal: true, ignoreBOM: false }), LOSSY = new TextDecoder("utf-8");

/**
 * Decode UTF-8, lossily where it is invalid, which is reported, never thrown. Valid bytes decode
 * alike either way, so the lossy decode (2-5 times faster than the strict one in Deno) comes first;
 * only a result holding U+FFFD (written as such, or replacing invalid bytes) is decided strictly.
 */
export function decodeUtf8(bytes: Uint8Array): DecodedText {
  const text = LOSSY.decode(bytes);
  if (text.indexOf("\uFFFD") < 0) return { text, invalid: false };
  try {
    STRICT.decode(bytes);
    return { text, invalid: false };
  } catch {
    return { text, invalid: true };
  }
}
