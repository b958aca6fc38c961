// One model across the fleet: latency and energy per frame on every device that ran it, grouped by module.
"use strict";

const HEAD = ["device", "version", "precision", "samples", "fps", "p50 ms", "p99 ms", "p99 max ms", "energy mJ/frame",
              "p99 relative"];

function bar(value, max) {
  if (missing(value) || !max) return DASH;
  const outer = el("span", {class: "bar", title: `${fmtNum(value, 1)} ms`});
  const inner = el("span", {class: "fill"});
  inner.style.width = `${Math.max(1, Math.round((100 * value) / max))}%`;
  outer.append(inner);
  return outer;
}

function deviceRow(d, maxP99) {
  const cells = [deviceLink(d.device_id), fmtText(d.model_version), fmtText(d.precision), fmtNum(d.samples, 0),
                 fmtNum(d.fps, 1), fmtNum(d.p50_ms, 1), fmtNum(d.p99_ms, 1), fmtNum(d.p99_max_ms, 1),
                 fmtNum(d.energy_mj_per_frame, 1), bar(d.p99_ms, maxP99)];
  return el("tr", {"data-device": d.device_id}, cells.map((c, i) => el("td", {class: i >= 3 && i < 9 ? "num" : null}, [c])));
}

function moduleRow(group) {
  const devices = new Set(group.devices.map((d) => d.device_id)).size;
  const label = `module ${fmtText(group.module)} · ${devices} device(s)`;
  return el("tr", {class: "group"}, [
    el("th", {colspan: 5, text: label}), el("td", {class: "num", text: fmtNum(group.p50_ms, 1)}),
    el("td", {class: "num", text: fmtNum(group.p99_ms, 1)}), el("td", {text: ""}),
    el("td", {class: "num", text: fmtNum(group.energy_mj_per_frame, 1)}), el("td", {text: ""}),
  ]);
}

function renderModel(data) {
  document.querySelector("#per-device thead tr").replaceChildren(...HEAD.map((h) => el("th", {text: h})));
  const all = data.modules.flatMap((g) => g.devices).map((d) => d.p99_ms).filter((v) => !missing(v));
  const maxP99 = all.length ? Math.max(...all) : 0;
  const rows = data.modules.flatMap((g) => [moduleRow(g), ...g.devices.map((d) => deviceRow(d, maxP99))]);
  document.querySelector("#per-device tbody").replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, [el("td", {colspan: HEAD.length, class: "muted",
                                                      text: "no telemetry for this model in this range"})])]));
}

async function loadModels(chosen) {
  const data = await getJSON("/api/models");
  const select = document.getElementById("model");
  const names = data.models.map((m) => m.model_name);
  if (chosen && !names.includes(chosen)) names.unshift(chosen);
  select.replaceChildren(...names.map((n) => el("option", {value: n, text: n, selected: n === chosen ? "" : null})));
  return chosen || names[0] || null;
}

async function refresh() {
  const range = document.getElementById("range").value;
  try {
    const name = await loadModels(document.getElementById("model").value || param("name"));
    if (!name) { showError("No device runs a model yet."); return; }
    document.getElementById("title").textContent = name;
    document.title = `${name} — edge dashboard`;
    const data = await getJSON(`/api/model?name=${encodeURIComponent(name)}&range=${encodeURIComponent(range)}`);
    showError(null);
    setUpdated(Date.now() / 1000);
    renderModel(data);
    document.body.dataset.loaded = "true";
  } catch (err) {
    showError("Could not load the model view: " + err.message);
  }
}

document.getElementById("range").addEventListener("change", refresh);
document.getElementById("model").addEventListener("change", () => {
  const name = document.getElementById("model").value;
  window.history.replaceState(null, "", "/model?name=" + encodeURIComponent(name));
  refresh();
});
refresh();
