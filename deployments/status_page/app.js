// The D-Cut status page: polls ./status and ./history (same origin, same credentials as the page) and draws
// small SVG line charts by hand, so the page needs nothing beyond this file and index.html.
"use strict";

const REFRESH_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const W = 420, H = 170, M = { left: 44, right: 8, top: 8, bottom: 28 };

function html(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  node.append(...children);
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(x, digits = 2) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (Math.abs(x) >= 100) return x.toFixed(0);
  return Number(x.toFixed(digits)).toString();
}

// About five round tick values covering [lo, hi].
function ticks(lo, hi) {
  const step0 = (hi - lo) / 4 || 1;
  const mag = 10 ** Math.floor(Math.log10(step0));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

// series: [{name, color, points: [[x, y|null], ...]}]; a null y breaks the line.
function lineChart(figure, series, { xLabel, yMin = 0, xFormat = fmt } = {}) {
  const points = series.flatMap((s) => s.points.filter((p) => p[1] !== null && p[1] !== undefined));
  const chart = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  figure.replaceChildren(html("figcaption", {}, figure.dataset.title), chart);
  figure.dataset.points = String(points.length);
  if (!points.length) {
    chart.append(svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
    return;
  }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  let [y0, y1] = [Math.min(yMin ?? Infinity, ...ys), Math.max(...ys)];
  if (y0 === y1) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const px = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
  const py = (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);
  for (const t of ticks(y0, y1)) {
    chart.append(svg("line", { class: "grid-line", x1: M.left, x2: W - M.right, y1: py(t), y2: py(t) }));
    chart.append(svg("text", { x: M.left - 4, y: py(t) + 3, "text-anchor": "end" }, fmt(t)));
  }
  for (const t of ticks(x0, x1)) {
    chart.append(svg("text", { x: px(t), y: H - M.bottom + 12, "text-anchor": "middle" }, xFormat(t)));
  }
  chart.append(svg("line", { class: "axis", x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom }));
  chart.append(svg("line", { class: "axis", x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }));
  chart.append(svg("text", { x: (W + M.left) / 2, y: H - 3, "text-anchor": "middle" }, xLabel));
  const legend = html("div", { class: "legend" });
  for (const s of series) {
    let d = "", pen = "M", last = null;
    for (const [x, y] of s.points) {
      if (y === null || y === undefined) { pen = "M"; continue; }
      d += `${pen}${px(x).toFixed(1)},${py(y).toFixed(1)}`;
      pen = "L";
      last = [x, y];
    }
    if (!last) continue;
    chart.append(svg("path", { class: "series", d, stroke: s.color, "data-series": s.name }));
    chart.append(svg("circle", { cx: px(last[0]), cy: py(last[1]), r: 2.5, fill: s.color }));
    legend.append(html("span", {}, html("i", { style: `background:${s.color}` }), s.name));
  }
  figure.append(legend);
}

// Replica ids are long; the page shows their first 8 characters everywhere.
const short = (id) => id.slice(0, 8);
// Time series: x is minutes relative to now (negative), labelled as minutes ago.
const TIME_AXIS = { xLabel: "minutes ago", xFormat: (x) => fmt(-x) };

function replicaTable(replicas, history, colorOf) {
  const cols = ["replica", "node", "model", "cost table", "batch", "queue", "keep ratio", "width", "accepted len",
    "tokens/s", "capacity tok/s", "demand tok/s", "steps", "continued", "age s"];
  const rows = replicas.map((r) => {
    const last = (history.replicas[r.replica_id] || []).at(-1) || {};
    const cells = [r.node_id ? short(r.node_id) : "–", r.model, r.cost_source ?? "off", r.batch_size, last.queued ?? "–",
      fmt(r.keep_ratio), fmt(last.drafted_width), fmt(r.acceptance.mean_accepted_length), fmt(r.load.tokens_per_s, 1),
      fmt(r.capacity_tokens_per_s, 1), fmt(r.demand_tokens_per_s, 1), r.steps ?? "–", r.load.continued_total ?? 0,
      fmt(r.age_s, 1)];
    return html("tr", {}, html("td", { class: "text replica-id", title: r.replica_id },
      html("i", { style: `display:inline-block;width:10px;height:10px;margin-right:4px;background:${colorOf(r.replica_id)}` }),
      short(r.replica_id)), ...cells.map((c) => html("td", {}, String(c))));
  });
  document.getElementById("replicas").replaceChildren(
    html("tr", {}, ...cols.map((c) => html("th", {}, c))), ...rows);
}

// A replica's start in consecutive phases (deployments.records.StartupPhases); compile and the cost table are
// parts of the engine's init, shown as figures, not as bars of their own.
const PHASES = [["process_s", "process", "#9e9e9e"], ["import_s", "imports", "#9467bd"],
  ["fingerprint_s", "fingerprint", "#17becf"], ["cost_offer_s", "table offer", "#ff7f0e"],
  ["engine_init_s", "engine init", "#1f77b4"], ["first_report_s", "first report", "#2ca02c"]];
const STARTUP_TITLES = { process: "process created → replica constructor (Ray worker, Serve, module imports)",
  imports: "the engine's library imported (vLLM)", fingerprint: "the engine's config resolved for its fingerprint",
  "table offer": "asking the controller for the cost table (and waiting for another replica's profile)",
  "engine init": "engine built until its first health check passed",
  "first report": "engine ready → first report accepted by the controller",
  "↳ compile": "of engine init: compiling, where the engine says", "↳ cost table": "of engine init: D-Cut's cost " +
  "table loaded or profiled, where the plugin says", "table from": "controller, given, cache, profiled or fallback" };
const BAR_W = 260, BAR_H = 12;

function startupTable(replicas, colorOf) {
  document.getElementById("startup-legend").replaceChildren(...PHASES.map(([, name, color]) =>
    html("span", {}, html("i", { style: `background:${color}` }), name)));
  const started = replicas.filter((r) => r.startup);
  const span = (p) => PHASES.reduce((sum, [key]) => sum + (p[key] ?? 0), 0);
  const longest = Math.max(1e-9, ...started.map((r) => span(r.startup)));
  const cols = ["replica", "phases", "total", ...PHASES.map(([, name]) => name), "↳ compile", "↳ cost table",
    "table from"];
  const rows = started.map((r) => {
    const p = r.startup;
    const bar = svg("svg", { width: BAR_W, height: BAR_H, viewBox: `0 0 ${BAR_W} ${BAR_H}` });
    let x = 0;
    for (const [key, name, color] of PHASES) {
      if (p[key] === null || p[key] === undefined) continue;
      const w = (p[key] / longest) * BAR_W;
      const rect = svg("rect", { x: x.toFixed(1), y: 0, width: Math.max(w, 0).toFixed(1), height: BAR_H, fill: color,
        "data-phase": key });
      rect.append(svg("title", {}, `${name}: ${fmt(p[key], 1)} s`));
      bar.append(rect);
      x += w;
    }
    const cells = [p.total_s === null ? `${fmt(span(p), 1)}…` : fmt(p.total_s, 1),
      ...PHASES.map(([key]) => fmt(p[key], 1)), fmt(p.compile_s, 1), fmt(p.cost_table_s, 1),
      p.cost_table_source ?? "off"];
    return html("tr", { "data-replica": r.replica_id }, html("td", { class: "text", style: "white-space:nowrap", title: r.replica_id },
      html("i", { style: `display:inline-block;width:10px;height:10px;margin-right:4px;background:${colorOf(r.replica_id)}` }),
      short(r.replica_id)), html("td", { class: "bar" }, bar), ...cells.map((c) => html("td", {}, String(c))));
  });
  document.getElementById("startup").replaceChildren(
    html("tr", {}, ...cols.map((c) => html("th", STARTUP_TITLES[c] ? { title: STARTUP_TITLES[c] } : {}, c))),
    ...(rows.length ? rows : [html("tr", {}, html("td", { class: "text", colspan: cols.length }, "no replica has reported its start yet"))]));
}

function replicaCharts(status, history, colorOf) {
  const now = Date.now() / 1000;
  const ago = (t) => (t - now) / 60;
  const ids = Object.keys(history.replicas);
  for (const key of ["batch_size", "queued", "keep_ratio", "drafted_width", "tokens_per_s"]) {
    const series = ids.map((id) => ({ name: short(id), color: colorOf(id),
      points: history.replicas[id].map((s) => [ago(s.t), s[key]]) }));
    lineChart(document.getElementById(`chart-${key}`), series, TIME_AXIS);
  }
  const acceptance = status.replicas.map((r) => ({ name: short(r.replica_id), color: colorOf(r.replica_id),
    points: (r.acceptance.per_position || []).map((a, i) => [i + 1, a]) }));
  lineChart(document.getElementById("chart-acceptance"), acceptance, { xLabel: "draft position" });
  // Per-request acceptance rate of the responses each replica served (dcut.speculation.AcceptanceHistogram),
  // every route summed: the share of its requests in each tenth of accepted / verified drafts.
  const perRequest = status.replicas.map((r) => {
    const counts = Object.values((r.request_acceptance || {}).counts || {}).reduce(
      (sum, c) => sum.map((v, i) => v + c[i]), Array(10).fill(0));
    const n = counts.reduce((a, b) => a + b, 0);
    return { name: short(r.replica_id), color: colorOf(r.replica_id),
      points: n ? counts.map((c, i) => [(i + 0.5) / 10, c / n]) : [] };
  });
  lineChart(document.getElementById("chart-request-acceptance"), perRequest,
    { xLabel: "acceptance rate (accepted / verified drafts)" });
}

function clusterCharts(status, history) {
  const now = Date.now() / 1000;
  const cluster = history.cluster.map((s) => ({ ...s, x: (s.t - now) / 60 }));
  const target = status.cluster.target_utilization;
  lineChart(document.getElementById("chart-capacity"), [
    { name: "capacity", color: COLORS[0], points: cluster.map((s) => [s.x, s.capacity_tokens_per_s]) },
    { name: `capacity x ${target} (target)`, color: COLORS[2],
      points: cluster.map((s) => [s.x, s.capacity_tokens_per_s * target]) },
    { name: "demand", color: COLORS[1], points: cluster.map((s) => [s.x, s.demand_tokens_per_s]) },
  ], TIME_AXIS);
  lineChart(document.getElementById("chart-replicas"), [
    { name: "replicas", color: COLORS[4], points: cluster.map((s) => [s.x, s.replicas]) },
  ], TIME_AXIS);
}

function scaling(log, cluster) {
  const now = document.getElementById("scaling-now");
  const suggested = `cluster: ${cluster.replicas} replicas, capacity ${fmt(cluster.capacity_tokens_per_s, 1)} tok/s, ` +
    `demand ${fmt(cluster.demand_tokens_per_s, 1)} tok/s (utilisation ${fmt(100 * cluster.utilization, 0)}%, ` +
    `target ${fmt(100 * cluster.target_utilization, 0)}%)`;
  const latest = log && log.latest;
  now.replaceChildren(html("div", {}, suggested),
    html("div", { id: "scaling-latest" }, latest ? `autoscaler now: ${latest.reason}` : "autoscaler: no decision yet"));
  const cols = ["time", "replicas", "desired", "within bounds", "rule", "reason"];
  const rows = (log ? [...log.changes].reverse() : []).map((d) => html("tr", {},
    html("td", {}, new Date(d.at * 1000).toLocaleTimeString()), html("td", {}, String(d.replicas)),
    html("td", {}, String(d.desired)), html("td", {}, String(d.bounded)), html("td", { class: "text" }, d.rule),
    html("td", { class: "text" }, d.reason)));
  document.getElementById("decisions").replaceChildren(html("tr", {}, ...cols.map((c) => html("th", {}, c))), ...rows);
}

// One figure per table and part: verify cost by tokens, its growth with context (where profiled), drafter cost
// by width; one line per batch size.
function costTables(tables) {
  const box = document.getElementById("cost-tables");
  const figures = [];
  for (const [key, { table, from_replicas }] of Object.entries(tables)) {
    const fp = table.fingerprint;
    const name = `${fp.model.split("/").pop()}${fp.drafter ? " + " + fp.drafter.split("/").pop() : ""}, K=${fp.k}`;
    const sizes = Object.keys(table.points).sort((a, b) => a - b);
    const draftSizes = Object.keys(table.draft || {}).sort((a, b) => a - b);
    const every = [...new Set([...sizes, ...draftSizes])];
    const color = (bs) => COLORS[every.indexOf(bs) % COLORS.length];
    const verify = html("figure", { class: "chart cost-table", "data-fingerprint": key,
      "data-title": `Verify cost (ms) vs verify tokens — ${name} (${from_replicas.length} replicas)` });
    lineChart(verify, sizes.map((bs) => ({ name: `bs ${bs}`, color: color(bs),
      points: table.points[bs].map(([tokens, ms]) => [tokens, ms + ((table.offsets[bs] || [0])[0])]) })),
    { xLabel: "verify tokens per step" });
    figures.push(verify);
    const ctx = table.context;  // dcut.context_cost: how the verify cost grows with the requests' mean context
    if (ctx && Object.keys(ctx.slope_ms).length) {
      const lengths = [...new Set([ctx.profiled_at, ...ctx.lengths])].sort((a, b) => a - b);
      const context = html("figure", { class: "chart cost-context", "data-fingerprint": key,
        "data-title": `Full-width verify cost (ms) vs mean context — ${name} (rows profiled at ${ctx.profiled_at})` });
      lineChart(context, sizes.filter((bs) => bs in ctx.slope_ms).map((bs) => {
        const [tokens, ms] = table.points[bs].at(-1);
        const base = ms + ((table.offsets[bs] || [0])[0]);
        const perContext = ((ctx.step_slope_ms || {})[bs] || 0) + ctx.slope_ms[bs] * tokens;
        return { name: `bs ${bs}`, color: color(bs),
          points: lengths.map((c) => [c, Math.max(base + (c - ctx.profiled_at) * perContext, 0.5 * base)]) };
      }), { xLabel: "mean context length (tokens)" });
      figures.push(context);
    }
    if (!draftSizes.length) continue;
    const draft = html("figure", { class: "chart cost-table", "data-fingerprint": key,
      "data-title": `Drafter cost (ms) vs drafted width — ${name}` });
    lineChart(draft, draftSizes.map((bs) => ({ name: `bs ${bs}`, color: color(bs),
      points: Object.entries(table.draft[bs]).map(([w, [ms]]) => [Number(w), ms]).sort((a, b) => a[0] - b[0]) })),
    { xLabel: "drafted width" });
    figures.push(draft);
  }
  box.replaceChildren(...(figures.length ? figures : [html("p", {}, "no cost table yet")]));
}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function refresh() {
  const note = document.getElementById("note");
  try {
    const [status, history] = await Promise.all([getJSON("status"), getJSON("history")]);
    const ids = [...new Set([...status.replicas.map((r) => r.replica_id), ...Object.keys(history.replicas)])].sort();
    const colorOf = (id) => COLORS[ids.indexOf(id) % COLORS.length];
    replicaTable(status.replicas, history, colorOf);
    startupTable(status.replicas, colorOf);
    replicaCharts(status, history, colorOf);
    clusterCharts(status, history);
    scaling(status.autoscaling, status.cluster);
    costTables(status.cost_tables);
    note.className = "";
    note.textContent = `${status.replicas.length} replicas · last ${fmt(history.span_s / 60, 1)} min · ` +
      `updated ${new Date().toLocaleTimeString()} · every ${REFRESH_MS / 1000} s`;
  } catch (e) {
    note.className = "error";
    note.textContent = `refresh failed: ${e.message}`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
