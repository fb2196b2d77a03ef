// The asyncrpc job dashboard (dashboard.html): polls /api/job about once a second and
// draws what it says.  Plain JavaScript, no library, nothing fetched from elsewhere.
//
// /api/job is {"time": seconds, "workers": [report, ...]}; a report (see
// asyncrpc/observability/server.py, worker_report) has name, rank, host, state, alive,
// error (when lost), functions {fn: {made|served: {calls, errors, p50_ms, p99_ms}}},
// bytes {transport: {sent, received}}, in_flight, owner_rrefs, user_rrefs,
// autograd_contexts and dead_peers.  Call rates are computed here, from the totals of
// successive polls.  A lost worker keeps the figures of its last report, greyed out.
//
// What a test can read: <body data-polls="N">; one <tr data-worker="NAME"
// data-alive="true|false"> per worker in #workers, its cells data-field="..."; one
// <tr data-worker data-function data-side> per function in #functions; totals in
// #total-calls, #call-rate, #total-errors, #total-in-flight, #workers-alive.

"use strict";

const POLL_MS = 1000;
const HISTORY_S = 60;
const FETCH_TIMEOUT_MS = 5000;
// The dashboard's own calls (it asks every worker for a report each second; REPORT_LABEL
// in server.py): left out of the counts unless the "count the dashboard's own calls" box
// is ticked.  (The reports' in_flight already leaves them out.)
const OWN_FUNCTION = "dashboard report";

const state = {
  lastSeen: {},   // worker name -> its last report from a live worker
  previous: null, // {time, calls: {name: total}} of the previous poll
  history: [],    // [{time, rate}] job-wide calls per second
  polls: 0,
};

// -- numbers --------------------------------------------------------------------------

/** Whether a function's figures count (the dashboard's own calls are left out by default). */
function counts(fn) {
  return fn !== OWN_FUNCTION || document.getElementById("show-own").checked;
}

/** Calls and errors, made and served, over the functions that count. */
function totals(report) {
  const sum = { calls: 0, errors: 0, maxP99: null };
  for (const [fn, sides] of Object.entries(report.functions || {})) {
    if (!counts(fn)) continue;
    for (const side of Object.values(sides)) {
      sum.calls += side.calls;
      sum.errors += side.errors;
      if (side.p99_ms !== null && (sum.maxP99 === null || side.p99_ms > sum.maxP99)) {
        sum.maxP99 = side.p99_ms;
      }
    }
  }
  return sum;
}

/** Calls per second of each worker since the previous poll (null on the first). */
function rates(time, callsByName) {
  const out = {};
  const prev = state.previous;
  const dt = prev ? time - prev.time : 0;
  for (const [name, calls] of Object.entries(callsByName)) {
    const before = prev ? prev.calls[name] : undefined;
    out[name] = dt > 0 && before !== undefined ? Math.max(0, (calls - before) / dt) : null;
  }
  return out;
}

/** Keep the job-wide rate of the last minute. */
function remember(time, rate) {
  state.history.push({ time, rate });
  state.history = state.history.filter((p) => p.time >= time - HISTORY_S);
}

// -- text -----------------------------------------------------------------------------

function fmtRate(rate) {
  return rate === null ? "–" : rate.toFixed(1);
}

function fmtMs(ms) {
  return ms === null || ms === undefined ? "–" : ms < 10 ? ms.toFixed(2) : ms.toFixed(1);
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

// -- DOM ------------------------------------------------------------------------------

/** A new element with text (never HTML: worker names and errors are shown as they are). */
function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function cell(field, text, value, cls) {
  const attrs = { "data-field": field };
  if (value !== undefined && value !== null) attrs["data-value"] = String(value);
  if (cls) attrs.class = cls;
  return el("td", text, attrs);
}

function setText(id, text, value) {
  const node = document.getElementById(id);
  node.textContent = String(text);
  if (value !== undefined) node.dataset.value = String(value);
}

function bytesCell(bytes) {
  const td = cell("bytes", undefined, undefined, "bytes");
  for (const [transport, b] of Object.entries(bytes || {})) {
    const line = el("div", `${transport} ${fmtBytes(b.sent)} / ${fmtBytes(b.received)}`, {
      "data-transport": transport,
      "data-sent": String(b.sent),
      "data-received": String(b.received),
    });
    td.appendChild(line);
  }
  return td;
}

function statusCell(worker) {
  if (worker.alive) return cell("status", "alive", undefined, "alive");
  const td = cell("status", undefined, undefined, "lost");
  td.appendChild(el("strong", "lost"));
  td.appendChild(el("div", worker.error || "", { class: "error", "data-field": "error" }));
  return td;
}

function workerRow(worker, sum, rate) {
  const tr = el("tr", undefined, {
    "data-worker": worker.name,
    "data-alive": String(worker.alive),
    class: worker.alive ? "" : "lost-row",
  });
  const seen = worker.seen || {};
  tr.append(
    cell("rank", worker.rank),
    cell("name", worker.name),
    cell("host", seen.host ?? "–"),
    cell("state", seen.state ?? "–"),
    statusCell(worker),
    cell("calls", sum.calls, sum.calls, "num"),
    cell("rate", worker.alive ? fmtRate(rate) : "–", worker.alive ? rate : null, "num"),
    cell("errors", sum.errors, sum.errors, sum.errors ? "num bad" : "num"),
    cell("in_flight", seen.in_flight ?? "–", seen.in_flight, "num"),
    cell("owner_rrefs", seen.owner_rrefs ?? "–", seen.owner_rrefs, "num"),
    cell("user_rrefs", seen.user_rrefs ?? "–", seen.user_rrefs, "num"),
    cell("autograd_contexts", seen.autograd_contexts ?? "–", seen.autograd_contexts, "num"),
    bytesCell(seen.bytes),
  );
  return tr;
}

function functionRows(worker) {
  const rows = [];
  const functions = (worker.seen || {}).functions || {};
  for (const fn of Object.keys(functions).sort()) {
    if (!counts(fn)) continue;
    for (const side of ["made", "served"]) {
      const f = functions[fn][side];
      if (!f) continue;
      const tr = el("tr", undefined, {
        "data-worker": worker.name, "data-function": fn, "data-side": side,
        class: worker.alive ? "" : "lost-row",
      });
      tr.append(
        cell("worker", worker.name),
        cell("function", fn, undefined, "fn"),
        cell("side", side),
        cell("calls", f.calls, f.calls, "num"),
        cell("errors", f.errors, f.errors, f.errors ? "num bad" : "num"),
        cell("p50_ms", fmtMs(f.p50_ms), f.p50_ms, "num"),
        cell("p99_ms", fmtMs(f.p99_ms), f.p99_ms, "num"),
      );
      rows.push(tr);
    }
  }
  return rows;
}

// -- the chart ------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

/** A line of the job-wide rate over the last minute, drawn by hand in the SVG. */
function drawChart(now) {
  const svg = document.getElementById("rate-chart");
  const width = 950, height = 120, left = 56, right = 10, top = 10, bottom = 22;
  const plotW = width - left - right, plotH = height - top - bottom;
  const peak = Math.max(1, ...state.history.map((p) => p.rate));
  const x = (t) => left + ((t - (now - HISTORY_S)) / HISTORY_S) * plotW;
  const y = (r) => top + plotH - (r / peak) * plotH;
  svg.replaceChildren();
  for (const frac of [0, 0.5, 1]) {
    const gy = y(peak * frac);
    svg.append(svgEl("line", { x1: left, x2: width - right, y1: gy, y2: gy, class: "grid" }));
    const value = peak * frac;
    const label = value === 0 ? "0" : value.toFixed(value < 10 ? 1 : 0);
    svg.append(svgEl("text", { x: left - 6, y: gy + 4, "text-anchor": "end", class: "tick" },
      label));
  }
  svg.append(svgEl("text", { x: left, y: height - 6, class: "tick" }, `${HISTORY_S} s ago`));
  svg.append(svgEl("text", { x: width - right, y: height - 6, "text-anchor": "end",
    class: "tick" }, "now"));
  if (state.history.length < 2) return;
  const pts = state.history.map((p) => `${x(p.time).toFixed(1)},${y(p.rate).toFixed(1)}`);
  const first = state.history[0].time, last = state.history[state.history.length - 1].time;
  const area = `${x(first).toFixed(1)},${y(0)} ${pts.join(" ")} ${x(last).toFixed(1)},${y(0)}`;
  svg.append(svgEl("polygon", { points: area, class: "area" }));
  svg.append(svgEl("polyline", { points: pts.join(" "), class: "line" }));
}

// -- one poll -------------------------------------------------------------------------

/** Each worker of the job, a lost one with the figures of its last report. */
function merge(job) {
  return job.workers.map((w) => {
    if (w.alive) state.lastSeen[w.name] = w;
    return { ...w, seen: w.alive ? w : state.lastSeen[w.name] };
  });
}

function render(job) {
  const workers = merge(job);
  const sums = {};
  for (const w of workers) sums[w.name] = totals(w.seen || {});
  const callsByName = Object.fromEntries(workers.map((w) => [w.name, sums[w.name].calls]));
  const perWorker = rates(job.time, callsByName);
  const known = Object.values(perWorker).filter((r) => r !== null);
  const jobRate = known.length ? known.reduce((a, b) => a + b, 0) : null;
  state.previous = { time: job.time, calls: callsByName };
  if (jobRate !== null) remember(job.time, jobRate);

  document.querySelector("#workers tbody").replaceChildren(
    ...workers.map((w) => workerRow(w, sums[w.name], perWorker[w.name])));
  document.querySelector("#functions tbody").replaceChildren(...workers.flatMap(functionRows));
  renderSummary(workers, sums, jobRate);
  drawChart(job.time);
}

function renderSummary(workers, sums, jobRate) {
  const alive = workers.filter((w) => w.alive).length;
  const all = Object.values(sums);
  const calls = all.reduce((a, s) => a + s.calls, 0);
  const errors = all.reduce((a, s) => a + s.errors, 0);
  const inFlight = workers.filter((w) => w.alive).reduce((a, w) => a + (w.in_flight || 0), 0);
  let sent = 0;
  for (const w of workers) {
    for (const b of Object.values((w.seen || {}).bytes || {})) sent += b.sent;
  }
  setText("workers-alive", alive, alive);
  setText("workers-total", workers.length, workers.length);
  setText("total-calls", calls, calls);
  setText("call-rate", fmtRate(jobRate), jobRate);
  setText("total-errors", errors, errors);
  setText("total-in-flight", inFlight, inFlight);
  setText("total-bytes-sent", fmtBytes(sent), sent);
  document.getElementById("summary").classList.toggle("degraded", alive < workers.length);
}

function showStatus(ok, text) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.dataset.state = ok ? "ok" : "error";
}

async function poll() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch("/api/job", { signal: abort.signal, cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const job = await response.json();
    render(job);
    state.polls += 1;
    document.body.dataset.polls = String(state.polls);
    showStatus(true, `updated ${new Date(job.time * 1000).toLocaleTimeString()}`);
  } catch (err) {
    showStatus(false, `cannot reach the job: ${err.message || err}`);
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}

function start() {
  document.getElementById("show-own").addEventListener("change", () => {
    state.previous = null; // the totals change meaning: start the rates afresh
    state.history = [];
  });
  poll();
}

start();
