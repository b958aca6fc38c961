// One device: facts, the newest snapshot of each camera, charts over time (uPlot, vendored) with deployments
// and adapt/throttle events marked on the time axis, a shadow deployment's agreement and candidate latency
// over time with how each shadow ended, tracking's zone and line counts and events, and the deployment history with
// each step's duration.
// Refreshed from /api/device and /api/snapshots; an image is fetched again only when a newer one is stored.
"use strict";

const CHARTS = [
  {id: "latency", title: "latency ms", series: [["p50_ms", "p50", "#3b82f6"], ["p99_ms", "p99", "#ef4444"]], budget: true},
  {id: "fps", title: "frames per second", series: [["fps", "fps", "#10b981"]]},
  {id: "power", title: "power W", series: [["power_w", "power", "#f59e0b"]]},
  {id: "temperature", title: "temperature °C", series: [["soc_temp_c", "SoC", "#8b5cf6"], ["gpu_temp_c", "GPU", "#ec4899"]]},
  {id: "clocks", title: "GPU clock MHz", series: [["gpu_freq_mhz", "GPU clock", "#0ea5e9"]]},
];
// Drawn from the shadow/report events of /api/device (`shadow.series`), not from telemetry.
const SHADOW_CHARTS = [
  {id: "shadow-agreement", title: "shadow agreement (0–1)", source: "shadow",
   series: [["agreement", "total", "#7c3aed"], ["window_agreement", "window", "#14b8a6"]]},
  {id: "shadow-latency", title: "shadow p99 ms", source: "shadow",
   series: [["candidate_p99_ms", "candidate", "#ef4444"], ["active_p99_ms", "serving", "#3b82f6"]]},
];
const MARK_COLORS = {deployment: "#2563eb", adapt: "#16a34a", throttling: "#dc2626", throttling_cleared: "#f87171",
                     rolled_back: "#b45309", rollback: "#b45309", model_loaded: "#64748b",
                     "shadow/started": "#7c3aed", "shadow/finished": "#7c3aed"};
const deviceId = param("id");
const plots = {};
const snapshotBoxes = new Map();  // camera -> its figure, kept across refreshes so an unchanged image stays loaded

function fact(name, value) {
  return [el("dt", {text: name}), el("dd", {}, [value])];
}

function renderFacts(dev) {
  document.getElementById("title").textContent = dev.device_id;
  document.title = `${dev.device_id} — edge dashboard`;
  const status = dev.online === null ? DASH : dev.online ? (dev.state || "online") : "offline";
  const facts = [
    ...fact("status", `${status} since ${fmtTime(dev.state_since)}`),
    ...fact("last seen", fmtTime(dev.last_seen)),
    ...fact("model", modelLabel(dev.model_name, dev.model_version)),
    ...fact("precision / backend", `${fmtText(dev.precision)} / ${fmtText(dev.backend)}`),
    ...fact("latency budget", missing(dev.latency_budget_ms) ? DASH : `${fmtNum(dev.latency_budget_ms, 0)} ms`),
    ...fact("module", fmtText(dev.module)),
    ...fact("agent", fmtText(dev.agent_version)),
    ...fact("lost on device", missing(dev.lost_on_device) ? DASH
      : `${fmtNum(dev.lost_on_device, 0)} of ${fmtNum(dev.lost_on_device + dev.seq_received, 0)} messages`),
    ...fact("deployment", missing(dev.deployment_state) ? DASH
      : dev.deploying ? `${dev.deployment_state} (in progress)` : dev.deployment_state),
  ];
  document.getElementById("facts").replaceChildren(...facts);
}

function markerPlugin(markers) {
  return {hooks: {draw: [(u) => {
    const ctx = u.ctx;
    ctx.save();
    ctx.lineWidth = 2 * devicePixelRatio;
    for (const m of markers) {
      const x = Math.round(u.valToPos(m.ts, "x", true));
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.strokeStyle = MARK_COLORS[m.type] || "#64748b";
      ctx.setLineDash(m.type === "deployment" ? [] : [6 * devicePixelRatio, 4 * devicePixelRatio]);
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
  }]}};
}

function seriesOf(spec, data) {
  return spec.source === "shadow" ? data.shadow.series : data.series;
}

function budgetShown(spec, data) {
  // The budget line only when it is near the data: a 5 s budget would flatten a 100 ms latency curve.
  const budget = data.device.latency_budget_ms;
  if (!spec.budget || missing(budget)) return null;
  const worst = Math.max(...data.series.p99_ms.filter((v) => !missing(v)));
  return budget <= 2 * worst ? budget : null;
}

function chartData(spec, data, budget) {
  const series = seriesOf(spec, data);
  const cols = [series.ts, ...spec.series.map(([key]) => series[key])];
  if (budget !== null) cols.push(series.ts.map(() => budget));
  return cols;
}

function xRange(spec, data) {
  // Start where the data (or the first marker) starts when that is inside the range: a device that reported
  // for ten minutes fills the chart instead of a sliver at the right edge of the hour.
  const first = Math.min(...[seriesOf(spec, data).ts[0], data.markers.length ? data.markers[0].ts : undefined]
    .filter((v) => !missing(v)));
  if (!Number.isFinite(first)) return [data.since, data.until];
  const pad = Math.max(1, (data.until - first) * 0.03);
  return [Math.max(data.since, first - pad), data.until];
}

function countPoints(spec, data) {
  const series = seriesOf(spec, data);
  return spec.series.reduce((n, [key]) => n + series[key].filter((v) => !missing(v)).length, 0);
}

function renderChart(spec, data) {
  const box = document.getElementById("chart-" + spec.id);
  const points = countPoints(spec, data);
  box.dataset.points = String(points);
  if (points === 0) {
    if (plots[spec.id]) { plots[spec.id].destroy(); delete plots[spec.id]; }
    box.querySelector(".plot").replaceChildren(el("p", {class: "empty", text: `${DASH} no ${spec.title} reported in this range`}));
    return;
  }
  const budget = budgetShown(spec, data);
  const shown = seriesOf(spec, data).ts.length;
  const series = [{}, ...spec.series.map(([, label, color]) => ({label, stroke: color, width: 2, spanGaps: false,
                                                                  points: {show: shown < 80}}))];
  if (budget !== null) series.push({label: "budget", stroke: "#94a3b8", dash: [4, 4], width: 1});
  const cols = chartData(spec, data, budget);
  const width = Math.max(320, box.clientWidth - 16);
  const [xMin, xMax] = xRange(spec, data);
  if (plots[spec.id]) plots[spec.id].destroy();
  box.querySelector(".plot").replaceChildren();
  plots[spec.id] = new uPlot({width, height: 180, series, scales: {x: {time: true, min: xMin, max: xMax}},
                              plugins: [markerPlugin(data.markers)], legend: {live: false}},
                             cols, box.querySelector(".plot"));
}

function markClass(type) {
  if (type.startsWith("throttl")) return "throttle";
  return type.startsWith("shadow/") ? "shadow" : type;
}

function renderMarkers(markers, truncated) {
  const rows = markers.slice().reverse().map((m) => el("tr", {}, [
    el("td", {text: fmtTime(m.ts)}),
    el("td", {}, [el("span", {class: "mark " + markClass(m.type)}), m.label]),
  ]));
  if (truncated) {  // the server sends the newest few hundred, whatever the device sent
    rows.push(el("tr", {}, [el("td", {colspan: 2, class: "muted", id: "markers-truncated",
                                      text: `only the newest ${markers.length} events of this range are shown`})]));
  }
  document.querySelector("#markers tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, [el("td", {colspan: 2, class: "muted", text: "no events in this range"})])]));
}

function shadowFacts(current) {
  if (!current) return fact("running", "no shadow deployment running");
  const numbers = current.state === "started" ? "started, no agreement reported yet"
    : `${fmtNum(current.agreement, 3)} over ${fmtNum(current.frames, 0)} frames (window ${fmtNum(current.window_agreement, 3)})`;
  return [
    ...fact("candidate", fmtText(current.model)), ...fact("agreement", numbers),
    ...fact("candidate p99", missing(current.candidate_p99_ms) ? DASH : `${fmtNum(current.candidate_p99_ms, 1)} ms`),
    ...fact("frames skipped", fmtNum(current.skipped_total, 0)),
    ...fact("as of", `${fmtTime(current.ts)} (${current.source === "telemetry" ? "telemetry" : "shadow/report"})`),
  ];
}

function renderShadow(data) {
  const shadow = data.shadow;
  const box = document.getElementById("shadow");
  box.hidden = !shadow.current && !shadow.finished.length && !shadow.series.ts.length;
  document.getElementById("shadow-facts").replaceChildren(...shadowFacts(shadow.current));
  for (const spec of SHADOW_CHARTS) renderChart(spec, data);
  const rows = shadow.finished.map((f) => el("tr", {"data-outcome": f.outcome}, [
    el("td", {text: fmtTime(f.ts)}), el("td", {text: fmtText(f.model)}),
    el("td", {}, [el("span", {class: f.outcome === "promoted" ? "ok" : "bad", text: fmtText(f.outcome)})]),
    el("td", {class: "num", text: fmtNum(f.frames, 0)}), el("td", {class: "num", text: fmtNum(f.agreement, 3)}),
    el("td", {class: "num", text: fmtNum(f.candidate_p99_ms, 1)}),
    el("td", {text: [f.reason, f.message].filter((v) => !missing(v) && v !== "").join(": ") || DASH}),
  ]));
  document.querySelector("#shadow-finished tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, [el("td", {colspan: 7, class: "muted", text: "no shadow has ended yet"})])]));
}

function trackingDetail(e) {
  if (e.type === "line_cross") return e.direction;
  if (e.type === "dwell" || e.type === "zone_leave") {
    return [missing(e.dwell_s) ? null : `${fmtNum(e.dwell_s, 1)} s inside`, e.reason].filter((v) => !missing(v)).join(", ");
  }
  if (e.type === "tracks_reset") return `epoch ${fmtText(e.track_epoch)}: ${fmtText(e.reason)}, ${fmtText(e.ended_tracks)} ended`;
  if (e.type === "tracking_problem") return `${fmtText(e.code)}: ${fmtText(e.message)}`;
  if (e.type === "zones_changed") return `zones and lines set (${fmtText(e.source)})`;
  return "";
}

function renderTracking(tracking) {
  // Zone, line and reset events of the range (newest first) and the newest sample's counts (docs/tracking.md).
  const box = document.getElementById("tracking");
  box.hidden = !tracking.events.length && !tracking.counts;
  const counts = [];
  for (const [camera, numbers] of Object.entries(tracking.counts || {})) {
    for (const [zone, c] of Object.entries(numbers.zones)) {
      counts.push(el("tr", {"data-shape": zone}, [el("td", {text: camera}), el("td", {text: `zone ${zone}`}),
        ...[c.entered, c.left, c.inside, c.dwelled].map((v) => el("td", {class: "num", text: fmtNum(v, 0)}))]));
    }
    for (const [line, c] of Object.entries(numbers.lines)) {
      counts.push(el("tr", {"data-shape": line}, [el("td", {text: camera}), el("td", {text: `line ${line}`}),
        ...[c.in, c.out, null, null].map((v) => el("td", {class: "num", text: fmtNum(v, 0)}))]));
    }
  }
  document.querySelector("#tracking-counts tbody").replaceChildren(...(counts.length ? counts
    : [el("tr", {}, [el("td", {colspan: 6, class: "muted", text: "no counts reported"})])]));
  document.getElementById("tracking-asof").textContent = missing(tracking.counts_ts) ? ""
    : `counts since the device's start, as of ${fmtTime(tracking.counts_ts)}`;
  const rows = tracking.events.map((e) => el("tr", {"data-type": e.type}, [
    el("td", {text: fmtTime(e.ts)}), el("td", {text: e.type.replace("_", " ")}), el("td", {text: fmtText(e.camera)}),
    el("td", {text: fmtText(e.zone || e.line)}), el("td", {text: fmtText(e["class"])}),
    el("td", {class: "num", text: missing(e.track_id) ? DASH : `${e.track_id} (${fmtText(e.track_epoch)})`}),
    el("td", {text: trackingDetail(e) || DASH}),
  ]));
  if (tracking.truncated) {
    rows.push(el("tr", {}, [el("td", {colspan: 7, class: "muted", id: "tracking-truncated",
                                      text: `only the newest ${tracking.events.length} tracking events of this range are shown`})]));
  }
  document.querySelector("#tracking-events tbody").replaceChildren(...(rows.length ? rows
    : [el("tr", {}, [el("td", {colspan: 7, class: "muted", text: "no tracking events in this range"})])]));
}

function renderDeployments(history) {
  const box = document.getElementById("deployments");
  if (!history.length) { box.replaceChildren(el("p", {class: "muted", text: "no deployments recorded"})); return; }
  box.replaceChildren(...history.map((dep) => el("details", {class: "deployment", open: dep === history[0] ? "" : null}, [
    el("summary", {}, [
      el("code", {text: dep.deployment_id}), " ",
      el("span", {class: dep.state === "active" ? "ok" : dep.state === "failed" || dep.state === "rolled_back" ? "bad" : "busy",
                  text: fmtText(dep.state)}),
      ` ${fmtText(dep.model)} · started ${fmtTime(dep.started)} · ${fmtDuration(dep.total_s)}`,
    ]),
    el("table", {class: "grid compact steps"}, [
      el("thead", {}, [el("tr", {}, ["step", "at", "took", "detail"].map((h) => el("th", {text: h})))]),
      el("tbody", {}, dep.steps.map((s) => el("tr", {}, [
        el("td", {text: fmtText(s.state)}), el("td", {text: fmtTime(s.ts)}),
        el("td", {class: "num", text: fmtDuration(s.duration_s)}),
        el("td", {text: [s.reason, s.message].filter((v) => !missing(v)).join(": ") || DASH}),
      ]))),
    ]),
  ])));
}

function snapshotUrl(camera, ts) {
  // `v` changes with each newer snapshot: the browser fetches the image again only then.
  return `/api/snapshot?id=${encodeURIComponent(deviceId)}&camera=${encodeURIComponent(camera)}&v=${encodeURIComponent(ts)}`;
}

function snapshotBox(camera) {
  let box = snapshotBoxes.get(camera);
  if (!box) {
    const img = el("img", {alt: `snapshot of camera ${camera}`});
    const link = el("a", {target: "_blank", rel: "noopener", title: "open the full image"}, [img]);
    const caption = el("figcaption");
    const figure = el("figure", {class: "snapshot", "data-camera": camera}, [link, caption]);
    img.addEventListener("error", () => figure.classList.add("failed"));
    img.addEventListener("load", () => figure.classList.remove("failed"));
    box = {figure, img, link, caption};
    snapshotBoxes.set(camera, box);
  }
  return box;
}

function renderSnapshots(data) {
  const figures = data.snapshots.map((s) => {
    const box = snapshotBox(s.camera);
    const url = snapshotUrl(s.camera, s.ts);
    if (box.img.getAttribute("src") !== url) {
      box.img.setAttribute("width", s.width);  // the frame's aspect before the image has loaded
      box.img.setAttribute("height", s.height);
      box.img.setAttribute("src", url);
      box.link.setAttribute("href", url);
    }
    const captured = !missing(s.captured_at);
    const taken = captured ? s.captured_at : s.ts;
    box.caption.replaceChildren(
      el("strong", {class: "snapshot-camera", text: s.camera}), " ",
      el("span", {class: s.overlay ? "tag overlay" : "tag", text: s.overlay ? "overlay" : "no overlay"}), el("br"),
      captured ? "captured " : "published ",
      el("time", {class: "snapshot-time", datetime: new Date(taken * 1000).toISOString(), text: fmtTime(taken)}),
      el("span", {class: "muted snapshot-age", text: ` (${fmtAgo(taken, data.now)} ago)`}), el("br"),
      el("span", {class: "muted", text: `${s.width}×${s.height} · ${fmtNum(s.bytes / 1024, 0)} KB · ${fmtText(s.reason)}`
        + (missing(s.model) ? "" : ` · ${s.model}`)}),
    );
    return box.figure;
  });
  const cameras = new Set(data.snapshots.map((s) => s.camera));
  for (const camera of [...snapshotBoxes.keys()]) if (!cameras.has(camera)) snapshotBoxes.delete(camera);
  const box = document.getElementById("snapshots");
  const shown = [...box.children];
  // Re-attached only when the set of cameras changed: moving an <img> is harmless, but nothing needs to move.
  if (!figures.length) {
    box.replaceChildren(el("p", {class: "muted", text: "no snapshots stored (edge-deploy snapshot DEVICE asks for "
                                  + "one; [video] snapshot_interval_s on the device sends them periodically)"}));
  } else if (shown.length !== figures.length || shown.some((node, i) => node !== figures[i])) {
    box.replaceChildren(...figures);
  }
  box.dataset.loaded = "true";
}

async function refreshSnapshots() {
  try {
    renderSnapshots(await getJSON(`/api/snapshots?id=${encodeURIComponent(deviceId)}`));
  } catch (err) {
    document.getElementById("snapshots").replaceChildren(
      el("p", {class: "error", text: "Could not load the snapshots: " + err.message}));
    snapshotBoxes.clear();
  }
}

function chartBox(spec) {
  return el("figure", {id: "chart-" + spec.id, class: "chart"}, [el("figcaption", {text: spec.title}), el("div", {class: "plot"})]);
}

function buildChartBoxes() {
  document.getElementById("charts").replaceChildren(...CHARTS.map(chartBox));
  document.getElementById("shadow-charts").replaceChildren(...SHADOW_CHARTS.map(chartBox));
}

async function refresh() {
  const range = document.getElementById("range").value;
  try {
    const data = await getJSON(`/api/device?id=${encodeURIComponent(deviceId)}&range=${encodeURIComponent(range)}`);
    showError(null);
    setUpdated(data.until);
    renderFacts(data.device);
    for (const spec of CHARTS) renderChart(spec, data);
    renderMarkers(data.markers, data.markers_truncated);
    renderShadow(data);
    renderTracking(data.tracking);
    renderDeployments(data.deployments);
    document.body.dataset.loaded = "true";
  } catch (err) {
    showError("Could not load the device: " + err.message);
    return;
  }
  await refreshSnapshots();
}

async function loop() {
  await refresh();
  window.setTimeout(loop, 10000);
}

if (!deviceId) {
  showError("No device given: open this page from the fleet table (/device?id=DEVICE).");
} else {
  document.getElementById("title").textContent = deviceId;
  buildChartBoxes();
  document.getElementById("range").addEventListener("change", refresh);
  loop();
}
