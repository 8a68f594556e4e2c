// SeamlessFlow status page: polls /ui/api/status every 2 s and draws cards, a timeline (inline
// SVG) and tables. Plain JS, no build step, nothing loaded from elsewhere (the page's CSP says so).
"use strict";

const COLORS = {
  rollout: "#2e9e5b", train: "#3867d6", publish: "#17a2b8", switch: "#f39c12", update: "#8e44ad",
  idle: "#f1a9a0", paused: "#e67e22", vacated: "#9aa5b1", sleeping: "#4a5568", stopped: "#555555",
};
const MEANING = {
  rollout: "rollout (generating)", train: "train (computing)", publish: "publishing weights",
  switch: "switching / at the gate", update: "loading weights", idle: "idle: a bubble",
  paused: "paused", vacated: "vacated", sleeping: "asleep",
};
const SVGNS = "http://www.w3.org/2000/svg";
const POLL_MS = 2000;
let windowS = 120;
let last = null;
let timer = null;

function $(id) { return document.getElementById(id); }
function h(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function s(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function num(x, d = 2) { return x === null || x === undefined || Number.isNaN(Number(x)) ? "—" : Number(x).toFixed(d); }

function spark(points, key, color) {
  const vals = points.map(p => p[key]).filter(v => v !== null && v !== undefined);
  const svg = s("svg", { viewBox: "0 0 100 28", preserveAspectRatio: "none" });
  if (vals.length < 2) return svg;
  const lo = Math.min(...vals), hi = Math.max(...vals), span = hi - lo || 1;
  const xs = points.filter(p => p[key] !== null && p[key] !== undefined);
  const t0 = xs[0].t, t1 = xs[xs.length - 1].t || t0 + 1;
  const pts = xs.map(p => `${(100 * (p.t - t0) / (t1 - t0 || 1)).toFixed(2)},${(26 - 24 * (p[key] - lo) / span).toFixed(2)}`);
  svg.append(s("polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 1.5,
                             "vector-effect": "non-scaling-stroke" }));
  return svg;
}

function card(label, value, sub, sparkline) {
  const c = h("div", { class: "card" }, h("div", { class: "label" }, label), h("div", { class: "value" }, value));
  if (sparkline) c.append(sparkline);
  if (sub) c.append(h("div", { class: "sub" }, sub));
  return c;
}

function renderCards(st) {
  const ws = st.workers, serving = ws.filter(w => w.state === "serving").length;
  const running = ws.reduce((a, w) => a + w.running, 0), cap = ws.reduce((a, w) => a + w.capacity, 0);
  const versions = Object.entries(st.versions).sort((a, b) => b[0] - a[0]);
  const maxLag = ws.length ? Math.max(...ws.map(w => w.lag || 0)) : null;
  const tm = st.trainer_metrics || {}, tr = st.trainer;
  const cards = $("cards");
  cards.replaceChildren(
    card("workers serving", `${serving} / ${ws.length}`, `${running} requests running, capacity ${cap}`),
    card("weight versions served", versions.length ? versions.map(([v, ids]) => `v${v}×${ids.length}`).join("  ") : "—",
         st.newest_version === null ? "no version seen" : `newest v${st.newest_version}, workers ≤ ${maxLag} behind`),
    card("in flight", `${st.in_flight_turns} turns`, `${st.in_flight_sessions} open sessions (${st.sessions_created} created)`),
    card("turns / s", num(st.turns_per_s, 2), `${st.turns_total} turns answered`, spark(st.series, "turns_per_s", "#3867d6")),
    card("tokens / s", num(st.tokens_per_s, 0), "completion tokens, agents' turns", spark(st.series, "tokens_per_s", "#2e9e5b")),
    card("reward (agents, 60 s)", num(st.reward_mean_60s, 3),
         `${st.rewards_60s} rewards; trainer's last batch ${num(tm.reward_mean, 3)}`, spark(st.series, "reward", "#8e44ad")),
    card("staleness (trainer)", tm.staleness_mean === undefined ? "—" : `${num(tm.staleness_mean, 2)} v`,
         tm.staleness_max === undefined ? (st.trainer_metrics_error || "no trainer metrics") : `max ${num(tm.staleness_max, 0)} versions behind`,
         spark(st.series, "staleness", "#f39c12")),
    card("trainer", tr ? `${tr.state}` : "—",
         tr ? `step ${tr.step}, v${tr.version}, ${tr.ready_groups}/${tr.groups_per_step} groups ready${tr.alive ? "" : " (silent)"}` : "no TrainerStatus heard"),
  );
}

function rowsOf(st) {
  const rows = [];
  if (st.scheduler) for (const hst of st.scheduler.hosts) {
    rows.push({ id: `host:${hst.host}`, label: hst.host, sub: hst.tags.join(","), iv: hst.timeline });
  }
  const byId = Object.fromEntries(st.workers.map(w => [w.id, w]));
  for (const [id, iv] of Object.entries(st.worker_timeline)) {
    const w = byId[id];
    rows.push({ id: `worker:${id}`, label: id, sub: w ? `v${w.version} ${w.state}` : "gone", iv });
  }
  if (st.trainer_timeline.length) rows.push({ id: "trainer", label: "trainer", sub: st.trainer ? `step ${st.trainer.step}` : "", iv: st.trainer_timeline });
  return rows;
}

function renderTimeline(st) {
  const svg = $("timeline"), rows = rowsOf(st);
  const W = Math.max(svg.clientWidth || svg.parentNode.clientWidth || 800, 400);
  const L = 190, R = 80, top = 22, rowH = 24, H = top + rows.length * rowH + 6;
  const t1 = st.now, t0 = t1 - st.window, x = t => L + (W - L - R) * (t - t0) / (t1 - t0);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", H);
  const kids = [];
  for (let i = 0; i <= 6; i++) {  // time axis: seconds before now
    const t = t0 + i * st.window / 6, xx = x(t);
    kids.push(s("line", { x1: xx, x2: xx, y1: top - 4, y2: H, stroke: "#e3e6eb" }));
    kids.push(s("text", { x: xx, y: 12, "text-anchor": i === 6 ? "end" : "middle", "font-size": 11, fill: "#6b7280" },
                i === 6 ? "now" : `-${Math.round(t1 - t)}s`));
  }
  kids.push(s("text", { x: W - 6, y: 12, "text-anchor": "end", "font-size": 11, fill: "#6b7280" }, "idle %"));
  rows.forEach((r, i) => {
    const y = top + i * rowH, g = s("g", { class: "row", "data-row": r.id });
    g.append(s("rect", { x: L, y: y + 3, width: W - L - R, height: rowH - 6, fill: "#f5f6f8" }));
    let idle = 0, busy = 0;
    for (const [act, a, b] of r.iv) {
      const xa = x(Math.max(a, t0)), xb = Math.max(x(b), xa + 1);
      const rect = s("rect", { x: xa, y: y + 3, width: xb - xa, height: rowH - 6, fill: COLORS[act] || "#999", "data-activity": act });
      rect.append(s("title", {}, `${r.label}: ${MEANING[act] || act}, ${num(b - a, 1)} s`));
      g.append(rect);
      if (act === "idle") idle += b - a; else busy += b - a;
    }
    g.append(s("text", { x: 6, y: y + rowH / 2 + 4, "font-size": 12, fill: "#1d2330" }, r.label));
    g.append(s("text", { x: 120, y: y + rowH / 2 + 4, "font-size": 11, fill: "#6b7280" }, r.sub.slice(0, 14)));
    const frac = idle + busy > 0 ? 100 * idle / (idle + busy) : null;
    g.append(s("text", { x: W - 6, y: y + rowH / 2 + 4, "text-anchor": "end", "font-size": 12, fill: frac > 20 ? "#b3261e" : "#1d2330" },
               frac === null ? "—" : `${frac.toFixed(0)}%`));
    kids.push(g);
  });
  if (!rows.length) kids.push(s("text", { x: L, y: top + 16, "font-size": 13, fill: "#6b7280" }, "no worker, host or trainer heard yet"));
  svg.replaceChildren(...kids);
  svg.dataset.rows = rows.map(r => r.id).join(" ");
  $("timeline-note").textContent = st.scheduler ? `policy ${st.scheduler.policy}; hosts from the tag scheduler, workers from their heartbeats`
                                                : "workers from their heartbeats (no tag scheduler running)";
}

function renderLegend() {
  $("legend").replaceChildren(...Object.entries(MEANING).map(([k, v]) => {
    const sw = h("i"); sw.style.background = COLORS[k];
    return h("span", {}, sw, v);
  }));
}

function table(id, head, rows) {
  $(id).replaceChildren(h("tr", {}, ...head.map(c => h("th", {}, c))), ...rows.map(r => h("tr", {}, ...r.map(c => h("td", {}, c)))));
}

function render(st) {
  $("model").textContent = st.model;
  $("health").replaceChildren(...Object.entries(st.health).map(([k, v]) => {
    const d = h("span", { class: `dot ${v === "ok" ? "ok" : "down"}` }); return h("span", {}, d, `${k} ${v}`);
  }));
  renderCards(st);
  renderTimeline(st);
  table("workers", ["worker", "host", "state", "version", "behind", "running", "tokens", "heartbeat"],
        st.workers.map(w => [w.id, w.host || "—", w.activity, `v${w.version}`, w.lag ?? "—", `${w.running}/${w.capacity}`,
                             w.generated_tokens, `${num(w.age_s, 1)} s ago`]));
  $("hosts-panel").hidden = !st.scheduler;
  if (st.scheduler) {
    $("policy").textContent = `policy ${st.scheduler.policy}; ` + Object.entries(st.scheduler.counts).map(([k, v]) => `${k} ${v}`).join(", ");
    table("hosts", ["host", "tags", "mode", "target", "activity", "epoch", "health", "worker"],
          st.scheduler.hosts.map(x => [x.host, x.tags.join(","), x.mode, x.target, x.activity || "—", x.epoch,
                                       x.cordoned ? "cordoned" : (x.healthy ? "healthy" : "dead"), x.worker_id || "—"]));
  }
  const tr = st.trainer, tm = st.trainer_metrics || {};
  if (tr) {
    $("trainer").className = "";
    $("trainer").textContent = `${tr.state} · step ${tr.step} · version ${tr.version} · ${tr.ready_groups} ready / ${tr.open_groups} open groups · ` +
      `${tr.buffered_samples} buffered · last wait ${num(tr.last_wait_s, 1)} s, compute ${num(tr.last_compute_s, 1)} s` +
      (tm.loss !== undefined ? ` · loss ${num(tm.loss, 4)} · reward ${num(tm.reward_mean, 3)} · ${num(tm.tokens_per_s, 0)} train tok/s` : "");
  }
}

async function poll() {
  const updated = $("updated");
  try {
    const r = await fetch(`/ui/api/status?window=${windowS}`, { cache: "no-store", credentials: "same-origin" });
    if (r.status === 401) { location.href = "/ui"; return; }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    last = await r.json();
    render(last);
    updated.className = "muted";
    updated.textContent = `updated ${new Date(last.now * 1000).toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
  } catch (e) {
    updated.className = "error";
    updated.textContent = `not updated: ${e.message}`;
  } finally {
    clearTimeout(timer);
    timer = setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  renderLegend();
  $("window").addEventListener("change", e => { windowS = Number(e.target.value); poll(); });
  window.addEventListener("resize", () => last && renderTimeline(last));
  poll();
});
