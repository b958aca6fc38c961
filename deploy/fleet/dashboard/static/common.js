// Shared helpers of the dashboard pages. Every string from a device goes into the page through
// textContent or an attribute value (never innerHTML), so markup in a device id or model name stays text.
"use strict";

const DASH = "\u2014"; // shown for every missing value: a device that cannot measure something never shows 0

function el(tag, attrs, children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children || []) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function missing(value) {
  return value === null || value === undefined || (typeof value === "number" && !Number.isFinite(value));
}

function fmtNum(value, digits) {
  if (missing(value)) return DASH;
  return Number(value).toFixed(digits === undefined ? 1 : digits);
}

function fmtBool(value, yes, no) {
  if (missing(value)) return DASH;
  return value ? (yes || "yes") : (no || "no");
}

function fmtText(value) {
  return missing(value) || value === "" ? DASH : String(value);
}

function fmtTime(ts) {
  if (missing(ts)) return DASH;
  const d = new Date(ts * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

function fmtAgo(ts, now) {
  if (missing(ts)) return DASH;
  let s = Math.max(0, Math.round((now === undefined ? Date.now() / 1000 : now) - ts));
  if (s < 90) return `${s} s`;
  if (s < 5400) return `${Math.round(s / 60)} min`;
  if (s < 172800) return `${Math.round(s / 3600)} h`;
  return `${Math.round(s / 86400)} d`;
}

function fmtDuration(seconds) {
  if (missing(seconds)) return DASH;
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  return `${(seconds / 60).toFixed(1)} min`;
}

function modelLabel(name, version) {
  if (missing(name)) return DASH;
  return missing(version) ? String(name) : `${name}@${version}`;
}

function deviceLink(deviceId) {
  return el("a", {href: "/device?id=" + encodeURIComponent(deviceId), text: deviceId, class: "device-link"});
}

async function getJSON(url) {
  const response = await fetch(url, {headers: {Accept: "application/json"}, credentials: "same-origin"});
  let body = null;
  try { body = await response.json(); } catch (_) { body = null; }
  if (!response.ok) {
    const why = body && body.error ? body.error : `${response.status} ${response.statusText}`;
    throw new Error(why);
  }
  return body;
}

function showError(message) {
  const box = document.getElementById("error");
  if (!box) return;
  box.hidden = !message;
  box.textContent = message || "";
}

function setUpdated(ts) {
  const node = document.getElementById("updated");
  if (node) node.textContent = "updated " + fmtTime(ts);
}

function param(name) {
  return new URLSearchParams(window.location.search).get(name);
}
