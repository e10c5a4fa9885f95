// keyscale's job dashboard: reads GET /status and GET /history every 2 s, draws the
// operators' key-group ranges and the timelines, and posts control requests (the session
// cookie authenticates them; the X-Keyscale-Request header is the CSRF guard).
"use strict";

const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const charts = {};

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtTime(ms) { return ms ? new Date(ms).toLocaleTimeString() : "–"; }

async function getJSON(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

async function post(path, body) {
  const r = await fetch(path, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Keyscale-Request": "1" },
    body: JSON.stringify(body || {}),
  });
  const answer = await r.json();
  if (!r.ok) throw new Error(answer.error || r.status);
  return answer;
}

// The key-group space [0, max) as a strip: one rectangle per subtask, as wide as its range.
function drawOperator(uid, op, maxParallelism) {
  const div = document.createElement("div");
  div.className = "operator";
  div.dataset.operator = uid;
  const subs = op.subtasks || [];
  const ranges = (op.ranges || []).map((r) => r.split("-").map(Number));
  const width = 1000, height = 64;
  let svg = `<svg viewBox="0 0 ${width} ${height}" preserveAspectRatio="none" role="img" aria-label="key groups of ${uid}">`;
  ranges.forEach(([start, end], i) => {
    const x = (start / maxParallelism) * width, w = ((end - start + 1) / maxParallelism) * width;
    const sub = subs.find((s) => s.subtask === i) || {};
    const keys = (sub.state_keys != null ? `${sub.state_keys.toLocaleString()} keys` : "") + (sub.state_bytes != null ? ` · ${fmtBytes(sub.state_bytes)}` : "");
    svg += `<rect class="subtask" x="${x}" y="0" width="${Math.max(w - 1, 1)}" height="${height}" fill="${COLORS[i % COLORS.length]}">`;
    svg += `<title>subtask ${i}: key groups ${start}..${end} ${keys}</title></rect>`;
    svg += `<text x="${x + 6}" y="24" fill="#fff" font-size="14">s${i} · ${start}..${end}</text>`;
    svg += `<text x="${x + 6}" y="46" fill="#fff" font-size="12">${keys}${sub.records != null ? ` · ${sub.records.toLocaleString()} rec/batch` : ""}</text>`;
  });
  svg += "</svg>";
  const kind = op.operator_state ? "operator state" : `${op.parallelism} subtasks over ${maxParallelism} key groups`;
  div.innerHTML = `<h3>${uid}</h3>${op.operator_state ? "" : svg}<div class="caption">${kind}</div>`;
  return div;
}

function markers(events) {
  // uPlot hook: a vertical line at each rescale or autoscaler decision.
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        for (const e of events) {
          const x = u.valToPos(e.time_ms / 1000, "x", true);
          if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
          ctx.strokeStyle = e.type === "autoscaler" ? "#b07aa1" : "#e15759";
          ctx.setLineDash([4, 3]);
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

function chart(id, title, label, data, events, stepped) {
  const el = document.getElementById(id);
  const opts = {
    title, width: el.clientWidth - 8, height: 200, plugins: [markers(events)],
    scales: { x: { time: true } },
    series: [{}, { label, stroke: "#4e79a7", width: 2, ...(stepped ? { paths: uPlot.paths.stepped({ align: 1 }) } : {}) }],
  };
  if (charts[id]) charts[id].destroy();
  charts[id] = new uPlot(opts, data, el);
}

function render(status, history) {
  document.title = `keyscale: ${status.job}`;
  document.getElementById("job").textContent = status.job;
  const state = document.getElementById("state");
  state.textContent = status.state;
  state.className = `badge ${status.state}`;
  document.getElementById("summary").textContent =
    `last checkpoint ${status.last_checkpoint ?? "–"}` + (status.watermark ? ` · watermark ${status.watermark}` : "");
  const pending = status.pending_rescale;
  document.getElementById("pending").textContent = pending
    ? `rescale pending: ${Object.entries(pending.parallelism).map(([u, p]) => `${u === "*" ? "all" : u} → ${p}`).join(", ")}` : "";
  const err = status.last_error;
  document.getElementById("error").hidden = !err;
  if (err) {
    document.getElementById("error-message").textContent = `batch ${err.batch}, ${fmtTime(err.time_ms)}: ${err.message}`;
    document.getElementById("error-trace").textContent = err.traceback;
  }

  const ops = document.getElementById("operators");
  ops.replaceChildren(...Object.entries(status.operators || {}).map(([uid, op]) => drawOperator(uid, op, op.max_parallelism || 1)));

  document.getElementById("outputs").replaceChildren(...(status.outputs || []).map((o) => {
    const li = document.createElement("li");
    li.textContent = o.kind === "output"
      ? `${o.from ? `'${o.from}'` : "the input"} → ${o.sink}`
      : `${o.kind}${o.from ? ` of '${o.from}'` : ""} → ${o.sink}`;
    return li;
  }));

  const batches = history.batches;
  const t = batches.map((b) => b.time_ms / 1000);
  const events = history.events;
  chart("chart-rate", "Input rate", "records/s", [t, batches.map((b) => (b.seconds > 0 ? b.records / b.seconds : 0))], events);
  chart("chart-duration", "Batch duration", "seconds", [t, batches.map((b) => b.seconds)], events);
  chart("chart-backlog", "Backlog", "records", [t, batches.map((b) => b.backlog)], events);
  chart("chart-parallelism", "Parallelism", "subtasks", [t, batches.map((b) => Math.max(0, ...Object.values(b.parallelism)))], events, true);

  document.getElementById("events").replaceChildren(...events.slice().reverse().map((e) => {
    const li = document.createElement("li");
    li.textContent = `batch ${e.batch} (${fmtTime(e.time_ms)}): ${e.type} of '${e.operator}' ${e.from} → ${e.to}: ${e.reason}`;
    return li;
  }));
  const rows = (sel, items, cells) => document.querySelector(`${sel} tbody`).replaceChildren(...items.map((it) => {
    const tr = document.createElement("tr");
    for (const c of cells(it)) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    return tr;
  }));
  rows("#checkpoints", batches.slice(-20).reverse(), (b) => [b.batch, fmtTime(b.time_ms), b.seconds.toFixed(2), b.records.toLocaleString(), fmtBytes(b.checkpoint_bytes)]);
  rows("#savepoints", history.savepoints.slice().reverse(), (s) => [s.batch, fmtTime(s.time_ms), s.path]);
  document.body.dataset.loaded = "true";
}

async function refresh() {
  try {
    const [status, history] = await Promise.all([getJSON("/status"), getJSON("/history")]);
    render(status, history);
  } catch (e) {
    document.getElementById("result").textContent = `the job does not answer (${e.message}); it may have stopped`;
  }
}

function act(button, fn) {
  document.getElementById(button).addEventListener("click", async () => {
    const out = document.getElementById("result");
    try { out.textContent = await fn(); } catch (e) { out.textContent = `refused: ${e.message}`; }
    refresh();
  });
}

act("rescale", async () => {
  const p = Number(document.getElementById("parallelism").value);
  await post("/rescale", { parallelism: p });
  return `rescale to ${p} requested: applied at the next batch`;
});
act("savepoint", async () => `savepoint written: ${(await post("/savepoint")).savepoint}`);
act("stop", async () => {
  if (!confirm("Stop the job after a final savepoint?")) return "not stopped";
  return `stopping; final savepoint ${(await post("/stop", { savepoint: true })).savepoint}`;
});

refresh();
setInterval(refresh, 2000);
