/**
 * Admin: users with their quotas and what they hold now (`GET /admin/users`), a form to change a
 * user's quotas, every token with its state and a revoke button (`GET`/`DELETE /admin/tokens`), a
 * form that makes a token and shows it once (`POST /admin/tokens`), and the newest audit events
 * (`GET /admin/audit`). Shown in the navigation only to an admin token.
 */

import { ApiError, apiFetch, getJson, postJson } from "./api.js";
import { badge, h, setChildren } from "./dom.js";
import { fmtInt } from "./shapes.js";

const QUOTAS = ["queued_jobs", "running_gpus", "streams", "gpu_seconds_per_day"];
const SCOPES = ["read", "train", "generate", "admin"];

function tokenState(t) {
  if (t.revoked_at) return "revoked";
  if (t.expires_at && Date.parse(t.expires_at) <= Date.now()) return "expired";
  return "active";
}

/** Renders the admin page into `ctx.root`. */
export async function adminView(ctx) {
  const users = h("tbody"), tokens = h("tbody"), audit = h("tbody");
  const made = h("p", { class: "made", id: "token-made" });
  const note = h("p", { class: "error", id: "admin-error" });
  const table = (id, heads, body) =>
    h(
      "div",
      { class: "table-wrap" },
      h("table", { id }, h("thead", {}, h("tr", {}, heads.map((x) => h("th", {}, x)))), body),
    );

  const refresh = async () => {
    const [u, t, a] = await Promise.all([
      getJson("/admin/users", { signal: ctx.signal }),
      getJson("/admin/tokens", { signal: ctx.signal }),
      getJson("/admin/audit?limit=50", { signal: ctx.signal }),
    ]);
    setChildren(
      users,
      u.users.map((x) =>
        h(
          "tr",
          { "data-user": x.name },
          h("td", {}, x.name),
          h("td", { class: "num" }, fmtInt(x.tokens)),
          QUOTAS.map((q) => h("td", { class: "num" }, `${fmtInt(x.usage[q])} / ${fmtInt(x.quotas[q])}`)),
        )
      ),
    );
    setChildren(
      tokens,
      t.tokens.map((x) => {
        const state = tokenState(x);
        const revoke = async () => {
          await apiFetch(`/admin/tokens/${encodeURIComponent(x.id)}`, { method: "DELETE" });
          await refresh();
        };
        return h(
          "tr",
          { "data-token": x.id },
          h("td", {}, x.id),
          h("td", {}, x.user),
          h("td", {}, x.name || "–"),
          h("td", {}, x.scopes.join(", ")),
          h("td", {}, x.expires_at ?? "never"),
          h("td", {}, x.last_used_at ?? "never"),
          h("td", {}, badge(state)),
          h(
            "td",
            {},
            state === "active" ? h("button", { class: "danger", onclick: revoke }, "Revoke") : null,
          ),
        );
      }),
    );
    setChildren(
      audit,
      a.events.map((e) =>
        h(
          "tr",
          {},
          h("td", {}, e.at),
          h("td", {}, e.user ?? "(admin)"),
          h("td", {}, e.action),
          h("td", {}, e.target ?? ""),
        )
      ),
    );
  };

  const user = h("input", { id: "new-token-user", placeholder: "user", required: true });
  const name = h("input", { id: "new-token-name", placeholder: "label (optional)" });
  const expires = h("input", { id: "new-token-expires", placeholder: "expires: 30d, 12h (optional)" });
  const boxes = SCOPES.map((s) => h("input", { type: "checkbox", value: s, checked: s !== "admin" }));
  const create = async (e) => {
    e.preventDefault();
    note.textContent = "";
    try {
      const body = { user: user.value.trim(), scopes: boxes.filter((b) => b.checked).map((b) => b.value) };
      if (name.value.trim()) body.name = name.value.trim();
      if (expires.value.trim()) body.expires = expires.value.trim();
      const res = await postJson("/admin/tokens", body);
      setChildren(
        made,
        `Token ${res.body.id} for "${res.body.user}", shown only now: `,
        h("code", {}, res.body.token),
      );
      await refresh();
    } catch (err) {
      note.textContent = err instanceof ApiError ? err.message : String(err);
    }
  };
  const quotaUser = h("input", { id: "quota-user", placeholder: "user", required: true });
  const quotaInputs = QUOTAS.map((q) =>
    h("input", { inputmode: "numeric", placeholder: q, "data-quota": q })
  );
  const setQuotas = async (e) => {
    e.preventDefault();
    note.textContent = "";
    const body = {};
    for (const i of quotaInputs) if (i.value.trim() !== "") body[i.dataset.quota] = Number(i.value);
    try {
      await apiFetch(`/admin/users/${encodeURIComponent(quotaUser.value.trim())}/quotas`, {
        method: "PUT",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      await refresh();
    } catch (err) {
      note.textContent = err instanceof ApiError ? err.message : String(err);
    }
  };

  setChildren(
    ctx.root,
    h("h1", {}, "Admin"),
    note,
    h("h2", {}, "Users"),
    table("admin-users", ["user", "tokens", ...QUOTAS.map((q) => `${q} (used / quota)`)], users),
    h(
      "form",
      { class: "inline-form", onsubmit: setQuotas },
      quotaUser,
      quotaInputs,
      h("button", { type: "submit" }, "Set quotas"),
    ),
    h("h2", {}, "Tokens"),
    h(
      "form",
      { class: "inline-form", onsubmit: create },
      user,
      name,
      expires,
      SCOPES.map((s, i) => h("label", {}, boxes[i], ` ${s}`)),
      h("button", { type: "submit", id: "make-token" }, "Make token"),
    ),
    made,
    table("admin-tokens", ["id", "user", "label", "scopes", "expires", "last used", "state", ""], tokens),
    h("h2", {}, "Audit"),
    table("admin-audit", ["at", "user", "action", "target"], audit),
  );
  await refresh();
}
