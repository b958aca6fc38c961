// The fleet table: one row per device, sortable (click a header), filterable, refreshed from /api/fleet.
"use strict";

const overBudget = (d) => !missing(d.p99_ms) && !missing(d.latency_budget_ms) && d.p99_ms > d.latency_budget_ms;

const COLUMNS = [
  {key: "device_id", label: "device", sort: (d) => d.device_id, cell: (d) => deviceLink(d.device_id)},
  {key: "state", label: "status", sort: (d) => (d.online ? 0 : 1), cell: statusCell},
  {key: "module", label: "module", sort: (d) => d.module, cell: (d) => fmtText(d.module)},
  {key: "model", label: "model", sort: (d) => modelLabel(d.model_name, d.model_version), cell: modelCell},
  {key: "precision", label: "precision", sort: (d) => d.precision, cell: (d) => fmtText(d.precision)},
  {key: "fps", label: "fps", num: true, sort: (d) => d.fps, cell: (d) => fmtNum(d.fps, 1)},
  {key: "p99_ms", label: "p99 / budget ms", num: true, sort: (d) => d.p99_ms, cell: p99Cell},
  {key: "power_w", label: "power W", num: true, sort: (d) => d.power_w, cell: (d) => fmtNum(d.power_w, 2)},
  {key: "energy_mj_per_frame", label: "energy mJ/frame", num: true, sort: (d) => d.energy_mj_per_frame,
   cell: (d) => fmtNum(d.energy_mj_per_frame, 1)},
  {key: "soc_temp_c", label: "SoC °C", num: true, sort: (d) => d.soc_temp_c, cell: (d) => fmtNum(d.soc_temp_c, 1)},
  {key: "throttled", label: "throttling", sort: (d) => (missing(d.throttled) ? null : d.throttled ? 1 : 0),
   cell: (d) => el("span", {class: d.throttled ? "bad" : null, text: fmtBool(d.throttled)})},
  {key: "lost_on_device", label: "lost on device", num: true, sort: (d) => d.lost_on_device, cell: lostCell},
  {key: "deployment_state", label: "deployment", sort: (d) => d.deployment_state, cell: deploymentCell},
  {key: "shadow", label: "shadow", sort: (d) => (d.shadow ? d.shadow.agreement : null), cell: shadowCell},
  {key: "ts", label: "last sample", num: true, sort: (d) => d.ts, cell: (d) => el("span", {
    title: fmtTime(d.ts), text: missing(d.ts) ? DASH : fmtAgo(d.ts) + " ago"})},
];

function statusCell(d) {
  const label = d.online === null ? DASH : d.online ? (d.state || "online") : "offline";
  const since = missing(d.state_since) ? "" : ` for ${fmtAgo(d.state_since)}`;
  return el("span", {class: "status " + (d.online ? "online" : "offline"), title: "since " + fmtTime(d.state_since),
                     text: label + since});
}

function modelCell(d) {
  if (missing(d.model_name)) return DASH;
  const label = modelLabel(d.model_name, d.model_version);
  return el("a", {href: "/model?name=" + encodeURIComponent(d.model_name), text: label});
}

function p99Cell(d) {
  const text = `${fmtNum(d.p99_ms, 1)} / ${fmtNum(d.latency_budget_ms, 0)}`;
  return el("span", {class: overBudget(d) ? "bad" : null, title: overBudget(d) ? "p99 over budget" : null, text});
}

// Messages the device numbered (seq) but never delivered: its outbox dropped them while offline or full.
const LOST_TITLE = "messages the device numbered but never delivered (gaps in its seq)";

function lostCell(d) {
  return el("span", {class: d.lost_on_device > 0 ? "bad" : null, title: LOST_TITLE, text: fmtNum(d.lost_on_device, 0)});
}

function deploymentCell(d) {
  if (missing(d.deployment_state)) return DASH;
  return el("span", {class: d.deploying ? "busy" : null,
                     text: d.deploying ? `${d.deployment_state} (in progress)` : d.deployment_state});
}

// A shadow deployment running beside the serving model: the candidate and its agreement with it so far.
function shadowCell(d) {
  const s = d.shadow;
  if (!s) return DASH;
  const text = s.state === "started" ? `${s.model} (starting)` : `${s.model} ${fmtNum(s.agreement, 3)}`;
  const title = `agreement ${fmtNum(s.agreement, 3)} over ${fmtNum(s.frames, 0)} frames, window ${fmtNum(s.window_agreement, 3)}`
    + `, candidate p99 ${fmtNum(s.candidate_p99_ms, 1)} ms (from ${s.source === "telemetry" ? "telemetry" : "shadow events"})`;
  return el("span", {class: "busy", title, text});
}

const view = {rows: [], sortKey: "device_id", sortDir: 1};

function compare(a, b) {
  const col = COLUMNS.find((c) => c.key === view.sortKey);
  const va = col.sort(a), vb = col.sort(b);
  if (missing(va) && missing(vb)) return 0;
  if (missing(va)) return 1; // missing values sort last in both directions
  if (missing(vb)) return -1;
  if (va < vb) return -view.sortDir;
  if (va > vb) return view.sortDir;
  return 0;
}

function keep(d) {
  const show = document.getElementById("show").value;
  if (show === "online" && !d.online) return false;
  if (show === "offline" && d.online) return false;
  if (show === "over" && !overBudget(d)) return false;
  if (show === "deploying" && !d.deploying) return false;
  if (show === "throttled" && !d.throttled) return false;
  if (show === "shadow" && !d.shadow) return false;
  const needle = document.getElementById("filter").value.trim().toLowerCase();
  if (!needle) return true;
  const hay = [d.device_id, d.module, d.model_name, d.model_version, d.precision, d.state, d.deployment_state,
               d.shadow ? d.shadow.model : null]
    .filter((v) => !missing(v)).join(" ").toLowerCase();
  return hay.includes(needle);
}

function buildHead() {
  // Built once: a header rebuilt on every refresh would swallow a click that lands during the refresh.
  const tr = document.querySelector("#fleet thead tr");
  tr.replaceChildren(...COLUMNS.map((col) => {
    const th = el("th", {"data-key": col.key, class: col.num ? "num sortable" : "sortable", text: col.label});
    th.addEventListener("click", () => {
      view.sortDir = view.sortKey === col.key ? -view.sortDir : 1;
      view.sortKey = col.key;
      render();
    });
    return th;
  }));
}

function renderHead() {
  for (const th of document.querySelectorAll("#fleet thead th")) {
    const col = COLUMNS.find((c) => c.key === th.dataset.key);
    const sorted = col.key === view.sortKey;
    th.textContent = col.label + (sorted ? (view.sortDir > 0 ? " ▲" : " ▼") : "");
    if (sorted) th.setAttribute("aria-sort", view.sortDir > 0 ? "ascending" : "descending");
    else th.removeAttribute("aria-sort");
  }
}

function render() {
  renderHead();
  const rows = view.rows.filter(keep).sort(compare);
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren(...rows.map((d) => el("tr", {"data-device": d.device_id},
    COLUMNS.map((col) => el("td", {class: col.num ? "num" : null, "data-key": col.key}, [col.cell(d)])))));
  const online = view.rows.filter((d) => d.online).length;
  document.getElementById("counts").textContent =
    `${rows.length} shown of ${view.rows.length} devices, ${online} online`;
}

async function refresh() {
  let delay = 5;
  try {
    const data = await getJSON("/api/fleet");
    view.rows = data.devices;
    delay = data.refresh_s || delay;
    showError(null);
    setUpdated(data.generated);
    render();
    document.body.dataset.loaded = "true";
  } catch (err) {
    showError("Could not load the fleet: " + err.message);
  }
  window.setTimeout(refresh, delay * 1000);
}

buildHead();
document.getElementById("filter").addEventListener("input", render);
document.getElementById("show").addEventListener("change", render);
refresh();
