// swarmgrad dashboard: polls api/swarm and api/history every 2 s and redraws the page.
// Plain DOM, no framework, no external URL. Every string from the API reaches the page through
// textContent or an attribute, never innerHTML: peer ids and roles come from the swarm.
"use strict";

const POLL_MS = 2000;
const STALE_MS = 3 * POLL_MS;     // no good answer for this long: the data on screen is stale
const OLD_SNAPSHOT_S = 60;        // the coordinator answers, but its snapshot is older than this
const FETCH_TIMEOUT_MS = 5000;
const ROUND_ROWS = 20;
const SVG_NS = "http://www.w3.org/2000/svg";  // a namespace name, never fetched
const KINDS = ["activations", "gradients", "averaging", "state"];

const view = {swarm: null, history: null, contributors: null, lastOk: 0, errors: {}};

// ---- small helpers ------------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined) continue;
    if (key === "class") node.className = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

function num(x) { return typeof x === "number" && Number.isFinite(x) ? x : null; }
function list(x) { return Array.isArray(x) ? x : []; }
function shortId(id) { return typeof id === "string" && id.length > 8 ? "…" + id.slice(-8) : String(id ?? "—"); }

function fmt(x, digits) {
  x = num(x);
  if (x === null) return "—";
  if (Math.abs(x) >= 1000) return x.toLocaleString("en-US", {maximumFractionDigits: 0});
  return x.toFixed(digits ?? (Math.abs(x) >= 100 ? 0 : Math.abs(x) >= 10 ? 1 : 2));
}

function fmtBytes(x) {
  x = num(x);
  if (x === null) return "—";
  const units = ["B", "kB", "MB", "GB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i++; }
  return (i === 0 ? x.toFixed(0) : x.toFixed(1)) + " " + units[i];
}

function fmtClock(t) {
  t = num(t);
  if (t === null) return "—";
  const d = new Date(t * 1000);
  return d.toLocaleTimeString("en-GB", {hour12: false});
}

function fmtAgo(seconds) {
  seconds = num(seconds);
  if (seconds === null) return "—";
  const s = Math.abs(seconds);
  const text = s < 60 ? s.toFixed(0) + " s" : s < 3600 ? (s / 60).toFixed(0) + " min"
    : s < 86400 ? (s / 3600).toFixed(1) + " h" : (s / 86400).toFixed(1) + " d";
  return seconds < 0 ? "in " + text : text + " ago";
}

function fmtDuration(s) {
  s = num(s);
  if (s === null) return "—";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

// ---- polling ------------------------------------------------------------------------------

async function getJSON(path) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch(path, {cache: "no-store", signal: controller.signal});
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (!response.ok) {
      throw new Error(path + ": HTTP " + response.status + (body && body.error ? " " + body.error : ""));
    }
    if (body === null || typeof body !== "object") throw new Error(path + ": not a JSON object");
    return body;
  } catch (e) {
    if (e.name === "AbortError") throw new Error(path + ": no answer in " + FETCH_TIMEOUT_MS / 1000 + " s");
    if (e instanceof TypeError) throw new Error(path + ": unreachable");
    throw e;
  } finally {
    clearTimeout(timer);
  }
}

async function poll() {
  const [swarm, history, contributors] = await Promise.allSettled(
    [getJSON("api/swarm"), getJSON("api/history"), getJSON("api/contributors")]);
  view.errors = {};
  if (swarm.status === "fulfilled") view.swarm = swarm.value; else view.errors.swarm = swarm.reason.message;
  if (history.status === "fulfilled") view.history = history.value; else view.errors.history = history.reason.message;
  if (contributors.status === "fulfilled") view.contributors = contributors.value;
  else view.errors.contributors = contributors.reason.message;
  if (swarm.status === "fulfilled" && history.status === "fulfilled") view.lastOk = Date.now();
  try {
    render();
  } catch (e) {
    view.errors.render = "render failed: " + e.message;
    console.error(e);
  }
  renderStatus();
  setTimeout(poll, POLL_MS);
}

function renderStatus() {
  const status = $("api-status");
  const messages = Object.values(view.errors);
  const age = view.lastOk ? Date.now() - view.lastOk : null;
  let state, text;
  if (messages.length) {
    state = "error";
    text = messages.join(" · ") + (age !== null ? " · last good data " + fmtAgo(age / 1000) : "");
  } else if (age === null) {
    state = "loading"; text = "connecting…";
  } else if (age > STALE_MS) {
    state = "stale"; text = "stale: no answer for " + fmtAgo(age / 1000).replace(" ago", "");
  } else if (num(view.swarm?.time) !== null && Date.now() / 1000 - view.swarm.time > OLD_SNAPSHOT_S) {
    // (or the two clocks disagree by a minute)
    state = "stale"; text = "stale: the coordinator's snapshot is " + fmtAgo(Date.now() / 1000 - view.swarm.time) + " old";
    text = text.replace(" ago old", " old");
  } else {
    state = "ok"; text = "live";
  }
  status.dataset.state = state;
  status.textContent = text;
  status.title = text;
  document.body.dataset.api = state;
}

// ---- rendering ----------------------------------------------------------------------------

function render() {
  if (view.swarm) {
    renderHeader(view.swarm);
    renderStages(view.swarm);
    renderPeers(view.swarm);
    renderCheckpoints(view.swarm);
  }
  if (view.history) {
    renderLoss(view.history);
    renderBytes(view.history);
    renderRounds(view.history);
  }
  if (view.contributors) renderContributors(view.contributors, view.swarm);
}

function replicasOf(swarm) {
  return list(swarm.stages).flatMap(stage => list(stage.replicas));
}

function renderHeader(swarm) {
  $("run-id").textContent = swarm.run_id ?? "—";
  $("latest-round").textContent = num(swarm.latest_round) === null ? "—" : String(swarm.latest_round);
  $("swarm-rate").textContent = fmt(swarm.swarm_rate);
  $("bottleneck").textContent = num(swarm.bottleneck) === null ? "—" : "stage " + swarm.bottleneck;
  const peers = new Set(replicasOf(swarm).map(r => r.peer_id));
  $("peer-count").textContent = String(peers.size);
  $("peer-count").title = list(swarm.peers?.admitted).length + " admitted";
  $("updated").textContent = fmtClock(swarm.time);
  // a monitor (no coordinator) admits nobody and keeps no checkpoint: those panels go
  const monitor = swarm.coordinator === null && swarm.monitor ? swarm.monitor : null;
  document.body.dataset.mode = monitor ? "monitor" : "coordinator";
  $("peers").hidden = $("checkpoints").hidden = $("coordinator").hidden = monitor !== null;
  $("monitor").hidden = monitor === null;
  if (monitor) {
    $("monitor-id").textContent = shortId(monitor.peer_id);
    $("monitor-id").title = monitor.peer_id ?? "";
    $("monitor-uptime").textContent = fmtDuration(monitor.uptime_s);
  }
  const coordinator = swarm.coordinator || {};
  $("coord-id").textContent = shortId(coordinator.peer_id);
  $("coord-id").title = coordinator.peer_id ?? "";
  $("coord-grpc").textContent = coordinator.grpc ?? "—";
  $("coord-uptime").textContent = fmtDuration(coordinator.uptime_s);
  document.title = "swarmgrad · " + (swarm.run_id ?? "") + " · round " + (swarm.latest_round ?? "—");
}

// Replicas that need a look first (disagreeing digest, not online, moving), then the fastest.
function replicaOrder(a, b) {
  const trouble = r => (r.agrees === false ? 4 : 0) + (r.state !== "online" ? 2 : 0) + (r.moving ? 1 : 0);
  return trouble(b) - trouble(a) || (num(b.rate) ?? -1) - (num(a.rate) ?? -1)
    || String(a.peer_id).localeCompare(String(b.peer_id));
}

function renderStages(swarm) {
  const grid = $("stage-grid");
  const stages = list(swarm.stages).slice().sort((a, b) => a.stage - b.stage);
  const scrolls = {};
  for (const list_ of grid.querySelectorAll("[data-stage] .replicas")) {
    scrolls[list_.parentElement.dataset.stage] = list_.scrollTop;
  }
  const maxRate = Math.max(1e-9, ...stages.map(s => num(s.rate) ?? 0));
  const total = replicasOf(swarm).length;
  $("stages-summary").textContent = stages.length + " stages · " + total + " replicas";
  if (!stages.length) {
    grid.replaceChildren(el("p", {class: "empty"}, "no stage reported yet"));
    return;
  }
  grid.classList.toggle("many", stages.length > 4);
  grid.replaceChildren(...stages.map(stage => stageCard(stage, swarm, maxRate)));
  for (const card of grid.querySelectorAll("[data-stage]")) {
    const top = scrolls[card.dataset.stage];
    if (top) card.querySelector(".replicas").scrollTop = top;
  }
}

function stageCard(stage, swarm, maxRate) {
  const replicas = list(stage.replicas).slice().sort(replicaOrder);
  const counts = {};
  for (const r of replicas) counts[r.state] = (counts[r.state] || 0) + 1;
  const agreeing = replicas.filter(r => r.agrees).length;
  const bottleneck = swarm.bottleneck === stage.stage;
  const rate = num(stage.rate) ?? 0;
  const bar = el("div", {class: "bar"}, el("span", {class: "fill"}));
  bar.firstChild.style.width = (100 * rate / maxRate).toFixed(1) + "%";
  const stateSummary = Object.entries(counts).sort((a, b) => b[1] - a[1])
    .map(([state, n]) => el("span", {class: "pill state-" + state}, n + " " + state));
  const card = el("article", {class: "stage" + (bottleneck ? " bottleneck" : ""),
      "data-stage": stage.stage, "data-rate": rate, "data-replicas": replicas.length},
    el("header", {},
      el("h3", {}, "stage " + stage.stage),
      el("span", {class: "count", title: "replicas"}, replicas.length + (replicas.length === 1 ? " replica" : " replicas")),
      bottleneck ? el("span", {class: "pill bottleneck-tag"}, "bottleneck") : null),
    el("div", {class: "rate-line"},
      el("span", {class: "rate"}, fmt(rate), el("small", {}, " samples/s")), bar),
    el("div", {class: "meta"},
      el("span", {title: stage.majority_digest ?? "no majority"},
        "digest " + (stage.majority_digest ? String(stage.majority_digest).slice(0, 8) : "—")),
      el("span", {class: agreeing === replicas.length ? "ok" : "bad"}, agreeing + "/" + replicas.length + " agree"),
      ...stateSummary),
    el("div", {class: "replica-head"},
      el("span", {}, "peer"), el("span", {}, el("span", {class: "label"}, "state")), el("span", {class: "r"}, "rate"),
      el("span", {class: "r"}, "round"), el("span", {class: "c", title: "digest agrees with the stage's majority"}, "digest")),
    el("ol", {class: "replicas"}, ...replicas.map(replicaRow)));
  return card;
}

function replicaRow(r) {
  const agrees = r.agrees === true;
  const row = el("li", {class: "replica state-" + r.state + (agrees ? "" : " disagrees") + (r.moving ? " moving" : ""),
      "data-peer": r.peer_id, "data-round": r.round, "data-state": r.state,
      "data-agrees": agrees, "data-moving": r.moving === true,
      title: r.peer_id + "\nstate " + r.state + "\ndigest " + (r.digest ?? "—")
        + "\ntrain loss " + fmt(r.train_loss, 3)},
    el("span", {class: "pid"}, shortId(r.peer_id),
      r.moving ? el("span", {class: "moving-tag", title: "moving to another stage"}, " ⇄")
        : r.pinned ? el("span", {class: "pinned-tag", title: "pinned: given this stage, never moves"}, " ·") : null),
    el("span", {class: "state", title: r.state ?? ""}, el("i", {class: "dot"}), el("span", {class: "label"}, r.state ?? "—")),
    el("span", {class: "r"}, fmt(r.rate)),
    el("span", {class: "r"}, r.round ?? "—"),
    el("span", {class: "c " + (agrees ? "ok" : "bad")}, agrees ? "✓" : "✗"));
  return row;
}

function renderPeers(swarm) {
  const admitted = list(swarm.peers?.admitted).slice().sort((a, b) => (num(b.admitted_at) ?? 0) - (num(a.admitted_at) ?? 0));
  const revoked = list(swarm.peers?.revoked).slice().sort((a, b) => (num(b.revoked_at) ?? 0) - (num(a.revoked_at) ?? 0));
  const now = num(swarm.time) ?? Date.now() / 1000;
  $("peers-summary").textContent = admitted.length + " admitted · " + revoked.length + " revoked";
  $("admitted-body").replaceChildren(...(admitted.length ? admitted.map(p => el("tr", {"data-admitted": p.peer_id},
      el("td", {class: "pid", title: p.peer_id}, shortId(p.peer_id)), el("td", {}, p.role ?? "—"),
      el("td", {}, p.stage ?? "—"), el("td", {}, fmtAgo(now - p.admitted_at)),
      el("td", {}, num(p.expires) === null ? "—" : fmtAgo(now - p.expires))))
    : [emptyRow(5, "no peer admitted yet")]));
  $("revoked-body").replaceChildren(...(revoked.length ? revoked.map(p => el("tr", {"data-revoked": p.peer_id},
      el("td", {class: "pid", title: p.peer_id}, shortId(p.peer_id)), el("td", {}, fmtAgo(now - p.revoked_at))))
    : [emptyRow(2, "none revoked")]));
}

function renderCheckpoints(swarm) {
  const checkpoints = list(swarm.checkpoints).slice().sort((a, b) => b.round - a.round);
  $("checkpoints-count").textContent = checkpoints.length ? "latest round " + checkpoints[0].round : "";
  $("checkpoints-body").replaceChildren(...(checkpoints.length ? checkpoints.map(c => el("tr", {"data-round": c.round},
      el("td", {}, c.round), el("td", {}, fmtClock(c.time)), el("td", {}, list(c.stages).join(", "))))
    : [emptyRow(3, "no checkpoint yet")]));
}

function emptyRow(span, text) {
  return el("tr", {class: "empty"}, el("td", {colspan: span}, text));
}

function renderRounds(history) {
  const rounds = list(history.rounds).slice()
    .sort((a, b) => (num(b.time) ?? 0) - (num(a.time) ?? 0) || b.round - a.round || a.stage - b.stage)
    .slice(0, ROUND_ROWS);
  $("rounds-body").replaceChildren(...(rounds.length ? rounds.map(r => el("tr", {"data-stage": r.stage, "data-round": r.round},
      el("td", {}, r.stage), el("td", {}, r.round), el("td", {}, fmtClock(r.time)),
      el("td", {}, fmtDuration(r.duration_s)), el("td", {}, r.group_size ?? "—"),
      el("td", {}, fmt(r.train_loss, 3)), el("td", {}, fmt(r.samples_per_s))))
    : [emptyRow(7, "no round finished yet")]));
}

// Credit counted from completed rounds only (never from what a peer says of itself): the ledger's rows.
function renderContributors(doc, swarm) {
  const rows = list(doc.contributors).slice().sort((a, b) => (num(a.rank) ?? 1e9) - (num(b.rank) ?? 1e9));
  const totals = doc.totals || {};
  const now = num(doc.time) ?? num(swarm?.time) ?? Date.now() / 1000;
  $("contributors-summary").textContent = rows.length
    ? rows.length + " credited · " + fmt(totals.samples) + " samples" + (num(totals.tokens) !== null
      ? " · " + fmtTick(totals.tokens) + " tokens" : "") + " · since " + fmtClock(doc.since)
    : "";
  $("contributors-body").replaceChildren(...(rows.length ? rows.map(c => el("tr", {"data-contributor": c.peer_id,
      "data-samples": c.samples, "data-rank": c.rank},
      el("td", {}, c.rank ?? "—"), el("td", {class: "pid", title: c.peer_id}, shortId(c.peer_id)),
      el("td", {class: "r"}, fmt(c.samples, 0)), el("td", {class: "r"}, num(c.tokens) === null ? "—" : fmtTick(c.tokens)),
      el("td", {class: "r"}, c.rounds ?? "—"), el("td", {}, list(c.stages).join(", ")),
      el("td", {class: "r"}, fmtDuration(c.uptime_s)),
      el("td", {}, num(c.last_seen) === null ? "—" : fmtAgo(now - c.last_seen))))
    : [emptyRow(8, "no completed round credited yet")]));
}

function renderBytes(history) {
  const bytes = history.bytes_per_sample || {};
  const values = KINDS.map(kind => num(bytes[kind]) ?? 0);
  const total = values.reduce((a, b) => a + b, 0);
  const max = Math.max(1e-9, ...values);
  $("bytes-total").textContent = total ? fmtBytes(total) + " in all" : "";
  if (!total) {
    $("bytes-bars").replaceChildren(el("p", {class: "empty"}, "nothing sent yet"));
    return;
  }
  $("bytes-bars").replaceChildren(el("table", {class: "bytes"}, el("tbody", {}, ...KINDS.map((kind, i) => {
    const bar = el("div", {class: "bar kind-" + kind}, el("span", {class: "fill"}));
    bar.firstChild.style.width = (100 * values[i] / max).toFixed(1) + "%";
    return el("tr", {"data-kind": kind, "data-bytes": values[i]},
      el("th", {}, kind), el("td", {class: "barcell"}, bar), el("td", {class: "r"}, fmtBytes(values[i])),
      el("td", {class: "r share"}, (100 * values[i] / total).toFixed(0) + "%"));
  }))));
}

// ---- the loss chart: inline SVG, x = samples trained (time when no samples are reported) ----

function niceTicks(lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toFixed(10));
  return ticks;
}

function fmtTick(x) {
  const a = Math.abs(x);
  if (a >= 1e6) return (x / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e3) return (x / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
  return a >= 10 || x === 0 ? x.toFixed(0) : x.toFixed(a >= 1 ? 1 : 2);
}

function renderLoss(history) {
  const points = list(history.loss);
  const bySamples = points.some(p => num(p.samples) !== null && p.samples > 0);
  const t0 = Math.min(...points.map(p => num(p.time) ?? Infinity));
  const xOf = p => bySamples ? num(p.samples) : (num(p.time) === null ? null : (p.time - t0) / 60);
  const series = [["train_loss", "train"], ["val_loss", "val"]].map(([key, name]) => ({
    key, name, pts: points.map(p => [xOf(p), num(p[key])]).filter(([x, y]) => x !== null && y !== null)
      .sort((a, b) => a[0] - b[0]),
  }));
  const all = series.flatMap(s => s.pts);
  const chart = $("loss-chart");
  const last = s => s.pts.length ? fmt(s.pts[s.pts.length - 1][1], 3) : "—";
  const lastVal = points.filter(p => num(p.val_loss) !== null).sort((a, b) => num(a.time) - num(b.time)).pop();
  const units = lastVal && num(lastVal.val_nats) !== null
    ? " bits/byte (" + fmt(lastVal.val_nats, 3) + " nats/token, perplexity " + fmt(lastVal.val_ppl, 2) + ")" : "";
  $("loss-summary").textContent = all.length ? "train " + last(series[0]) + " · val " + last(series[1]) + units : "";
  if (!all.length) {
    chart.replaceChildren(el("p", {class: "empty"}, "no loss reported yet"));
    return;
  }
  const W = 560, H = 210, L = 44, R = 12, T = 10, B = 30;
  let [x0, x1] = [Math.min(...all.map(p => p[0])), Math.max(...all.map(p => p[0]))];
  let [y0, y1] = [Math.min(...all.map(p => p[1])), Math.max(...all.map(p => p[1]))];
  if (x1 === x0) { x1 = x0 + 1; }
  const pad = (y1 - y0) * 0.08 || Math.abs(y0) * 0.1 || 1;
  y0 -= pad; y1 += pad;
  const sx = x => L + (W - L - R) * (x - x0) / (x1 - x0);
  const sy = y => T + (H - T - B) * (1 - (y - y0) / (y1 - y0));
  const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "loss curves",
    preserveAspectRatio: "xMidYMid meet"});
  for (const t of niceTicks(y0, y1, 5)) {
    root.append(svg("line", {x1: L, x2: W - R, y1: sy(t), y2: sy(t), class: "grid"}));
    root.append(svg("text", {x: L - 6, y: sy(t) + 4, class: "tick", "text-anchor": "end"}, fmtTick(t)));
  }
  for (const t of niceTicks(x0, x1, 6)) {
    if (t < x0 || t > x1) continue;
    root.append(svg("line", {x1: sx(t), x2: sx(t), y1: H - B, y2: H - B + 4, class: "axis"}));
    root.append(svg("text", {x: sx(t), y: H - B + 16, class: "tick", "text-anchor": "middle"}, fmtTick(t)));
  }
  root.append(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  root.append(svg("text", {x: W - R, y: H - 2, class: "label", "text-anchor": "end"},
    bySamples ? "samples trained" : "minutes"));
  for (const s of series) {
    if (!s.pts.length) continue;
    const d = s.pts.map(([x, y], i) => (i ? "L" : "M") + sx(x).toFixed(1) + " " + sy(y).toFixed(1)).join("");
    root.append(svg("path", {d, class: "line " + s.name, "data-series": s.key, "data-points": s.pts.length}));
    if (s.name === "val" || s.pts.length < 3) {
      for (const [x, y] of s.pts) root.append(svg("circle", {cx: sx(x), cy: sy(y), r: 3, class: "dot " + s.name}));
    }
  }
  series.forEach((s, i) => {
    const x = L + 12 + i * 70;
    root.append(svg("line", {x1: x, x2: x + 16, y1: T + 8, y2: T + 8, class: "line " + s.name}));
    root.append(svg("text", {x: x + 20, y: T + 12, class: "legend"}, s.name));
  });
  chart.replaceChildren(root);
}

// ---- start --------------------------------------------------------------------------------

window.addEventListener("error", e => {
  document.body.dataset.jsError = e.message || "error";
});
setInterval(renderStatus, 1000);
poll();
