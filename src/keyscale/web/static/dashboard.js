// keyscale's job dashboard: reads GET /status and GET /history every 2 s, draws the
// operators' key-group ranges and the timelines, looks up keys (GET /state/<uid>), and posts
// control requests (the session cookie authenticates them; the X-Keyscale-Request header is
// the CSRF guard).
"use strict";

const COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
const charts = {};
let jobParallelism = [];  // the keyed operators' parallelism, from the last /status
let edited = false;  // the user typed into the box: refreshes leave it alone until Rescale

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtTime(ms) { return ms ? new Date(ms).toLocaleTimeString() : "–"; }

// An axis label short enough to read at a glance: 950, 1.2k, 35k, 1.5M.
function fmtCompact(v) {
  const a = Math.abs(v);
  for (const [div, unit] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (a >= div) return `${+(v / div).toFixed(a >= 10 * div ? 0 : 1)}${unit}`;
  }
  return `${+v.toFixed(a >= 10 || a === 0 ? 0 : a >= 1 ? 1 : 2)}`;
}

// uPlot gives a y axis a fixed 50 px, so "12,000" lost its first digits at the canvas edge:
// size the axis to its widest label instead (uPlot calls this again once the labels are known),
// never under those 50 px, which the x axis's first date label needs on its left.
function axisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;  // uPlot's guard: stop re-measuring after two passes
  const widest = (values || []).reduce((w, v) => (String(v).length > w.length ? String(v) : w), "");
  u.ctx.font = axis.font[0];
  return Math.max(50, Math.ceil(axis.ticks.size + axis.gap + 6 + u.ctx.measureText(widest).width / devicePixelRatio));
}

// The keyed operators' parallelism (operators with key groups: what a rescale of the job changes).
function keyedParallelism(status) {
  return Object.values(status.operators || {}).filter((op) => op.ranges).map((op) => op.parallelism);
}

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
function operatorStrip(uid, op, maxParallelism) {
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
  return `<h3>${uid}</h3>${op.operator_state ? "" : svg}<div class="caption">${kind}</div>`;
}

// A key lookup box: GET /state/<uid>?key=K answers what the key holds at the last committed
// checkpoint (its batch and key group with it). Its box survives the page's refreshes.
function lookupForm(uid) {
  const form = document.createElement("form");
  form.className = "lookup";
  form.dataset.lookup = uid;
  const label = document.createElement("label");
  const input = document.createElement("input");
  input.name = "key";
  input.placeholder = "a key (several columns: a JSON array)";
  label.append("Look up a key ", input);
  const button = document.createElement("button");
  button.type = "submit";
  button.textContent = "Look up";
  const answer = document.createElement("div");
  answer.className = "answer";
  answer.setAttribute("role", "status");
  form.append(label, button, answer);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const key = input.value;
    if (!key) { answer.textContent = "enter a key"; return; }
    answer.textContent = "…";
    try {
      const r = await fetch(`/state/${encodeURIComponent(uid)}?key=${encodeURIComponent(key)}`, { credentials: "same-origin" });
      const body = await r.json();
      showAnswer(answer, r.ok ? body : null, r.ok ? null : body.error || String(r.status));
    } catch (err) {
      showAnswer(answer, null, `the job does not answer (${err.message})`);
    }
  });
  return form;
}

function showAnswer(el, a, error) {
  if (error) { el.className = "answer refused"; el.textContent = error; return; }
  el.className = a.found ? "answer found" : "answer missing";
  const facts = document.createElement("div");
  facts.className = "facts";
  const fact = (cls, text) => { const s = document.createElement("span"); s.className = cls; s.textContent = text; return s; };
  facts.append(fact("batch", `batch ${a.batch}`), " · ", fact("key-group", `key group ${a.key_group}`));
  const value = document.createElement("pre");
  value.className = "value";
  // A window operator answers its open windows; any other its states (JSON as the API gives them).
  value.textContent = a.found ? JSON.stringify(a.windows || a.state, null, 1) : a.message;
  const extras = [];
  if (a.timers) extras.push(`timers: ${JSON.stringify(a.timers)}`);
  if (a.ttl) extras.push(`ttl: ${JSON.stringify(a.ttl)}`);
  const more = document.createElement("div");
  more.className = "extras";
  more.textContent = extras.join(" · ");
  el.replaceChildren(facts, value, more);
}

// One element per operator, kept across refreshes (only its strip is drawn again), so that a
// key being typed or an answer on screen is not wiped every 2 s.
const operatorElements = {};
function drawOperator(uid, op, maxParallelism) {
  let entry = operatorElements[uid];
  if (!entry) {
    const div = document.createElement("div");
    div.className = "operator";
    div.dataset.operator = uid;
    const strip = document.createElement("div");
    div.append(strip);
    entry = operatorElements[uid] = { div, strip, form: null };
  }
  entry.strip.innerHTML = operatorStrip(uid, op, maxParallelism);
  if (!op.operator_state && !entry.form) {  // a keyed operator: its state can be looked up
    entry.form = lookupForm(uid);
    entry.div.append(entry.form);
  }
  return entry.div;
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

const SERIES_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2"];

function chart(id, title, label, data, events, fmt, stepped) {
  const el = document.getElementById(id);
  const opts = {
    title, width: el.clientWidth - 8, height: 200, plugins: [markers(events)],
    scales: { x: { time: true } },
    axes: [{}, { size: axisSize, values: (u, ticks) => ticks.map(fmt), ...(stepped ? { incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500] } : {}) }],
    // ``label``: one series' name, or several (one per data column after the times).
    series: [{}, ...(Array.isArray(label) ? label : [label]).map((l, i) => ({
      label: l, stroke: SERIES_COLORS[i % SERIES_COLORS.length], width: 2, value: (u, v) => (v == null ? "–" : fmt(v)),
      ...(stepped ? { paths: uPlot.paths.stepped({ align: 1 }) } : {}),
    }))],
  };
  if (charts[id]) charts[id].destroy();
  el.replaceChildren();
  charts[id] = new uPlot(opts, data, el);
}

// A timeline the job has no numbers for: say so, and why, rather than draw empty axes.
function noChart(id, title, why) {
  if (charts[id]) { charts[id].destroy(); delete charts[id]; }
  const h = document.createElement("div");
  h.className = "u-title";
  h.textContent = title;
  const p = document.createElement("p");
  p.className = "na";
  p.textContent = why;
  document.getElementById(id).replaceChildren(h, p);
}

// With a latency target (keyscale run --latency-target): the last batch's read limit, whose it
// is, and whether the target can be met (the status's batch_size; its reason is the tooltip's).
function batchSize(size) {
  if (!size) return "";
  const limit = size.records == null ? "no read limit" : `read limit ${fmtCompact(size.records)} records (${size.limited_by})`;
  return ` · ${limit} for the ${size.target_seconds} s latency target: ${size.meets_target ? "met" : "not met"}`;
}

// With an SLO (--slo): the target, this run's share of batches within it, and what the
// autoscaler's last decision forecast (each decision's reason is in the events list).
function sloSummary(scaling) {
  if (!scaling || !scaling.slo) return "";
  const share = scaling.slo_attainment == null ? "not measured yet" : `${(100 * scaling.slo_attainment).toFixed(1)}% of batches within it`;
  const forecasts = Object.values(scaling.last_decisions || {}).map((d) => d.forecast).filter((f) => f);
  const f = forecasts.length ? ` · forecast ${fmtCompact(Math.max(...forecasts.map((x) => x.input_rate)))}/s (${forecasts[0].method})` : "";
  return ` · SLO ${scaling.slo}: ${share}${f}`;
}

function render(status, history) {
  document.title = `keyscale: ${status.job}`;
  document.getElementById("job").textContent = status.job;
  const state = document.getElementById("state");
  state.textContent = status.state;
  state.className = `badge ${status.state}`;
  document.getElementById("summary").textContent =
    `last checkpoint ${status.last_checkpoint ?? "–"}` + (status.watermark ? ` · watermark ${status.watermark}` : "") + batchSize(status.batch_size) + sloSummary(status.scaling);
  document.getElementById("summary").title = status.batch_size ? status.batch_size.reason : "";
  const pending = status.pending_rescale;
  document.getElementById("pending").textContent = pending
    ? `rescale pending: ${Object.entries(pending.parallelism).map(([u, p]) => `${u === "*" ? "all" : u} → ${p}`).join(", ")}` : "";
  // The box shows the job's parallelism (it changes by a live rescale, the CLI, the
  // autoscaler, or a start at another -p) unless the user is entering a number of their own.
  jobParallelism = keyedParallelism(status);
  const field = document.getElementById("parallelism");
  if (jobParallelism.length && !edited && document.activeElement !== field) field.value = Math.max(...jobParallelism);
  const err = status.last_error;
  document.getElementById("error").hidden = !err;
  if (err) {
    document.getElementById("error-message").textContent = `batch ${err.batch}, ${fmtTime(err.time_ms)}: ${err.message}`;
    document.getElementById("error-trace").textContent = err.traceback;
  }

  const ops = document.getElementById("operators");
  const shown = Object.entries(status.operators || {}).map(([uid, op]) => drawOperator(uid, op, op.max_parallelism || 1));
  for (const child of [...ops.children]) if (!shown.includes(child)) child.remove();
  shown.forEach((div, i) => { if (ops.children[i] !== div) ops.insertBefore(div, ops.children[i] || null); });

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
  chart("chart-rate", "Input rate", "records/s", [t, batches.map((b) => (b.seconds > 0 ? b.records / b.seconds : 0))], events,
    (v) => `${fmtCompact(v)}/s`);
  chart("chart-duration", "Batch duration", "seconds", [t, batches.map((b) => b.seconds)], events, (v) => `${fmtCompact(v)} s`);
  // End-to-end latency: per record, from its append to the source to the commit of its
  // batch's output. A source that keeps no append times (a Spark rate or table source, a
  // Redis log) measures none: said so, never drawn as 0.
  if (batches.every((b) => b.latency == null)) {
    noChart("chart-latency", "End-to-end latency", "n/a: no batch measured it yet. keyscale measures it from each record's append time: "
      + "Kafka's timestamp (ks.kafka.kafka_source), a local log's segment write (ks.sources.log_source), a file's modification time "
      + "(Spark file sources with a keyed stage). Spark's rate, table and Kafka sources and Redis logs have none.");
  } else {
    const q = (k) => batches.map((b) => (b.latency ? b.latency[k] : null));
    // lag: how long each batch's oldest record had waited when the batch began (the age of
    // the job's oldest unread record then): it grows while the job falls behind its input.
    chart("chart-latency", "End-to-end latency", ["p50", "p99", "max", "lag"],
      [t, q("p50_seconds"), q("p99_seconds"), q("max_seconds"), q("lag_seconds")], events, (v) => `${fmtCompact(v)} s`);
  }
  // The backlog is what a keyscale log source has not read yet (Kafka lag); a Spark source
  // (files, a table, Spark's Kafka reader) does not report it, so every batch has null.
  if (batches.length && batches.every((b) => b.backlog == null)) {
    noChart("chart-backlog", "Backlog", "n/a: this job's source does not tell how much input is waiting (Spark's file, "
      + "table and Kafka sources do not). keyscale measures the backlog of its own sources: ks.kafka.kafka_source and ks.sources.log_source.");
  } else {
    chart("chart-backlog", "Backlog", "records", [t, batches.map((b) => b.backlog)], events, fmtCompact);
  }
  chart("chart-parallelism", "Parallelism", "subtasks", [t, batches.map((b) => Math.max(0, ...Object.values(b.parallelism)))], events,
    (v) => (Number.isInteger(v) ? String(v) : ""), true);

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
  rows("#checkpoints", batches.slice(-20).reverse(), (b) => [b.batch, fmtTime(b.time_ms), b.seconds.toFixed(2), b.records.toLocaleString(),
    b.latency ? `${b.latency.p99_seconds < 100 ? b.latency.p99_seconds.toFixed(2) : fmtCompact(b.latency.p99_seconds)} s` : "–",
    fmtBytes(b.checkpoint_bytes)]);
  rows("#savepoints", history.savepoints.slice().reverse(), (s) => [s.batch, fmtTime(s.time_ms), s.path]);
  document.body.dataset.loaded = "true";
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);  // lets a test wait for the next one
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

document.getElementById("parallelism").addEventListener("input", () => { edited = true; });
act("rescale", async () => {
  const p = Number(document.getElementById("parallelism").value);
  const typed = edited;
  edited = false;
  // The job as it is now, not as the page last drew it: a rescale from elsewhere in the
  // last two seconds must not be undone by a box that had not caught up yet.
  const now = keyedParallelism(await getJSON("/status"));
  const same = `the job already runs at parallelism ${[...new Set(now)].join(", ")}: nothing to rescale`;
  if (!typed) return now.length ? same : "enter the parallelism to rescale to";
  if (now.length && now.every((n) => n === p)) return same;
  if (!Number.isInteger(p) || p < 1) throw new Error("the parallelism must be a whole number of subtasks, 1 or more");
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
