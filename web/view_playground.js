/**
 * The playground: pick a model (a job's checkpoint or an imported folder, from `GET /v1/models`),
 * type a prompt, set temperature, top-k, top-p, max tokens and seed, and watch the tokens stream
 * in from `GET /generate`, with time to first token and tokens/s (measured here and by the server).
 * Chat mode talks to a model with a chat template (an SFT checkpoint) through
 * `POST /v1/chat/completions`, streamed: an optional system message, then turns that stay in the
 * transcript until "New chat"; a model without a template answers why beside the model field.
 */

import { ApiError, apiFetch, getJson } from "./api.js";
import { h, setChildren, stat } from "./dom.js";
import { fmtInt, fmtNum } from "./shapes.js";
import { readSse } from "./sse.js";

const PARAMS = [
  ["temperature", "0.8", "decimal"],
  ["top_k", "40", "numeric"],
  ["top_p", "1", "decimal"],
  ["max_tokens", "64", "numeric"],
  ["seed", "", "numeric"],
];

/** Renders the playground into `ctx.root`. */
export async function playgroundView(ctx) {
  const { data: models } = await getJson("/v1/models", { signal: ctx.signal });
  const wanted = ctx.query.get("model");
  const ids = models.map((m) => m.id);
  if (wanted && !ids.includes(wanted)) ids.unshift(wanted);
  const model = h(
    "select",
    { id: "pg-model", name: "model" },
    ids.length ? null : h("option", { value: "" }, "no models yet: train a job first"),
    ids.map((id) => {
      const m = models.find((x) => x.id === id);
      return h(
        "option",
        { value: id, selected: id === wanted },
        m ? `${id} (${m.kind}, ${m.n_layer}L×${m.n_embd})` : id,
      );
    }),
  );
  const mode = h(
    "select",
    { id: "pg-mode", name: "mode" },
    h("option", { value: "completion" }, "completion"),
    h("option", { value: "chat" }, "chat"),
  );
  const system = h("input", { id: "pg-system", placeholder: "System message (optional)" });
  const transcript = h("div", { id: "pg-chat", class: "chat" });
  /** The chat so far: {role, content} turns, system message aside. */
  let history = [];
  const prompt = h("textarea", {
    id: "pg-prompt",
    rows: 3,
    placeholder: "Prompt (empty: start from <|endoftext|>)",
  });
  prompt.value = "Fellow citizens, the state of our Union is";
  const inputs = new Map(
    PARAMS.map((
      [n, v, mode],
    ) => [n, h("input", { id: `pg-${n}`, value: v, inputmode: mode, placeholder: "random" })]),
  );
  const errors = new Map();
  const field = (name, input) => {
    const err = h("small", { class: "field-error", "data-error-for": name });
    errors.set(name, err);
    return h("label", { class: "field" }, h("span", {}, name), input, err);
  };
  const go = h("button", { type: "submit", id: "pg-go" }, "Generate");
  const reset = h("button", { type: "button", id: "pg-reset", class: "secondary", hidden: true }, "New chat");
  const stop = h("button", { type: "button", id: "pg-stop", class: "secondary", disabled: true }, "Stop");
  const formError = h("p", { class: "error", hidden: true, id: "pg-error" });
  const promptOut = h("span", { class: "muted" });
  const textOut = h("span", { id: "pg-text", "data-tokens": "0" });
  const figures = h("div", { class: "stats", id: "pg-stats" });
  const form = h(
    "form",
    { id: "pg-form", novalidate: true },
    field("model", model),
    field("mode", mode),
    field("system", system),
    transcript,
    field("prompt", prompt),
    h("div", { class: "grid grid-narrow" }, [...inputs].map(([n, i]) => field(n, i))),
    formError,
    h("div", { class: "actions" }, go, stop, reset),
  );
  const chatOnly = [errors.get("system").parentElement, transcript, reset];
  const showMode = () => {
    const chat = mode.value === "chat";
    for (const el of chatOnly) el.hidden = !chat;
    go.textContent = chat ? "Send" : "Generate";
    prompt.placeholder = chat ? "Your message" : "Prompt (empty: start from <|endoftext|>)";
  };
  mode.addEventListener("change", () => {
    if (mode.value === "chat" && prompt.value === "Fellow citizens, the state of our Union is") {
      prompt.value = "";
    }
    showMode();
  });
  showMode();
  const renderTranscript = () =>
    setChildren(
      transcript,
      history.map((t) => h("p", { class: `turn turn-${t.role}` }, h("b", {}, `${t.role}: `), t.content)),
    );
  reset.addEventListener("click", () => {
    history = [];
    renderTranscript();
  });
  setChildren(
    ctx.root,
    h("h1", {}, "Playground"),
    form,
    h("pre", { class: "output", id: "pg-output" }, promptOut, textOut),
    figures,
  );

  let running = null;
  stop.addEventListener("click", () => running?.abort());
  ctx.signal.addEventListener("abort", () => running?.abort());
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    for (const [, el] of errors) el.textContent = "";
    formError.hidden = true;
    const chat = mode.value === "chat";
    const q = new URLSearchParams({ model: model.value, prompt: prompt.value });
    for (const [n, input] of inputs) if (input.value.trim() !== "") q.set(n, input.value.trim());
    const asked = prompt.value;
    running = new AbortController();
    go.disabled = true;
    stop.disabled = false;
    promptOut.textContent = chat ? "" : prompt.value;
    textOut.textContent = "";
    let tokens = 0;
    const t0 = performance.now();
    let first = null;
    const show = (done) => {
      const elapsed = (performance.now() - (first ?? t0)) / 1000;
      setChildren(
        figures,
        stat("tokens", fmtInt(tokens), { id: "pg-count" }),
        stat("first token", first === null ? "–" : `${fmtInt(first - t0)} ms`, { id: "pg-ttft" }),
        // The decode rate after the first token; the server's figure counts from the request.
        stat("tokens/s", fmtNum(tokens > 1 ? (tokens - 1) / elapsed : null, 1), { id: "pg-tps" }),
        done?.timings ? stat("server first token", `${fmtInt(done.timings?.ttft_ms)} ms`) : null,
        done?.timings ? stat("server tokens/s", fmtNum(done.timings?.tokens_per_s, 1)) : null,
        done
          ? stat("finish", done.finish_reason + (done.error ? `: ${done.error}` : ""), { id: "pg-finish" })
          : null,
      );
    };
    show(null);
    try {
      if (chat) {
        const messages = [
          ...(system.value.trim() ? [{ role: "system", content: system.value }] : []),
          ...history,
          { role: "user", content: asked },
        ];
        const body = { model: model.value, messages, stream: true, stream_options: { include_usage: true } };
        for (const [n, input] of inputs) if (input.value.trim() !== "") body[n] = Number(input.value.trim());
        const res = await apiFetch("/v1/chat/completions", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify(body),
          signal: running.signal,
        });
        let reply = "", finish = null;
        await readSse(res, (ev) => {
          if (ev.data === "[DONE]") return true;
          const d = JSON.parse(ev.data);
          for (const ch of d.choices ?? []) {
            if (ch.delta?.content) {
              first ??= performance.now();
              tokens++;
              reply += ch.delta.content;
              textOut.append(ch.delta.content);
              textOut.dataset.tokens = String(tokens);
            }
            if (ch.finish_reason) finish = ch.finish_reason;
          }
          show(finish ? { finish_reason: finish, error: d.error?.message } : null);
          return false;
        });
        history = [...history, { role: "user", content: asked }, { role: "assistant", content: reply }];
        renderTranscript();
        textOut.textContent = "";
        prompt.value = "";
        return;
      }
      const res = await apiFetch(`/generate?${q}`, { signal: running.signal });
      await readSse(res, (ev) => {
        const d = JSON.parse(ev.data);
        if (ev.event === "token") {
          first ??= performance.now();
          tokens++;
          textOut.append(d.text);
          textOut.dataset.tokens = String(tokens);
          show(null);
          return false;
        }
        if (ev.event === "done") {
          show(d);
          return true;
        }
        return false;
      });
    } catch (err) {
      if (err instanceof ApiError) {
        for (const [name, msg] of Object.entries(err.fields)) {
          const el = errors.get(name);
          if (el) el.textContent = msg;
        }
        formError.textContent = err.message;
        formError.hidden = false;
      } else if (err.name !== "AbortError") {
        formError.textContent = err.message;
        formError.hidden = false;
      }
    } finally {
      go.disabled = false;
      stop.disabled = true;
      running = null;
    }
  });
}
