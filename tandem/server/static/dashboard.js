// Tandem live dashboard: polls /dashboard/data every 1.5 s and charts the series with uPlot.
"use strict";
const KIND = document.body.dataset.kind;
const POLL_MS = 1500;
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
const CHARTS = [  // id, title, [series key, label]
  ["requests", "Requests running / waiting per level", [["running_L1", "running L1"], ["running_L2", "running L2"],
    ["running_L3", "running L3"], ["waiting_L1", "waiting L1"], ["waiting_L2", "waiting L2"], ["waiting_L3", "waiting L3"]]],
  ["kv", "KV usage, utilisation, host tier used (0-1)", [["kv_usage", "KV usage"], ["kv_utilization", "utilisation"],
    ["host_used", "host tier used"]]],
  ["prefix", "Prefix-cache hit ratio (last minute)", [["prefix_hit_ratio", "hit ratio"]]],
  ["latency", "TTFT and E2E, last minute (ms)", [["ttft_p50_ms", "TTFT p50"], ["ttft_p99_ms", "TTFT p99"],
    ["e2e_p50_ms", "E2E p50"], ["e2e_p99_ms", "E2E p99"]]],
  ["itl", "ITL, last minute (ms)", [["itl_p50_ms", "ITL p50"], ["itl_p90_ms", "ITL p90"], ["itl_p99_ms", "ITL p99"]]],
  ["throughput", "Output tokens/s", [["output_tok_s", "output tok/s"]]],
  ["preemptions", "Preemptions/s by mode", [["preempt_swap_s", "swap"], ["preempt_recompute_s", "recompute"]]],
];
if (KIND === "router") {
  CHARTS.push(["transfers", "P/D KV transfers", [["kv_transfer_mb_s", "MB/s"], ["kv_transfer_ms", "ms per transfer (last minute)"]]]);
}
const plots = {};
let updates = 0;

function key() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) { sessionStorage.setItem("tandem-key", decodeURIComponent(m[1])); history.replaceState(null, "", location.pathname); }
  return sessionStorage.getItem("tandem-key");
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined) return "-";
  return Math.abs(v) >= 100 ? Math.round(v).toLocaleString() : v.toFixed(digits);
}
const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");

function tiles(now) {
  const win = now.window_s === null ? "since start" : `last ${Math.round(now.window_s)} s`;
  const level = (kind) => ["L1", "L2", "L3"].map((l) => fmt(now[`${kind}_${l}`], 0)).join(" / ");
  const items = [
    ["running L1 / L2 / L3", level("running")], ["waiting L1 / L2 / L3", level("waiting")],
    ["KV usage", pct(now.kv_usage)], ["KV utilisation", pct(now.kv_utilization)],
    ["KV free blocks", `${fmt(now.kv_free_blocks, 0)} of ${fmt(now.kv_total_blocks, 0)}`],
    ["host tier used", now.host_used === null ? "no swap space" : pct(now.host_used) + `, ${fmt(now.swapped, 0)} swapped`],
    [`prefix hit (${win})`, pct(now.prefix_hit_ratio)], ["output tok/s", fmt(now.output_tok_s)],
    [`TTFT p50 / p99 ms (${win})`, `${fmt(now.ttft_p50_ms)} / ${fmt(now.ttft_p99_ms)}`],
    [`ITL p50 / p99 ms (${win})`, `${fmt(now.itl_p50_ms)} / ${fmt(now.itl_p99_ms)}`],
    [`E2E p50 / p99 ms (${win})`, `${fmt(now.e2e_p50_ms)} / ${fmt(now.e2e_p99_ms)}`],
    ["preemptions swap / recompute", `${fmt(now.preemptions_swap, 0)} / ${fmt(now.preemptions_recompute, 0)}`],
  ];
  if (KIND === "router") items.push(["P/D KV transfers", `${fmt(now.kv_transfers, 0)}, ${fmt(now.kv_transfer_ms)} ms each`]);
  document.getElementById("tiles").innerHTML = items.map(([k, v]) => `<div class="tile"><b>${v}</b><span>${k}</span></div>`).join("");
}

function instances(insts) {
  if (!insts) return;
  document.getElementById("instances-box").hidden = false;
  const rows = Object.entries(insts).map(([id, i]) => `<tr><td>${id}</td><td>${i.model}</td><td>${i.role}${i.elastic ? " (elastic)" : ""}</td>` +
    `<td>${i.healthy ? "up" : "down"}${i.draining ? ", draining" : ""}</td><td>${i.inflight}</td><td>${i.num_running}</td>` +
    `<td>${i.num_waiting}</td><td>${i.num_preempted}</td><td>${pct(i.kv_usage)}</td></tr>`);
  document.getElementById("instances").innerHTML = "<tr><th>instance</th><th>model</th><th>role</th><th>state</th>" +
    "<th>in flight</th><th>running</th><th>waiting</th><th>preempted</th><th>KV usage</th></tr>" + rows.join("");
}

function models(rows) {
  const names = Object.keys(rows || {});
  document.getElementById("models-box").hidden = names.length === 0;
  const ms = (a, b) => `${fmt(a)} / ${fmt(b)}`;
  const body = names.map((m) => { const r = rows[m]; return `<tr><td>${m}</td><td>${fmt(r.requests_s, 2)}</td>` +
    `<td>${fmt(r.running, 0)} / ${fmt(r.waiting, 0)}</td><td>${fmt(r.output_tok_s)}</td>` +
    `<td>${ms(r.ttft_p50_ms, r.ttft_p99_ms)}</td><td>${fmt(r.e2e_p50_ms)}</td><td>${pct(r.kv_usage)}</td></tr>`; });
  document.getElementById("models").innerHTML = "<tr><th>model</th><th>requests done/s</th><th>running / waiting</th>" +
    "<th>output tok/s</th><th>TTFT p50 / p99 ms</th><th>E2E p50 ms</th><th>KV usage</th></tr>" + body.join("");
}

function chart(id, title, series, data) {
  const cols = [data.t, ...series.map(([k]) => data[k] || data.t.map(() => null))];
  let box = document.getElementById("chart-" + id);
  if (!box) {
    box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + id;
    box.innerHTML = `<h3>${title}</h3>`;
    document.getElementById("charts").appendChild(box);
    plots[id] = new uPlot({ width: 440, height: 200, scales: { x: { time: true } }, axes: [{}, { size: 64 }],
      series: [{}, ...series.map(([, label], i) => ({ label, stroke: COLORS[i % COLORS.length], spanGaps: false }))] }, cols, box);
  } else {
    plots[id].setData(cols);
  }
  box.dataset.points = cols.slice(1).reduce((n, c) => n + c.filter((v) => v !== null).length, 0);
}

async function poll() {
  const k = key();
  const status = document.getElementById("status");
  try {
    const r = await fetch("/dashboard/data", { headers: k ? { Authorization: "Bearer " + k } : {} });
    if (r.status === 401) {
      sessionStorage.removeItem("tandem-key");
      document.getElementById("main").hidden = true;
      document.getElementById("auth").hidden = false;
      status.textContent = "API key needed";
      return;
    }
    const d = await r.json();
    document.getElementById("auth").hidden = true;
    document.getElementById("main").hidden = false;
    tiles(d.now);
    models(d.now.models);
    instances(d.instances);
    for (const [id, title, series] of CHARTS) chart(id, title, series, d.series);
    updates += 1;
    status.dataset.updates = updates;
    status.textContent = `live: ${d.series.t.length} points, updated ${new Date(d.now.t * 1000).toLocaleTimeString()}`;
  } catch (e) {
    status.textContent = "cannot reach the server: " + e;
  }
}

document.getElementById("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("tandem-key", document.getElementById("key").value);
  poll();
});
poll();
setInterval(poll, POLL_MS);
