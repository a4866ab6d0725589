// agl traces: the viewer's page. Everything from a store (ids, text, attributes) reaches the page
// through textContent / createTextNode / setAttribute, never innerHTML, and control characters are
// shown as visible escapes: a harness's text is displayed, never interpreted.
"use strict";

const ROLES = { p: "prompt", c: "trained completion", t: "tool output / context (masked)", m: "masked" };
const CONTROLS = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
const CONTROLS_ALL = /[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

function escapeChar(ch) {
  const code = ch.charCodeAt(0);
  return code < 0x100 ? "\\x" + code.toString(16).padStart(2, "0") : "\\u" + code.toString(16).padStart(4, "0");
}
// Text as the user should see it: controls (ESC, NUL, bidi overrides...) as escapes.
function visible(value, keepNewlines) {
  if (value === null || value === undefined) return "–";
  return String(value).replace(keepNewlines ? CONTROLS : CONTROLS_ALL, escapeChar);
}

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

async function api(path, params) {
  const query = new URLSearchParams(params || {}).toString();
  const response = await fetch("/api/" + path + (query ? "?" + query : ""));
  let body;
  try { body = await response.json(); } catch (e) { throw new Error("HTTP " + response.status); }
  if (!response.ok) throw new Error(body.error || "HTTP " + response.status);
  return body;
}

const fmt = {
  num(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits === undefined ? 3 : digits).replace(/\.?0+$/, "") || "0"; },
  ms(ns) {
    if (ns === null || ns === undefined) return "–";
    const ms = ns / 1e6;
    return ms >= 10000 ? (ms / 1000).toFixed(1) + " s" : ms.toFixed(ms < 10 ? 2 : ms < 100 ? 1 : 0) + " ms";
  },
  time(s) { return s ? new Date(s * 1000).toLocaleString() : "–"; },
};

function rolloutHref(id, attempt) {
  const params = new URLSearchParams({ id: id });
  if (attempt !== undefined && attempt !== null) params.set("attempt", attempt);
  return "#/rollout?" + params.toString();
}

function hashRoute() {
  const hash = location.hash.slice(1) || "/";
  const at = hash.indexOf("?");
  const path = at < 0 ? hash : hash.slice(0, at);
  const params = Object.fromEntries(new URLSearchParams(at < 0 ? "" : hash.slice(at + 1)));
  return { path, params };
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.flat(Infinity).filter((n) => n !== null && n !== undefined && n !== false));
}

// A two-column list of (label, value) pairs; each value is text or a node.
function grid(...pairs) {
  const box = el("div", { class: "grid" });
  for (let i = 0; i + 1 < pairs.length; i += 2) box.append(el("div", {}, pairs[i]), el("div", {}, pairs[i + 1]));
  return box;
}

// Live view during training: the landing and steps pages reload their data every 10 s while
// "live" is ticked (kept in localStorage), unless the user is typing in a filter.
let liveTimer = null;
function live() { return localStorage.getItem("agl-live") !== "off"; }
function scheduleLive() {
  clearTimeout(liveTimer);
  if (!live()) return;
  const at = location.hash;
  liveTimer = setTimeout(() => {
    const typing = document.activeElement && ["INPUT", "SELECT"].includes(document.activeElement.tagName);
    if (location.hash === at && !typing) route(); else scheduleLive();
  }, 10000);
}
function liveToggle() {
  return el("label", { class: "muted" }, el("input", {
    type: "checkbox", checked: live() ? "" : null,
    onchange: (event) => { localStorage.setItem("agl-live", event.target.checked ? "on" : "off"); scheduleLive(); },
  }), " live (reload every 10 s)");
}

async function route() {
  clearTimeout(liveTimer);
  const { path, params } = hashRoute();
  try {
    if (path === "/rollout") await rolloutPage(params);
    else if (path === "/step") await stepPage(params);
    else if (path === "/steps") await stepsPage();
    else await rolloutsPage(params);
    if (path !== "/rollout" && path !== "/step") scheduleLive();
  } catch (error) {
    show(el("p", { class: "error" }, "error: " + visible(error.message)));
  }
}

// --- the landing page: counts, curves, the rollouts table ----------------------------------------

const COLUMNS = [
  ["rollout", "rollout"], ["attempt", null], ["task", "task"], ["mode", "mode"], ["state", null],
  ["end cause", "cause"], ["step", "step"], ["policy", "version"], ["reward", "reward"], ["calls", "calls"],
  ["merge breaks", "breaks"], ["duration", "duration"],
];
const FILTERS = [
  ["id", "id prefix"], ["task", "task"], ["mode", "mode", ["", "train", "val"]],
  ["state", "state", ["", "open", "complete", "ready", "trained", "dropped"]],
  ["cause", "end cause", ["", "ok", "harness_error", "infra_error", "timeout", "cancelled"]],
  ["step", "step (none: untrained)"], ["min_version", "policy ≥"], ["max_version", "policy ≤"],
  ["min_reward", "reward ≥"], ["max_reward", "reward ≤"], ["min_calls", "calls ≥"], ["max_calls", "calls ≤"],
  ["min_breaks", "breaks ≥"], ["max_breaks", "breaks ≤"],
];

async function rolloutsPage(params) {
  const [overview, page] = await Promise.all([api("overview"), api("rollouts", params)]);
  document.getElementById("store").textContent = visible(overview.store);
  const c = overview.counts;
  const cards = el("div", { class: "cards" },
    card("rollouts", c.rollouts), card("complete", c.complete), card("trained", c.trained),
    card("dropped", c.dropped), card("last step", c.last_step ?? "–"),
    Object.entries(c.by_cause).map(([cause, n]) => card(cause || "(none)", n)),
    Object.entries(c.violations).map(([reason, n]) => card("violations: " + reason, n)),
    overview.indexing && !overview.indexing.done ? card("indexing merge breaks", overview.indexing.indexed + " / " + overview.indexing.total) : null);
  const form = el("form", { class: "filters", id: "filters" },
    FILTERS.map(([name, label, choices]) => el("label", {}, label,
      choices ? el("select", { name }, choices.map((v) => el("option", { value: v, selected: params[name] === v ? "" : null }, v || "any")))
              : el("input", { name, value: params[name] || "", size: 8 }))),
    el("button", { type: "submit" }, "filter"),
    el("button", { type: "button", onclick: () => { location.hash = "#/"; } }, "clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = {};
    for (const [key, value] of new FormData(form).entries()) if (value) next[key] = value;
    if (params.sort) next.sort = params.sort;
    if (params.order) next.order = params.order;
    location.hash = "#/?" + new URLSearchParams(next).toString();
  });
  show(
    el("h1", {}, "Rollouts ", liveToggle()),
    cards,
    chart(overview.curve, overview.curve_source),
    form,
    rolloutsTable(page, params),
    pager(page, params),
    overview.tokenizer_error ? el("p", { class: "error" }, visible(overview.tokenizer_error)) : null,
  );
}

function card(label, value) { return el("div", { class: "card" }, el("b", {}, String(value)), visible(label)); }

function rolloutsTable(page, params) {
  const sort = params.sort || "newest";
  const order = params.order || "desc";
  const head = el("tr", {}, COLUMNS.map(([label, key]) => {
    if (!key) return el("th", {}, label);
    const sorted = key === sort;
    return el("th", {
      class: "sortable" + (sorted ? " sorted" + (order === "asc" ? " asc" : "") : ""),
      onclick: () => {
        const next = { ...params, sort: key, order: sorted && order === "desc" ? "asc" : "desc" };
        delete next.offset;
        location.hash = "#/?" + new URLSearchParams(next).toString();
      },
    }, label);
  }));
  const rows = page.rows.map((r) => el("tr", {},
    el("td", { class: "id" }, el("a", { href: rolloutHref(r.rollout_id, r.attempt) }, visible(r.rollout_id))),
    el("td", { class: "num" }, r.attempt),
    el("td", { class: "id" }, visible(r.task_id)),
    el("td", {}, visible(r.mode)),
    el("td", {}, r.trained_step !== null ? "trained" : r.dropped_reason ? "dropped: " + visible(r.dropped_reason) : r.complete ? "ready" : "open"),
    el("td", { class: r.end_cause === "ok" ? "ok" : r.end_cause ? "bad" : "" }, visible(r.end_cause)),
    el("td", { class: "num" }, r.trained_step === null ? "–" : el("a", { href: "#/step?step=" + r.trained_step }, r.trained_step)),
    el("td", { class: "num" }, r.min_version === null || r.min_version === undefined ? "–" : r.min_version === r.max_version ? r.max_version : r.min_version + "–" + r.max_version),
    el("td", { class: "num" }, fmt.num(r.reward)),
    el("td", { class: "num" }, r.calls),
    el("td", { class: "num" + (r.merge_breaks ? " bad" : ""), title: r.break_kinds ? Object.entries(r.break_kinds).map(([k, n]) => k + " " + n).join(", ") : null },
      r.merge_breaks === null || r.merge_breaks === undefined ? "…" : r.merge_breaks),
    el("td", { class: "num" }, r.started_ns && r.ended_ns ? fmt.ms(r.ended_ns - r.started_ns) : "–"),
  ));
  return el("table", { id: "rollouts" }, el("thead", {}, head), el("tbody", {}, rows));
}

function pager(page, params) {
  const go = (offset) => { location.hash = "#/?" + new URLSearchParams({ ...params, offset: String(Math.max(0, offset)) }).toString(); };
  const last = page.offset + page.rows.length;
  return el("div", { class: "pager" },
    el("button", { disabled: page.offset === 0 ? "" : null, onclick: () => go(page.offset - page.limit) }, "‹ newer"),
    el("span", { class: "muted" }, (page.rows.length ? page.offset + 1 : 0) + "–" + last + " of " + page.total),
    el("button", { disabled: last >= page.total ? "" : null, onclick: () => go(page.offset + page.limit) }, "older ›"));
}

// Reward (left axis) and entropy (right axis) per step, drawn from JSON as inline SVG. The held-out
// rewards of validation rounds (metrics.jsonl's val/reward, val/sampled/reward) share the reward axis.
function chart(curve, source) {
  const W = 720, H = 220, L = 48, R = 48, T = 14, B = 28;
  const has = (p, key) => p[key] !== null && p[key] !== undefined;
  const rewardKeys = ["reward", "val_sampled", "val_reward"];
  const points = (curve || []).filter((p) => [...rewardKeys, "entropy"].some((key) => has(p, key)));
  if (!points.some((p) => has(p, "reward") || has(p, "entropy"))) {
    return el("p", { class: "muted" }, "No training steps yet: the reward and entropy curves appear here.");
  }
  const steps = points.map((p) => p.step);
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  const sx = (s) => L + (x1 === x0 ? (W - L - R) / 2 : ((s - x0) / (x1 - x0)) * (W - L - R));
  const root = svg("svg", { class: "chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  root.append(svg("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#ccc" }));
  root.append(svg("text", { x: L, y: H - 8 }, "step " + x0), svg("text", { x: W - R - 40, y: H - 8 }, "step " + x1));
  // [keys on one axis, colour per key, where the axis labels go]
  const axes = [[rewardKeys, { reward: "#2f6fdf", val_sampled: "#8a3fbf", val_reward: "#2a9d4b" }, L - 44],
    [["entropy"], { entropy: "#e07b00" }, W - R + 4]];
  const names = { reward: "reward", val_sampled: "held-out reward, sampled", val_reward: "held-out reward, greedy", entropy: "entropy" };
  const drawn = [];
  for (const [keys, colors, labelX] of axes) {
    const ys = points.flatMap((p) => keys.filter((key) => has(p, key)).map((key) => p[key]));
    if (!ys.length) continue;
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    const sy = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
    for (const key of keys) {
      const values = points.filter((p) => has(p, key));
      if (!values.length) continue;
      drawn.push(key);
      const path = values.map((p, i) => (i ? "L" : "M") + sx(p.step).toFixed(1) + "," + sy(p[key]).toFixed(1)).join(" ");
      const line = { d: path, fill: "none", stroke: colors[key], "stroke-width": 2 };
      if (key.startsWith("val_")) line["stroke-dasharray"] = "5 3";  // held-out: dashed
      root.append(svg("path", line));
      for (const p of values) {
        const dot = svg("circle", { cx: sx(p.step), cy: sy(p[key]), r: 2.5, fill: colors[key] });
        dot.append(svg("title", {}, `step ${p.step}: ${names[key]} ${fmt.num(p[key], 4)}`));
        root.append(dot);
      }
    }
    const color = colors[keys[0]] || colors[drawn[drawn.length - 1]];
    root.append(svg("text", { x: labelX, y: T + 8, fill: color }, fmt.num(y1, 3)), svg("text", { x: labelX, y: H - B, fill: color }, fmt.num(y0, 3)));
  }
  const colorOf = Object.assign({}, ...axes.map(([, colors]) => colors));
  return el("div", {}, el("h2", {}, "Reward ", el("span", { class: "muted" }, "per step, from " + source + ": ",
    drawn.map((key, i) => [i ? ", " : "", names[key] + " (" + COLOR_NAMES[colorOf[key]] + ")"]))), root);
}

const COLOR_NAMES = { "#2f6fdf": "blue", "#8a3fbf": "purple, dashed", "#2a9d4b": "green, dashed", "#e07b00": "orange" };

// --- steps -----------------------------------------------------------------------------------------

async function stepsPage() {
  const overview = await api("overview");
  const rewardAt = Object.fromEntries(overview.curve.map((p) => [p.step, p]));
  show(el("h1", {}, "Training steps ", liveToggle()), chart(overview.curve, overview.curve_source),
    overview.steps.length ? el("table", {},
      el("thead", {}, el("tr", {}, ["step", "rollouts", "at", "reward", "entropy"].map((h) => el("th", {}, h)))),
      el("tbody", {}, overview.steps.slice().reverse().map((s) => el("tr", {},
        el("td", {}, el("a", { href: "#/step?step=" + s.step }, "step " + s.step)),
        el("td", { class: "num" }, s.rollouts), el("td", {}, fmt.time(s.at)),
        el("td", { class: "num" }, fmt.num(rewardAt[s.step] && rewardAt[s.step].reward)),
        el("td", { class: "num" }, fmt.num(rewardAt[s.step] && rewardAt[s.step].entropy))))))
      : el("p", { class: "muted" }, "No training step recorded in this store yet."));
}

async function stepPage(params) {
  const step = await api("step", { step: params.step || "" });
  const metrics = step.metrics ? Object.entries(step.metrics).sort() : [];
  show(
    el("h1", {}, "Training step " + step.step),
    grid(
      "rollouts trained", String(step.rollouts.length),
      "recorded", step.recorded ? fmt.time(step.recorded.at) : "–",
      "policy trained", "version " + step.trained_version + " (staleness = this − the oldest policy version of a rollout's calls)"),
    el("h2", {}, "Rollouts (advantage = reward − its task group's mean; normalized: ÷ the group's std)"),
    el("table", { id: "step-rollouts" },
      el("thead", {}, el("tr", {}, ["rollout", "task", "reward", "group", "group mean", "advantage", "normalized", "staleness", "policy", "calls", "breaks"].map((h) => el("th", {}, h)))),
      el("tbody", {}, step.rollouts.map((r) => el("tr", {},
        el("td", { class: "id" }, el("a", { href: rolloutHref(r.rollout_id, r.attempt) }, visible(r.rollout_id))),
        el("td", { class: "id" }, visible(r.task_id)),
        el("td", { class: "num" }, fmt.num(r.reward)), el("td", { class: "num" }, r.group_size),
        el("td", { class: "num" }, fmt.num(r.group_mean)),
        el("td", { class: "num " + (r.advantage > 0 ? "ok" : r.advantage < 0 ? "bad" : "") }, fmt.num(r.advantage)),
        el("td", { class: "num" }, fmt.num(r.advantage_normalized)),
        el("td", { class: "num" }, r.staleness ?? "…"),
        el("td", { class: "num" }, r.max_version ?? "…"), el("td", { class: "num" }, r.calls),
        el("td", { class: "num" }, r.merge_breaks ?? "…"))))),
    el("h2", {}, "Metrics row"),
    metrics.length ? grid(...metrics.flatMap(([k, v]) => [visible(k), fmt.num(v, 6)]))
      : el("p", { class: "muted" }, "No metrics.jsonl row for this step next to the store."),
  );
}

// --- one rollout -------------------------------------------------------------------------------

// Calls are numbered 0, 1, 2 in their rollout (seq order); the sidecar's seq, a clock reading unique
// across restarts and sidecars, shows on hover. The API sends the numbers of the calls a page names.
let callNumbers = new Map();
function callNumber(seq) {
  const number = callNumbers.get(String(seq));
  return number === undefined ? "seq " + seq : String(number);
}
function seqTip(seq) { return "seq " + seq + " (unique across restarts)"; }
function callRef(seq, prefix) {
  return el("span", { class: "call", title: seqTip(seq) }, (prefix === undefined ? "#" : prefix) + callNumber(seq));
}

async function rolloutPage(params) {
  const r = await api("rollout", params);
  callNumbers = new Map(Object.entries(r.call_numbers || {}));
  const info = r.info;
  const training = info.trained_step !== null ? el("a", { href: "#/step?step=" + info.trained_step }, "trained at step " + info.trained_step)
    : info.dropped_reason ? "dropped: " + visible(info.dropped_reason) : info.complete ? "ready (not trained yet)" : "open";
  const breaks = new Map(r.merge_failures.map((f) => [f.call_seq, f]));
  show(
    el("h1", {}, "Rollout ", el("span", { id: "rollout-id" }, visible(info.rollout_id))),
    r.attempts.length > 1 ? el("p", {}, "attempts: ", r.attempts.map((a) => [el("a", { href: rolloutHref(info.rollout_id, a) }, a === info.attempt ? "[" + a + "]" : String(a)), " "])) : null,
    grid(
      "task", visible(info.task_id), "mode", visible(info.mode || "train"), "attempt", String(info.attempt),
      "state", (info.complete ? "complete" : "open") + (info.status ? "; rollout span: " + visible(info.status) : ""),
      "end cause", visible(info.end_cause),
      "harness exit", info.harness_exit_code === null ? "–" : String(info.harness_exit_code),
      "error", visible(info.error, true),
      "training", training,
      "reward", fmt.num(r.reward) + (r.dropped ? "  (assembly drops it: " + visible(r.dropped) + ")" : ""),
      "calls", r.calls.length + " (" + r.merge_failures.length + " merge break" + (r.merge_failures.length === 1 ? "" : "s") + ")",
      "counted", Object.entries({ ...r.problems, ...r.truncations }).map(([k, v]) => visible(k) + " " + v).join(", ") || "–",
      "late spans", String(info.late_spans)),
    rewardsTable(r.rewards),
    el("h2", {}, "Timeline"), timeline(r.calls),
    rolloutPager(r.page, params),
    el("h2", {}, "Calls"), callsTable(r.calls, breaks),
    el("h2", {}, "Call tree"), callTree(r.placements, breaks),
    r.merge_failures.length ? [el("h2", {}, "Merge breaks"), breaksTable(r.merge_failures)] : null,
    el("h2", {}, "Samples ", el("span", { class: "muted" }, r.decoded ? "(decoded with the model's tokenizer)" : "(token ids: start the viewer with --model to decode)")),
    legend(),
    r.samples.length ? r.samples.map((s) => sampleView(s, r.placements, breaks, r.decoded, params)) : el("p", { class: "muted" }, "No trainable sample (" + visible(r.dropped || "nothing assembled") + ")."),
    r.log ? [el("h2", {}, "Harness log ", el("span", { class: "muted" }, visible(r.log.name) + (r.log.truncated ? " (last 64 KiB)" : ""))), el("pre", { class: "log" }, visible(r.log.tail, true))] : null,
  );
}

// A big rollout comes a page at a time (the API's calls_*, samples_*, tokens_* windows).
function pageLink(params, changes, label) {
  return el("a", { href: "#/rollout?" + new URLSearchParams({ ...params, ...changes }).toString() }, label);
}

function windowLinks(params, what, offset, limit, total) {
  const links = [];
  if (offset > 0) links.push(pageLink(params, { [what + "_offset"]: Math.max(0, offset - limit) }, "◂ previous"), " ");
  if (offset + limit < total) links.push(pageLink(params, { [what + "_offset"]: offset + limit }, "next ▸"));
  return links;
}

function rolloutPager(page, params) {
  if (!page) return null;
  const parts = [];
  for (const [what, total] of [["calls", page.calls_total], ["samples", page.samples_total]]) {
    const offset = page[what + "_offset"], limit = page[what + "_limit"];
    if (offset === 0 && total <= limit) continue;
    parts.push(el("span", {}, `${what} ${Math.min(offset + 1, total)}–${Math.min(offset + limit, total)} of ${total} `,
      ...windowLinks(params, what, offset, limit, total), " · "));
  }
  if (page.merge_failures_total > 1000) parts.push(el("span", {}, `the first 1000 of ${page.merge_failures_total} merge breaks`));
  return parts.length ? el("p", { class: "pager" }, "Showing ", ...parts) : null;
}

function tokenPager(sample, params) {
  if (sample.length === undefined || sample.length <= sample.ids.length) return null;
  const limit = Number(params.tokens_limit || 20000);
  return el("p", { class: "pager" }, `tokens ${sample.offset + 1}–${sample.offset + sample.ids.length} of ${sample.length} `,
    ...windowLinks(params, "tokens", sample.offset, limit, sample.length));
}

// A per-call reward names its call by seq or by position (0 = the first call); the API says which
// call that is (`for_call`), shown by its number. Seqs past 2^53 arrive as strings: every digit shows.
function rewardTarget(w) {
  if (w.call_seq === null) return "whole rollout";
  const call = w.for_call === null || w.for_call === undefined ? w.call_seq : w.for_call;
  return callRef(call, "call #");
}

function rewardsTable(rewards) {
  if (!rewards.length) return el("p", { class: "muted" }, "No reward spans.");
  // When it was given: after the rollout's first call started, and the local time (the raw
  // nanoseconds are in the title, for matching against other tools).
  const when = (w) => (w.after_ns !== null && w.after_ns !== undefined ? (w.after_ns < 0 ? "−" : "+") + fmt.ms(Math.abs(w.after_ns)) + " · " : "") + fmt.time(w.end_s);
  return [el("h2", {}, "Rewards"), el("table", {},
    el("thead", {}, el("tr", {}, ["name", "value", "call", "given (after the first call's start · local time)"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rewards.map((w) => el("tr", {}, el("td", {}, visible(w.name)), el("td", { class: "num" }, fmt.num(w.value, 6)),
      el("td", {}, rewardTarget(w)), el("td", { title: w.end_ns === null ? null : w.end_ns + " ns" }, when(w))))))];
}

// The sidecar's attribution (the replica that served the call, the protocol the harness spoke),
// then every other column the store keeps on a call (its origin; any a newer store adds).
function attribution(call) {
  const entries = [["upstream", call.upstream], ["api", call.api], ...Object.entries(call.extra || {})];
  const parts = [];
  for (const [key, value] of entries) if (value !== null && value !== undefined) parts.push(visible(key) + " " + visible(value));
  return parts.join(", ");
}

// What a translating front (Anthropic Messages, Responses) did not interpret in the call's request
// (agl.request.fields.dropped / .passed, each "<JSON path>: <why>"): counts, the entries when opened.
function unreadFields(call) {
  const dropped = call.fields_dropped || [], passed = call.fields_passed || [];
  if (!dropped.length && !passed.length) return "–";
  const counts = [dropped.length ? dropped.length + " dropped" : null, passed.length ? passed.length + " passed" : null].filter(Boolean).join(", ");
  const list = (label, entries) => entries.map((entry) => el("li", {}, label + ": " + visible(entry)));
  return el("details", { class: "fields" }, el("summary", {}, counts), el("ul", {}, ...list("dropped", dropped), ...list("passed", passed)));
}

function heldMs(call) {
  return typeof call.held_ms === "number" ? call.held_ms : null;
}

function timeline(calls) {
  if (!calls.length) return el("p", { class: "muted" }, "No calls.");
  const t0 = Math.min(...calls.map((c) => c.start_ns));
  const t1 = Math.max(...calls.map((c) => c.end_ns));
  const span = Math.max(1, t1 - t0);
  const box = el("div", { class: "timeline" }, el("div", { class: "muted" }, "0 → " + fmt.ms(span) + " (hatched: held while training paused the sidecar)"));
  for (const c of calls) {
    const left = ((c.start_ns - t0) / span) * 100, width = ((c.end_ns - c.start_ns) / span) * 100;
    const held = heldMs(c);
    const tip = `call ${callNumber(c.call_seq)} (${seqTip(c.call_seq)}): start +${fmt.ms(c.start_ns - t0)}, duration ${fmt.ms(c.end_ns - c.start_ns)}` +
      (held !== null ? `, held ${held.toFixed(1)} ms` : "") + `, end ${visible(c.end_reason)}, finish ${visible(c.finish_reason)}` +
      (attribution(c) ? ", " + attribution(c) : "");
    const track = el("div", { class: "track" },
      el("div", { class: "bar" + (c.end_reason && c.end_reason !== "completed" ? " badend" : ""), style: null, title: tip, "data-left": left, "data-width": width }));
    if (held) track.append(el("div", { class: "bar held", title: tip, "data-left": left, "data-width": Math.min(width, (held * 1e6 / span) * 100) }));
    box.append(el("div", { class: "lane" }, el("span", { class: "label", title: seqTip(c.call_seq) }, "#" + callNumber(c.call_seq)), track));
  }
  // Positions through the CSSOM (no inline style attributes: the page's CSP allows none).
  for (const bar of box.querySelectorAll(".bar")) {
    bar.style.left = bar.getAttribute("data-left") + "%";
    bar.style.width = "max(2px, " + bar.getAttribute("data-width") + "%)";
  }
  return box;
}

function callsTable(calls, breaks) {
  const t0 = Math.min(...calls.map((c) => c.start_ns));
  return el("table", { id: "calls" },
    el("thead", {}, el("tr", {}, ["call", "start", "duration", "held", "policy", "prompt", "completion", "finish", "end reason", "attribution", "unread fields", "placement", "reward"].map((h) => el("th", {}, h)))),
    el("tbody", {}, calls.map((c) => {
      const p = c.placement;
      const where = !p ? "–" : p.problem ? "skipped: " + visible(p.problem) : p.sample === null ? "dropped with its sample"
        : (p.merged ? "merged into sample " : "new sample ") + p.sample + (p.start && !p.merged ? " (" + visible(p.start) + ")" : "");
      const held = heldMs(c);
      return el("tr", {},
        el("td", {}, callRef(c.call_seq), breaks.has(c.call_seq) ? el("span", { class: "tag break" }, "break: " + visible(breaks.get(c.call_seq).kind)) : null),
        el("td", { class: "num" }, "+" + fmt.ms(c.start_ns - t0)), el("td", { class: "num" }, fmt.ms(c.end_ns - c.start_ns)),
        el("td", { class: "num" }, held === null ? "–" : held.toFixed(1) + " ms"),
        el("td", { class: "num" }, c.policy_version ?? "–"),
        el("td", { class: "num" }, c.prompt_tokens ?? "–", c.prompt_ref_seq !== null ? [" (ref ", callRef(c.prompt_ref_seq), ")"] : null),
        el("td", { class: "num" }, c.completion_tokens ?? "–"),
        el("td", {}, visible(c.finish_reason)), el("td", {}, visible(c.end_reason)),
        el("td", { class: "id" }, attribution(c) || "–"), el("td", {}, unreadFields(c)), el("td", {}, where),
        el("td", { class: "num" }, c.reward === null ? "–" : fmt.num(c.reward)));
    })));
}

// The call tree: each call under the call whose full sequence its prompt extends (assembly's
// `parent`); without parents (an older assembly) the calls are listed in order.
function callTree(placements, breaks) {
  const children = new Map();
  const roots = [];
  const known = new Set(placements.map((p) => p.call_seq));
  for (const p of placements) {
    const parent = p.parent;
    if (parent === null || parent === undefined || !known.has(parent)) roots.push(p);
    else { if (!children.has(parent)) children.set(parent, []); children.get(parent).push(p); }
  }
  const node = (p, depth) => el("li", {},
    callRef(p.call_seq, "call "),
    p.sample !== null ? el("span", { class: "tag" + (p.merged ? " merged" : "") }, (p.merged ? "merged → sample " : "sample ") + p.sample) : null,
    p.start && !p.merged ? el("span", { class: "tag" }, visible(p.start)) : null,
    p.agent_id ? el("span", { class: "tag", title: "the agent the harness declared" }, "agent " + visible(p.agent_id)) : null,
    p.origin ? el("span", { class: "tag" }, visible(p.origin)) : null,
    p.declared ? el("span", { class: "tag problem", title: "the prefix-built tree disagrees with the declared agents" }, "declared tree: " + visible(p.declared)) : null,
    p.policy_version >= 0 ? el("span", { class: "tag" }, "v" + p.policy_version) : null,
    p.problem ? el("span", { class: "tag problem" }, visible(p.problem)) : null,
    breaks.has(p.call_seq) ? el("span", { class: "tag break" }, "merge break: " + visible(breaks.get(p.call_seq).kind)) : null,
    children.has(p.call_seq) && depth < 500 ? el("ul", {}, children.get(p.call_seq).map((q) => node(q, depth + 1))) : null);
  return el("div", { class: "tree" }, el("ul", {}, roots.map((p) => node(p, 0))));
}

function breaksTable(failures) {
  return el("table", { id: "breaks" },
    el("thead", {}, el("tr", {}, ["call", "after call", "class", "classified by", "at token", "why"].map((h) => el("th", {}, h)))),
    el("tbody", {}, failures.map((f) => el("tr", {}, el("td", {}, callRef(f.call_seq)), el("td", {}, callRef(f.previous_call_seq)),
      el("td", { class: "bad" }, visible(f.kind)), el("td", {}, visible(f.classified_by)), el("td", { class: "num" }, f.position),
      el("td", { class: "id" }, visible(f.detail, true))))));
}

function legend() {
  return el("p", { class: "legend" }, Object.entries(ROLES).map(([code, name]) => el("span", { class: "r-" + code }, name)),
    el("span", { class: "boundary" }, "call N"), " hover a token for its policy version and logprob");
}

function sampleView(sample, placements, breaks, decoded, params) {
  const markers = new Map();
  for (const b of sample.boundaries) {
    const label = b.completion ? "call " + callNumber(b.call_seq) + " ▸" : "context before call " + callNumber(b.call_seq);
    if (!markers.has(b.position)) markers.set(b.position, []);
    markers.get(b.position).push([label, b.call_seq]);
  }
  const rewards = new Map((sample.token_rewards || []).map(([i, v]) => [i, v]));
  const body = el("div", { class: "tokens" + (decoded ? "" : " ids") });
  const fragment = document.createDocumentFragment();
  const n = sample.ids.length;
  for (let i = 0; i < n; i++) {
    if (markers.has(i)) for (const [label, seq] of markers.get(i)) fragment.append(el("span", { class: "boundary", title: seqTip(seq) }, label));
    const role = sample.roles[i];
    const version = sample.versions[i];
    const lp = sample.logprobs[i];
    let tip = `#${i + (sample.offset || 0)} · token ${sample.ids[i]} · ${ROLES[role]}`;
    if (version >= 0) tip += ` · policy v${version}`;
    if (role === "c" && lp !== null) tip += ` · logprob ${lp}`;
    if (role === "c" && lp === null) tip += " · engine logprob missing (re-scored or not trained)";
    const delta = sample.abs_delta ? sample.abs_delta[i] : null;
    if (delta !== null && delta !== undefined) tip += ` · trainer ${sample.trainer_logprobs[i]} · |Δ| ${delta}`;
    if (rewards.has(i)) tip += ` · per-call reward ${rewards.get(i)}`;
    const token = document.createElement("span");
    token.className = "tok r-" + role;
    if (delta !== null && delta !== undefined) {  // hovering the tokens colours them by |Δ| (0.5 nats: full)
      token.classList.add("agr");
      token.style.setProperty("--d", Math.min(1, delta / 0.5).toFixed(3));
    }
    token.title = tip;
    token.textContent = visible(sample.text[i], true);
    fragment.append(token);
  }
  body.append(fragment);
  const first = sample.call_seqs[0];
  const versions = [...new Set(sample.versions.filter((v) => v >= 0))].sort((a, b) => a - b);
  const failure = breaks.get(first);
  return el("div", { class: "sample" },
    failure ? el("div", { class: "mergebreak" }, el("b", {}, "merge break (" + visible(failure.kind) + ")"),
      ` before call ${callNumber(failure.call_seq)}: its prompt does not extend call ${callNumber(failure.previous_call_seq)}'s sequence` +
      ` (first difference at token ${failure.position}; classified by ${visible(failure.classified_by)}). ` + visible(failure.detail)) : null,
    el("h3", {}, `Sample ${sample.index}: calls ${sample.call_seqs.map(callNumber).join(", ")} · ${sample.length ?? n} tokens · ${sample.trained_tokens} trained · policy versions ${versions.join(", ") || "–"}`),
    tokenPager(sample, params),
    agreementLine(sample),
    body);
}

function agreementLine(sample) {
  // engine vs trainer logprob of the trained tokens (the trainer's under the weights that trained them)
  const a = sample.agreement;
  const parts = [];
  const fmt = (x) => x.toExponential(1);
  if (a && a.lag0_tokens) parts.push(`lag 0: mean |Δ| ${fmt(a.lag0_mean_abs_delta)}, max ${fmt(a.lag0_max_abs_delta)} over ${a.lag0_tokens} tokens`);
  if (a && a.stale_tokens) parts.push(`stale: mean |Δ| ${fmt(a.stale_mean_abs_delta)} over ${a.stale_tokens} tokens`);
  if (sample.logprob_missing) parts.push(`${sample.logprob_missing} tokens without an engine logprob`);
  if (!parts.length) return null;
  return el("p", { class: "agreement" }, (a ? `Engine vs trainer (step ${a.step}, v${a.trained_version}): ` : "") +
    parts.join(" · ") + (a ? " · hover the tokens to colour them by |Δ|" : ""));
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", route);
