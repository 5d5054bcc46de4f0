// breakerd's status page. Read-only: it polls /v1/circuits (every page),
// /v1/events and, for the selected circuit, /v1/circuits/{name}, and keeps
// the rejection rates and the charts' history in the browser.
//
// Every string from the daemon is put into the page as text (textContent,
// input values, SVG text nodes), never parsed as HTML: names, targets and
// workload names can hold any character.
"use strict";

const POLL_MS = 2000; // between polls, 5 s with more than SLOW_ABOVE circuits
const SLOW_ABOVE = 2000;
const PAGE_LIMIT = 1000; // circuits a request asks for (the API's maximum)
const MAX_PAGES = 20; // at most 20,000 circuits read per poll
const ROWS = 50; // table rows per page
const HISTORY_MS = 10 * 60 * 1000; // charts' longest span
const CHART_MIN_MS = 60 * 1000; // charts' shortest span
const RECENT_MS = 5 * 60 * 1000; // a circuit changed this recently is charted
const MAX_CHARTS = 12;
const EVENTS_SHOWN = 50;
const MAX_EVENTS = 1000; // transitions kept, across daemon restarts
const STATE_ORDER = { open: 0, forced_open: 1, fleet_open: 2, half_open: 3, forced_closed: 4, disabled: 5, closed: 6 };

const ui = {
  circuits: [], // the last poll's circuits
  truncated: false, // more than MAX_PAGES pages
  events: [],
  prev: new Map(), // name -> {rejected, t}: the previous poll's counter
  rate: new Map(), // name -> rejections per second between the last two polls
  history: new Map(), // name -> [{t, fr, rate}] for charted circuits
  lastState: new Map(), // name -> state seen at the previous poll
  changed: new Map(), // name -> time (ms) it was last seen changing state
  page: 0,
  selected: null,
  skew: 0, // server clock minus browser clock, from the Date header (ms)
  token: sessionStorage.getItem("breakerd-token") || "",
};

// el makes an element with text children only: strings become text nodes.
function el(tag, cls, ...children) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function pct(x) { return (100 * (x || 0)).toFixed(0) + "%"; }

function duration(ms) {
  if (ms <= 0) return "0s";
  const s = Math.round(ms / 1000);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s / 60) % 60).padStart(2, "0") + "m";
}

function now() { return Date.now() + ui.skew; }

// workloads returns the workload names of a circuit or a transition when
// the daemon reports them (workloads, workload or workload_class), else [].
function workloads(c) {
  const v = c.workloads ?? c.workload ?? c.workload_class;
  if (v == null || v === "") return [];
  const list = Array.isArray(v) ? v : [v];
  return list.map((w) => (typeof w === "object" && w !== null ? (w.name ?? JSON.stringify(w)) : String(w)));
}

// pods returns the pods ("namespace/name") whose connections to the
// circuit failed most recently, where the daemon knows them.
function pods(c) {
  return Array.isArray(c.failed_pods) ? c.failed_pods.map(String) : [];
}

// rejectedBy returns who the circuit rejected, most first (pods, or
// cgroups that are no known pod's): "name: count" for the open circuit's
// rejections, "name: count by the bulkhead" for its bulkhead's, "name:
// count by the slow start" for its ramp's after recovery, the first kind
// followed by the others in brackets when there are several ("name: 2
// (and 1 by the bulkhead)"); and "+N more" when the API listed only some.
function rejectedBy(c) {
  const list = Array.isArray(c.rejected_by) ? c.rejected_by : [];
  const out = list.map((r) => {
    const name = String(r.pod || r.cgroup || "(gone)");
    const open = Number(r.rejected || r.shadow_rejected || 0);
    const bulk = Number(r.bulkhead_rejected || r.bulkhead_shadow_rejected || 0);
    const ramp = Number(r.slow_start_rejected || r.slow_start_shadow_rejected || 0);
    const kinds = [];
    if (open || (!bulk && !ramp)) kinds.push(String(open));
    if (bulk) kinds.push(bulk + " by the bulkhead");
    if (ramp) kinds.push(ramp + " by the slow start");
    if (kinds.length === 1) return name + ": " + kinds[0];
    return name + ": " + kinds[0] + " (and " + kinds.slice(1).join(", ") + ")";
  });
  const more = Number(c.rejected_by_total || 0) - list.length;
  if (more > 0) out.push("+" + more + " more");
  return out;
}

function workloadCell(c) {
  const td = el("td", "wrap workloads", workloads(c).join(", ") || "-");
  const p = pods(c);
  if (p.length) td.append(el("div", "hint pods", "pods with failures: " + p.join(", ")));
  const r = rejectedBy(c);
  if (r.length) td.append(el("div", "hint rejected-by", "rejected: " + r.join(", ")));
  return td;
}

// limitOf is the limit the kernel enforces for key: an adaptive limit's
// current value ("what" then names its algorithm), else the option's.
function limitOf(c, key, what) {
  const a = (c.adaptive_limits || []).find((l) => l.kind === key);
  if (a) return { max: a.limit, what: what + " (" + a.algorithm + ")" };
  const o = (c.options || {})[key];
  return { max: typeof o === "number" ? o : 0, what: what };
}

function bulkhead(c) {
  const parts = [];
  const conns = limitOf(c, "max_connections", "conns");
  const connecting = limitOf(c, "max_connecting", "connecting");
  if (conns.max > 0) parts.push({ used: c.connections || 0, max: conns.max, what: conns.what });
  if (connecting.max > 0) parts.push({ used: c.connecting || 0, max: connecting.max, what: connecting.what });
  return parts;
}

function bulkheadUse(c) {
  return Math.max(0, ...bulkhead(c).map((p) => p.used / p.max));
}

class HTTPError extends Error {
  constructor(status, msg) { super(msg); this.status = status; }
}

async function getJSON(path) {
  const headers = { Accept: "application/json" };
  if (ui.token) headers.Authorization = "Bearer " + ui.token;
  const resp = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
  const date = resp.headers.get("Date");
  if (date) {
    const server = Date.parse(date);
    if (!Number.isNaN(server)) ui.skew = server - Date.now();
  }
  if (!resp.ok) {
    let msg = resp.statusText;
    try { msg = (await resp.json()).error || msg; } catch (_) { /* not JSON */ }
    throw new HTTPError(resp.status, msg);
  }
  return { body: await resp.json(), link: resp.headers.get("Link") };
}

function nextPage(link) {
  if (!link) return "";
  const m = /<([^>]*)>\s*;\s*rel="next"/.exec(link);
  return m && m[1].startsWith("/v1/circuits?") ? m[1] : "";
}

async function fetchCircuits() {
  const all = [];
  let path = "/v1/circuits?limit=" + PAGE_LIMIT;
  let pages = 0;
  while (path && pages < MAX_PAGES) {
    const { body, link } = await getJSON(path);
    all.push(...body);
    path = nextPage(link);
    pages++;
  }
  return { circuits: all, truncated: path !== "" };
}

// mergeEvents adds the transitions of a poll to those already seen, so a
// daemon restart (which starts its list anew) does not wipe them from the
// page; at most MAX_EVENTS are kept, oldest first.
function mergeEvents(seen, polled) {
  const key = (e) => e.time + "\u0000" + e.circuit + "\u0000" + e.to;
  const all = new Map(seen.map((e) => [key(e), e]));
  for (const e of polled) all.set(key(e), e);
  return [...all.values()].sort((a, b) => Date.parse(a.time) - Date.parse(b.time)).slice(-MAX_EVENTS);
}

// observe updates rates, state changes and the charts' history.
function observe(circuits, t) {
  const seen = new Set();
  for (const c of circuits) {
    seen.add(c.name);
    const p = ui.prev.get(c.name);
    // A counter that went down was reset (a reused circuit id): no rate
    // until the next poll.
    ui.rate.set(c.name, p && t > p.t && c.rejected >= p.rejected ? (c.rejected - p.rejected) / ((t - p.t) / 1000) : 0);
    ui.prev.set(c.name, { rejected: c.rejected, t });
    const was = ui.lastState.get(c.name);
    if (was !== undefined && was !== c.state) ui.changed.set(c.name, t);
    ui.lastState.set(c.name, c.state);
  }
  for (const m of [ui.prev, ui.rate, ui.lastState, ui.changed, ui.history]) {
    for (const name of m.keys()) if (!seen.has(name)) m.delete(name);
  }
  for (const e of ui.events) {
    const et = Date.parse(e.time);
    if (seen.has(e.circuit) && !Number.isNaN(et) && et > (ui.changed.get(e.circuit) || 0)) ui.changed.set(e.circuit, et);
  }
  for (const c of circuits) {
    if (!charted(c, t)) continue;
    let h = ui.history.get(c.name);
    if (!h) ui.history.set(c.name, (h = []));
    h.push({ t, fr: c.failure_rate || 0, rate: ui.rate.get(c.name) || 0 });
    while (h.length && h[0].t < t - HISTORY_MS) h.shift();
  }
}

function charted(c, t) {
  return c.state !== "closed" || t - (ui.changed.get(c.name) || 0) < RECENT_MS;
}

function filters() {
  return {
    q: document.getElementById("filter").value.trim().toLowerCase(),
    state: document.getElementById("state").value,
    sort: document.getElementById("sort").value,
  };
}

function matches(c, f) {
  if (f.state === "!closed" ? c.state === "closed" : f.state && c.state !== f.state) return false;
  if (!f.q) return true;
  return [c.name, c.target, c.scope, ...workloads(c), ...pods(c), ...rejectedBy(c)].some((s) => String(s).toLowerCase().includes(f.q));
}

const sorters = {
  state: (a, b) => (STATE_ORDER[a.state] ?? 9) - (STATE_ORDER[b.state] ?? 9) || b.failure_rate - a.failure_rate,
  name: () => 0,
  failure: (a, b) => b.failure_rate - a.failure_rate,
  slow: (a, b) => b.slow_rate - a.slow_rate,
  calls: (a, b) => b.calls - a.calls,
  rejected: (a, b) => b.rejected - a.rejected,
  rate: (a, b) => (ui.rate.get(b.name) || 0) - (ui.rate.get(a.name) || 0),
  bulkhead: (a, b) => bulkheadUse(b) - bulkheadUse(a),
};

function byName(a, b) { return a.name < b.name ? -1 : a.name > b.name ? 1 : 0; }

function renderSummary() {
  const counts = {};
  let rate = 0;
  for (const c of ui.circuits) {
    counts[c.state] = (counts[c.state] || 0) + 1;
    rate += ui.rate.get(c.name) || 0;
  }
  const box = document.getElementById("summary");
  const parts = [el("span", "", el("span", "count", ui.circuits.length), " circuits" + (ui.truncated ? " (first " + ui.circuits.length + " only)" : ""))];
  for (const s of Object.keys(STATE_ORDER)) {
    if (counts[s]) parts.push(el("span", "", el("span", "state state-" + s, s), " ", el("span", "count", counts[s])));
  }
  parts.push(el("span", "", "rejecting ", el("span", "count", rate.toFixed(1)), "/s"));
  box.replaceChildren(...parts);
}

function bulkheadCell(c) {
  const parts = bulkhead(c);
  if (!parts.length) return el("td", "", "-");
  const td = el("td", "");
  for (const p of parts) {
    const bar = el("span", p.used >= p.max ? "bar full" : "bar", el("span", ""));
    bar.firstChild.style.width = Math.min(100, (100 * p.used) / p.max).toFixed(0) + "%";
    td.append(bar, p.used + "/" + p.max + " " + p.what + " ");
  }
  if (c.bulkhead_rejected) td.append("(" + c.bulkhead_rejected + " rejected)");
  return td;
}

function renderTable() {
  const f = filters();
  const list = ui.circuits.filter((c) => matches(c, f));
  list.sort((a, b) => sorters[f.sort](a, b) || byName(a, b));
  const pages = Math.max(1, Math.ceil(list.length / ROWS));
  ui.page = Math.min(ui.page, pages - 1);
  const shown = list.slice(ui.page * ROWS, (ui.page + 1) * ROWS);
  const t = now();
  const rows = shown.map((c) => {
    const open = c.open_until ? Date.parse(c.open_until) - t : NaN;
    const tr = el("tr", "row-" + c.state,
      el("td", "", el("span", "state state-" + c.state, c.state),
        c.state === "fleet_open" ? " open by the fleet: " + c.fleet_nodes + " nodes" : "",
        c.slow_start ? " ramping: " + pct(c.slow_start.share) + " admitted" : "",
        c.redirected ? " to fallback: " + c.redirected : ""),
      el("td", "name", c.name),
      el("td", "wrap", c.target),
      el("td", "", c.scope),
      el("td", "num", pct(c.failure_rate)),
      el("td", "num", pct(c.slow_rate)),
      el("td", "num", c.calls),
      el("td", "num", Number.isNaN(open) ? "-" : duration(open)),
      el("td", "num rejected", c.rejected),
      el("td", "num rate", (ui.rate.get(c.name) || 0).toFixed(1)),
      bulkheadCell(c),
      workloadCell(c));
    tr.dataset.name = c.name; // a dataset value is an attribute's text, never markup
    if (c.name === ui.selected) tr.classList.add("selected");
    tr.addEventListener("click", () => select(c.name));
    return tr;
  });
  const body = document.getElementById("rows");
  if (!rows.length) {
    const why = f.q ? "no circuit matches “" + document.getElementById("filter").value.trim() + "”" : ui.circuits.length ? "no circuit in this state" : "no circuits yet";
    const td = el("td", "empty", why);
    td.colSpan = 12;
    rows.push(el("tr", "", td));
  }
  body.replaceChildren(...rows);
  document.getElementById("matched").textContent = list.length + " of " + ui.circuits.length + " shown by filter";
  document.getElementById("pageinfo").textContent = list.length
    ? "rows " + (ui.page * ROWS + 1) + "–" + (ui.page * ROWS + shown.length) + " of " + list.length + " (page " + (ui.page + 1) + " of " + pages + ")"
    : "";
  document.getElementById("prev").disabled = ui.page === 0;
  document.getElementById("next").disabled = ui.page >= pages - 1;
  for (const th of document.querySelectorAll("th[data-sort]")) th.classList.toggle("sorted", th.dataset.sort === f.sort);
}

// chart draws one circuit's failure ratio (0–100%, red) and rejections per
// second (blue, scaled to the largest) since its first point, over at least
// a minute and at most HISTORY_MS.
function chart(c, h) {
  const W = 280, H = 70, t1 = now();
  const t0 = Math.max(t1 - HISTORY_MS, Math.min(h.length ? h[0].t : t1, t1 - CHART_MIN_MS));
  const span = t1 - t0;
  const box = el("div", "chart");
  box.dataset.name = c.name;
  box.append(el("div", "title", c.name), el("div", "", el("span", "state state-" + c.state, c.state)));
  const s = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  s.append(svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#fafafa", stroke: "#ddd" }));
  const maxRate = Math.max(1, ...h.map((p) => p.rate));
  const x = (t) => ((t - t0) / span) * W;
  const line = (f) => h.map((p) => x(p.t).toFixed(1) + "," + (H - 2 - f(p) * (H - 4)).toFixed(1)).join(" ");
  if (h.length) {
    s.append(svg("polyline", { points: line((p) => p.rate / maxRate), fill: "none", stroke: "#1565c0", "stroke-width": 1.5, class: "rej" }));
    s.append(svg("polyline", { points: line((p) => p.fr), fill: "none", stroke: "#c62828", "stroke-width": 1.5, class: "fr" }));
  }
  const last = h[h.length - 1] || { fr: 0, rate: 0 };
  box.append(s, el("div", "legend", el("span", "fr", "failure " + pct(last.fr)), " · ",
    el("span", "rj", "rejected " + last.rate.toFixed(1) + "/s (max " + maxRate.toFixed(1) + ")"), " · last " + duration(span)));
  return box;
}

function renderCharts() {
  const t = now();
  const list = ui.circuits.filter((c) => charted(c, t) && ui.history.has(c.name));
  list.sort((a, b) => sorters.state(a, b) || byName(a, b));
  const boxes = list.slice(0, MAX_CHARTS).map((c) => chart(c, ui.history.get(c.name)));
  if (!boxes.length) boxes.push(el("div", "empty", "no circuit is open or changed in the last 5 minutes"));
  else if (list.length > MAX_CHARTS) boxes.push(el("div", "empty", "and " + (list.length - MAX_CHARTS) + " more (filter the table)"));
  document.getElementById("charts").replaceChildren(...boxes);
}

function renderEvents() {
  const f = filters();
  const list = ui.events.filter((e) => !f.q || [e.circuit, e.target, ...workloads(e)].some((s) => String(s).toLowerCase().includes(f.q)));
  const rows = list.slice(-EVENTS_SHOWN).reverse().map((e) => el("tr", "",
    el("td", "", new Date(e.time).toLocaleTimeString()),
    el("td", "name", e.circuit, ...workloads(e).map((w) => el("span", "hint", " (" + w + ")"))),
    el("td", "", el("span", "state state-" + e.from, e.from)),
    el("td", "", el("span", "state state-" + e.to, e.to)),
    el("td", "wrap", e.reason),
    el("td", "num", pct(e.failure_rate)),
    el("td", "num", pct(e.slow_rate)),
    el("td", "num", e.calls)));
  if (!rows.length) {
    const td = el("td", "empty", "no transitions yet");
    td.colSpan = 8;
    rows.push(el("tr", "", td));
  }
  document.getElementById("event-rows").replaceChildren(...rows);
}

function select(name) {
  ui.selected = name;
  renderTable();
  pollDetail();
}

async function pollDetail() {
  const box = document.getElementById("detail");
  if (ui.selected === null) { box.hidden = true; return; }
  const name = ui.selected;
  let c;
  try {
    ({ body: c } = await getJSON("/v1/circuits/" + encodeURIComponent(name)));
  } catch (err) {
    if (name !== ui.selected) return;
    document.getElementById("detail-name").textContent = name;
    document.getElementById("detail-body").replaceChildren(el("dt", "", "error"), el("dd", "", err.message));
    box.hidden = false;
    return;
  }
  if (name !== ui.selected) return;
  document.getElementById("detail-name").textContent = c.name;
  const items = [
    ["state", c.state], ["target", c.target], ["scope", c.scope], ["workload", workloads(c).join(", ") || "-"], ["pods with failures", pods(c).join(", ") || "-"], ["rejected", rejectedBy(c).join(", ") || "-"],
    ["failure ratio", pct(c.failure_rate) + " (" + c.failures + " of " + c.calls + ")"],
    ["slow ratio", pct(c.slow_rate) + " (" + c.slow + " of " + c.calls + ")"],
    ["consecutive failures", c.consecutive_failures], ["trip", c.trip],
    ["open until", c.open_until || "-"], ["probes left", c.probes_left ?? "-"],
    ["slow start", c.slow_start ? pct(c.slow_start.share) + " of new connects admitted, all from " + c.slow_start.until : "-"],
    ["slow-start rejections", c.slow_start_rejected || 0],
    ["kernel rejections", c.rejected], ["shadow rejections", c.shadow_rejected], ["bulkhead rejections", c.bulkhead_rejected],
    ["fallback", c.fallback ? c.fallback + " (" + (c.redirected || 0) + " connects sent there)" : "-"],
    ["connections / connecting", c.connections + " / " + c.connecting],
    ["destinations (" + c.destinations_total + ")", (c.destinations || []).join(" ")],
    ["circuit id", c.circuit_id],
  ];
  for (const a of c.adaptive_limits || []) {
    items.push([a.kind + " (adaptive)", a.limit + " in [" + a.min + ", " + a.max + "], " + a.algorithm + ", latency " +
      (1000 * a.latency_seconds).toFixed(1) + " ms, " + a.changes + " moves"]);
  }
  for (const [k, v] of Object.entries(c.options || {}).sort()) items.push([k, typeof v === "object" ? JSON.stringify(v) : v]);
  document.getElementById("detail-body").replaceChildren(...items.flatMap(([k, v]) => [el("dt", "", k), el("dd", "", v)]));
  box.hidden = false;
}

function setConn(text, error) {
  const c = document.getElementById("conn");
  c.textContent = text;
  c.classList.toggle("error", !!error);
}

function render() {
  renderSummary();
  renderTable();
  renderCharts();
  renderEvents();
}

async function poll() {
  if (document.getElementById("paused").checked) return;
  try {
    const [{ circuits, truncated }, { body: events }] = await Promise.all([fetchCircuits(), getJSON("/v1/events")]);
    ui.events = mergeEvents(ui.events, events);
    ui.truncated = truncated;
    ui.circuits = circuits;
    observe(circuits, now());
    document.getElementById("auth").hidden = true;
    render();
    pollDetail();
    setConn("updated " + new Date().toLocaleTimeString(), false);
  } catch (err) {
    if (err instanceof HTTPError && (err.status === 403 || err.status === 401)) {
      document.getElementById("auth").hidden = false;
      setConn("not allowed: " + err.message, true);
    } else if (err instanceof HTTPError) {
      setConn("breakerd answered " + err.status + ": " + err.message, true);
    } else {
      setConn("cannot reach breakerd: " + err.message, true);
    }
  }
}

function saveHash() {
  const f = filters();
  const p = new URLSearchParams();
  if (f.q) p.set("q", document.getElementById("filter").value.trim());
  if (f.state) p.set("state", f.state);
  if (f.sort !== "state") p.set("sort", f.sort);
  history.replaceState(null, "", p.toString() ? "#" + p.toString() : location.pathname);
}

// loadHash takes the filter, state and sort from the address (#q=…&state=…&sort=…),
// so a view can be shared as a link. The values go into form controls only.
function loadHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  document.getElementById("filter").value = p.get("q") || "";
  const st = document.getElementById("state");
  st.value = p.get("state") || "";
  if (st.selectedIndex < 0) st.value = "";
  const so = document.getElementById("sort");
  so.value = p.get("sort") || "state";
  if (so.selectedIndex < 0) so.value = "state";
}

function start() {
  loadHash();
  for (const id of ["filter", "state", "sort"]) {
    document.getElementById(id).addEventListener("input", () => { ui.page = 0; saveHash(); render(); });
  }
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => { document.getElementById("sort").value = th.dataset.sort; ui.page = 0; saveHash(); render(); });
  }
  window.addEventListener("hashchange", () => { loadHash(); render(); });
  document.getElementById("prev").addEventListener("click", () => { ui.page = Math.max(0, ui.page - 1); renderTable(); });
  document.getElementById("next").addEventListener("click", () => { ui.page++; renderTable(); });
  document.getElementById("detail-close").addEventListener("click", () => { ui.selected = null; document.getElementById("detail").hidden = true; renderTable(); });
  document.getElementById("auth-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    ui.token = document.getElementById("token").value.trim();
    sessionStorage.setItem("breakerd-token", ui.token);
    poll();
  });
  const loop = async () => {
    await poll();
    setTimeout(loop, ui.circuits.length > SLOW_ABOVE ? 2.5 * POLL_MS : POLL_MS);
  };
  loop();
}

document.addEventListener("DOMContentLoaded", start);
