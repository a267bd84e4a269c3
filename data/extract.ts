/**
 * Main-text extraction from HTML with Mozilla's Readability (the Firefox Reader View engine) on a
 * linkedom DOM, then a DOM walk that keeps paragraph breaks.
 *
 * Regular expressions cannot tell an article from its navigation, comments and scripts; a
 * well-kept reader-mode library can. When Readability finds no article, the page body is used
 * with scripts, styles and page furniture (nav, header, footer, aside, forms) removed.
 */
import { Readability } from "@mozilla/readability";
import { parseHTML } from "linkedom";

/** Articles shorter than this (in characters) are not trusted; the cleaned body is used instead. */
const MIN_ARTICLE_CHARS = 200;

/** Elements that end a block of text (a paragraph break after them). */
const BLOCK_TAGS = new Set([
  "P",
  "DIV",
  "SECTION",
  "ARTICLE",
  "MAIN",
  "H1",
  "H2",
  "H3",
  "H4",
  "H5",
  "H6",
  "LI",
  "UL",
  "OL",
  "DL",
  "DT",
  "DD",
  "TABLE",
  "TR",
  "BLOCKQUOTE",
  "PRE",
  "HR",
  "FIGURE",
  "FIGCAPTION",
  "ADDRESS",
  "HEADER",
  "FOOTER",
]); // deno-fmt-ignore
/** Elements whose content is never text for training. */
const SKIP_TAGS = new Set(["SCRIPT", "STYLE", "NOSCRIPT", "TEMPLATE", "SVG", "CANVAS", "IFRAME", "OBJECT", "HEAD"]);
/** Page furniture skipped in the fallback (no article found). */
const FURNITURE_TAGS = new Set(["NAV", "HEADER", "FOOTER", "ASIDE", "FORM", "BUTTON", "SELECT"]);

/** A minimal view of a DOM node (linkedom's nodes satisfy it). */
interface DomNode {
  nodeType: number;
  nodeName: string;
  textContent: string | null;
  childNodes: ArrayLike<DomNode>;
}

/** Walk a DOM subtree into text: whitespace collapsed, blocks separated by blank lines, `<br>` as newline. */
function domText(root: DomNode, skipFurniture: boolean): string {
  const parts: string[] = [];
  const walk = (node: DomNode, pre: boolean) => {
    if (node.nodeType === 3) {
      const t = node.textContent ?? "";
      parts.push(pre ? t : t.replace(/\s+/g, " "));
      return;
    }
    if (node.nodeType !== 1 && node.nodeType !== 9 && node.nodeType !== 11) return;
    const tag = node.nodeName.toUpperCase();
    if (SKIP_TAGS.has(tag) || (skipFurniture && FURNITURE_TAGS.has(tag))) return;
    if (tag === "BR") {
      parts.push("\n");
      return;
    }
    const block = BLOCK_TAGS.has(tag);
    if (block) parts.push("\n\n");
    const kids = node.childNodes;
    for (let i = 0; i < kids.length; i++) walk(kids[i], pre || tag === "PRE");
    if (block) parts.push("\n\n");
  };
  walk(root, false);
  return parts.join("")
    .replace(/[ \t]*\n[ \t]*/g, "\n")
    .replace(/\n{3,}/g, "\n\n")
    .replace(/ {2,}/g, " ")
    .trim();
}

/** The parts of linkedom's DOM used here (its typings describe a window without a document). */
interface LinkedomDocument {
  title?: string;
  body: unknown;
  documentElement: unknown;
}

/** Parse HTML into a linkedom document. */
function parseDocument(html: string): LinkedomDocument {
  return (parseHTML(html) as unknown as { document: LinkedomDocument }).document;
}

/** The result of {@link extractMainText}. */
export interface ExtractedText {
  /** The page title, if any. */
  title: string;
  /** The main text, paragraphs separated by blank lines. */
  text: string;
  /** Whether Readability found an article (false: the cleaned page body was used). */
  article: boolean;
}

/** Extract the main text of an HTML page (Readability, falling back to the body without furniture). */
export function extractMainText(html: string, url?: string): ExtractedText {
  const document = parseDocument(html);
  const title = (document.title ?? "").trim();
  try {
    // deno-lint-ignore no-explicit-any
    const doc = document as any;
    if (url && doc.documentURI === undefined) doc.documentURI = url;
    const parsed = new Readability(doc, { charThreshold: MIN_ARTICLE_CHARS }).parse();
    if (parsed?.content) {
      const articleDoc = parseDocument(`<!doctype html><html><body>${parsed.content}</body></html>`);
      const text = domText(articleDoc.body as unknown as DomNode, false);
      // Below the threshold Readability is guessing: the furniture-free body is more reliable.
      if (text.length >= MIN_ARTICLE_CHARS) {
        return { title: parsed.title?.trim() || title, text, article: true };
      }
    }
  } catch {
    // Readability rejected the page: fall through to the body.
  }
  const fresh = parseDocument(html);
  const body = (fresh.body ?? fresh.documentElement) as unknown as DomNode | null;
  return { title, text: body ? domText(body, true) : "", article: false };
}
