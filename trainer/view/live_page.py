"""The live view's page: HTML with inline CSS and JavaScript drawing on canvases (no
library, nothing fetched but the run's own ``data.json``)."""

from __future__ import annotations

__all__ = ["PAGE"]

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dasktrain live view</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px auto;
       max-width: 1180px; padding: 0 12px; color: #222; }
h1 { font-size: 1.35em; margin: 0 0 4px 0; }
#status { color: #444; margin-bottom: 10px; font-variant-numeric: tabular-nums; }
#status b { color: #222; }
.state { display: inline-block; padding: 1px 8px; border-radius: 9px; color: #fff;
         background: #2a7; font-size: 0.85em; margin-left: 6px; }
.state.finished { background: #557; } .state.lost { background: #c33; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
.panel { border: 1px solid #e3e3e3; border-radius: 4px; padding: 6px; }
canvas { width: 100%; height: 300px; display: block; }
h2 { font-size: 1.05em; margin: 18px 0 6px 0; }
#events { font-family: ui-monospace, monospace; font-size: 0.88em; color: #333; }
</style></head><body>
<h1 id="title">dasktrain live view</h1>
<div id="status">waiting for the first updates...</div>
<div class="grid">
  <div class="panel"><canvas id="loss"></canvas></div>
  <div class="panel"><canvas id="throughput"></canvas></div>
  <div class="panel"><canvas id="staleness"></canvas></div>
  <div class="panel"><canvas id="stall"></canvas></div>
</div>
<h2>Events</h2>
<ol id="events"></ol><p id="no-events">none yet</p>
<script>
"use strict";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const run = {version: [], time: [], loss: [], samples: [], contributors: []};
let latest = null, failures = 0;

// Loops, not Math.max(...values): spreading a long run's values overflows the stack.
function lowest(values) { let m = Infinity; for (const v of values) if (v < m) m = v; return m; }
function highest(values) { let m = -Infinity; for (const v of values) if (v > m) m = v; return m; }

function fmt(v, digits = 4) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  return Math.abs(v) >= 1e4 ? v.toFixed(0) : Number(v.toPrecision(digits)).toString();
}

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return ticks;
}

// One chart frame: axes, ticks, labels; returns coordinate transforms.
function frame(canvas, opts) {
  const dpr = window.devicePixelRatio || 1, w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const left = 58, right = 26, top = 26, bottom = 40;
  const pw = w - left - right, ph = h - top - bottom;
  g.fillStyle = "#222"; g.font = "14px system-ui, sans-serif"; g.textAlign = "center";
  g.fillText(opts.title, left + pw / 2, 16);
  g.font = "12px system-ui, sans-serif"; g.fillStyle = "#444";
  g.fillText(opts.xlabel || "", left + pw / 2, h - 6);
  g.save(); g.translate(13, top + ph / 2); g.rotate(-Math.PI / 2);
  g.fillText(opts.ylabel || "", 0, 0); g.restore();
  if (opts.empty) {
    g.fillStyle = "#888"; g.fillText(opts.empty, left + pw / 2, top + ph / 2);
    return null;
  }
  const logy = !!opts.logy;
  const ty = v => logy ? Math.log10(v) : v;
  const y0 = ty(opts.ymin), y1 = ty(opts.ymax);
  const X = v => left + (v - opts.xmin) / ((opts.xmax - opts.xmin) || 1) * pw;
  const Y = v => top + ph - (ty(v) - y0) / ((y1 - y0) || 1) * ph;
  g.strokeStyle = "#eee"; g.lineWidth = 1; g.fillStyle = "#555"; g.textAlign = "right";
  const yt = logy ? niceTicks(y0, y1, 4).filter(t => Number.isInteger(Math.round(t * 1e6) / 1e6))
                      .map(t => Math.pow(10, t))
                  : niceTicks(opts.ymin, opts.ymax, 5);
  for (const t of yt) {
    const y = Y(t); if (y < top - 1 || y > top + ph + 1) continue;
    g.beginPath(); g.moveTo(left, y); g.lineTo(left + pw, y); g.stroke();
    g.fillText(fmt(t, 3), left - 5, y + 4);
  }
  g.textAlign = "center";
  const xt = opts.xticks || niceTicks(opts.xmin, opts.xmax, 6);
  for (const t of xt) {
    const x = X(t); if (x < left - 1 || x > left + pw + 1) continue;
    g.fillText(opts.xtickLabel ? opts.xtickLabel(t) : fmt(t, 3), x, top + ph + 15);
  }
  g.strokeStyle = "#999"; g.strokeRect(left, top, pw, ph);
  return {g, X, Y, left, top, pw, ph};
}

function legend(f, items) {
  const g = f.g; g.font = "11px system-ui, sans-serif"; g.textAlign = "left";
  let y = f.top + 14;
  for (const [label, color] of items) {
    g.fillStyle = color; g.fillRect(f.left + f.pw - 120, y - 8, 12, 8);
    g.fillStyle = "#333"; g.fillText(label, f.left + f.pw - 104, y); y += 15;
  }
}

function polyline(f, xs, ys, color, width, alpha) {
  const g = f.g, n = xs.length, stride = Math.max(1, Math.floor(n / 3000));
  g.save(); g.strokeStyle = color; g.lineWidth = width; g.globalAlpha = alpha;
  g.beginPath();
  let started = false;
  for (let i = 0; i < n; i += stride) {
    if (!isFinite(ys[i])) continue;
    const x = f.X(xs[i]), y = f.Y(ys[i]);
    if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
  }
  g.stroke(); g.restore();
}

function movingMean(values, window) {
  const out = [], sums = [0];
  for (const v of values) sums.push(sums[sums.length - 1] + v);
  for (let i = 1; i <= values.length; i++) {
    const s = Math.max(0, i - window); out.push((sums[i] - sums[s]) / (i - s));
  }
  return out;
}

function drawLoss() {
  const canvas = document.getElementById("loss");
  const xs = run.version, ys = run.loss.filter(isFinite);
  if (!ys.length) { frame(canvas, {title: "training loss", empty: "no update yet"}); return; }
  let lo = lowest(ys), hi = highest(ys);
  const logy = lo > 0 && hi / lo > 30;
  if (!logy) { const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1; lo -= pad; hi += pad; }
  const f = frame(canvas, {title: "training loss by update", xlabel: "update (holder version)",
    ylabel: "loss", xmin: xs[0], xmax: xs[xs.length - 1], ymin: lo, ymax: hi, logy});
  const window = Math.max(1, Math.floor(run.loss.length / 50));
  polyline(f, xs, run.loss, COLORS[0], 1, window > 1 ? 0.3 : 1);
  if (window > 1) {
    polyline(f, xs, movingMean(run.loss, window), COLORS[0], 2, 1);
    legend(f, [["per update", "rgba(31,119,180,0.35)"], [`mean of ${window}`, COLORS[0]]]);
  }
}

function drawThroughput() {
  const canvas = document.getElementById("throughput");
  const n = run.time.length;
  if (n < 2) { frame(canvas, {title: "throughput", empty: "no update yet"}); return; }
  const t0 = run.time[0], span = run.time[n - 1] - t0;
  const bin = Math.max(1, span / 60), bins = Math.floor(span / bin) + 1;
  const counts = new Array(bins).fill(0);
  for (let i = 0; i < n; i++) {
    counts[Math.min(bins - 1, Math.floor((run.time[i] - t0) / bin))] += run.samples[i];
  }
  const xs = counts.map((_, i) => (i + 0.5) * bin), ys = counts.map(c => c / bin);
  // The last bin is still filling: leave it out while the run goes on.
  if (latest && latest.state === "running" && xs.length > 1) { xs.pop(); ys.pop(); }
  const f = frame(canvas, {title: `throughput (samples/s, ${fmt(bin, 2)} s bins)`,
    xlabel: "wall time since the first update (s)", ylabel: "samples/s",
    xmin: 0, xmax: Math.max(span, bin), ymin: 0, ymax: Math.max(highest(ys), 1) * 1.08});
  polyline(f, xs, ys, COLORS[2], 2, 1);
}

function drawStaleness() {
  const canvas = document.getElementById("staleness");
  const applied = latest ? latest.staleness.applied : {};
  const keys = Object.keys(applied).map(Number);
  const dropped = latest ? latest.staleness.dropped : 0;
  if (!keys.length && !dropped) {
    frame(canvas, {title: "staleness", empty: "no gradient yet"}); return;
  }
  const top = Math.max(...keys, 4), counts = [];
  let total = 0, weighted = 0;
  for (let k = 0; k <= top; k++) {
    const c = applied[k] || 0; counts.push(c); total += c; weighted += k * c;
  }
  const f = frame(canvas, {title: `staleness: mean ${fmt(total ? weighted / total : 0, 3)}, ` +
      `max ${Math.max(...keys, 0)}${dropped ? `, ${dropped} dropped` : ""}`,
    xlabel: "staleness (updates between computing and applying)", ylabel: "gradients",
    xmin: -0.6, xmax: top + 0.6, ymin: 0, ymax: Math.max(...counts, 1) * 1.08,
    xticks: top <= 20 ? counts.map((_, k) => k) : null});
  const bw = Math.max(2, (f.X(1) - f.X(0)) * 0.8);
  f.g.fillStyle = COLORS[0];
  counts.forEach((c, k) => { if (c) f.g.fillRect(f.X(k) - bw / 2, f.Y(c), bw, f.Y(0) - f.Y(c)); });
}

function drawStall() {
  const canvas = document.getElementById("stall");
  const epochs = (latest ? latest.epochs : []).slice(-8);
  const workers = new Set();
  for (const e of epochs) for (const w of (e.per_worker || [])) workers.add(w.worker);
  if (!workers.size) {
    frame(canvas, {title: "data stall per worker", empty: "shown when an epoch ends"}); return;
  }
  const ids = [...workers].sort((a, b) => a - b);
  let hi = 0;
  for (const e of epochs) for (const w of (e.per_worker || [])) hi = Math.max(hi, w.stall);
  const f = frame(canvas, {title: "data stall per worker: share of time waiting for batches",
    xlabel: "epoch", ylabel: "fraction of the epoch", xmin: -0.5, xmax: epochs.length - 0.5,
    ymin: 0, ymax: Math.max(hi * 1.15, 0.05), xticks: epochs.map((_, i) => i),
    xtickLabel: i => String(epochs[i].epoch)});
  const group = (f.X(1) - f.X(0)) * 0.8, bw = group / ids.length;
  epochs.forEach((e, i) => {
    for (const w of (e.per_worker || [])) {
      const j = ids.indexOf(w.worker);
      f.g.fillStyle = COLORS[j % COLORS.length];
      f.g.fillRect(f.X(i) - group / 2 + j * bw, f.Y(w.stall), bw * 0.92, f.Y(0) - f.Y(w.stall));
    }
  });
  legend(f, ids.slice(0, 8).map((w, j) => [`worker ${w}`, COLORS[j % COLORS.length]]));
}

function drawStatus() {
  const d = latest, n = run.loss.length, last = d.epochs[d.epochs.length - 1];
  document.getElementById("title").textContent =
    `dasktrain live view: ${d.mode}, ${d.workers} worker(s)`;
  const span = n > 1 ? run.time[n - 1] - run.time[0] : 0;
  const samples = run.samples.reduce((a, b) => a + b, 0);
  let text = `<b>${n}</b> updates, loss <b>${fmt(run.loss[n - 1])}</b>, ` +
    `${fmt(span > 0 ? samples / span : 0, 4)} samples/s, ${d.epochs.length} epoch(s) done`;
  if (last && last.validation) {
    text += ", validation " + Object.entries(last.validation)
      .map(([k, v]) => `${k} <b>${fmt(v)}</b>`).join(", ");
  }
  if (d.refused_gradients) text += `, ${d.refused_gradients} gradient(s) refused`;
  const state = d.state === "running" && failures ? "lost" : d.state;
  const label = state === "lost" ? "no answer: the fit ended or the driver stopped" : state;
  document.getElementById("status").innerHTML =
    text + `<span class="state ${state}">${label}</span>`;
  const list = document.getElementById("events");
  list.innerHTML = "";
  document.getElementById("no-events").style.display = d.events.length ? "none" : "block";
  for (const e of d.events.slice(-200)) {
    const li = document.createElement("li"); li.textContent = e; list.appendChild(li);
  }
}

function drawAll() {
  drawLoss(); drawThroughput(); drawStaleness(); drawStall();
  if (latest) drawStatus();
}

async function poll() {
  try {
    const response = await fetch(`data.json?since=${run.loss.length}`, {cache: "no-store"});
    const d = await response.json();
    if (d.total_updates < run.loss.length) {  // a new fit started: begin again
      for (const k in run) run[k] = [];
      const again = await fetch("data.json", {cache: "no-store"});
      Object.assign(d, await again.json());
    }
    for (const k in run) run[k] = run[k].concat(d.updates[k]);
    latest = d; failures = 0;
  } catch (e) {
    failures += 1;
  }
  drawAll();
  if (!(latest && latest.state === "finished")) setTimeout(poll, failures ? 3000 : 1000);
}
window.addEventListener("resize", drawAll);
poll();
</script></body></html>
"""
