/**
 * A tiny element builder, so views build DOM from data without innerHTML (no markup injection
 * from job names, prompts or error messages).
 */

/**
 * Creates `<tag>` with attributes (`on*` functions become listeners, `class`, `data-*` and the
 * rest attributes; null/false ones are skipped) and children (strings become text).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs ?? {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "value") el.value = v;
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(el, c);
    else el.append(c instanceof Node ? c : String(c));
  }
}

/** Replaces `el`'s children. */
export function setChildren(el, ...children) {
  el.replaceChildren();
  append(el, children);
}

/** A labelled value for a row of figures. */
export function stat(label, value, attrs = {}) {
  return h("div", { class: "stat", ...attrs }, h("span", { class: "stat-label" }, label), h("b", {}, value));
}

/** A status badge. */
export function badge(status) {
  return h("span", { class: `badge badge-${status}` }, status);
}
