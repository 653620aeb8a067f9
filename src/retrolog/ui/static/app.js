// The retrolog dashboard: a runs table, charts, a run's details and replays, over /api
// (docs/ui.md). Plain script, no build step; charts are uPlot's. The view's state lives in
// the URL's query so a view can be reloaded or shared; the launch token never does.
"use strict";

const TOKEN_KEY = "retrolog-token";
const PAGE = 100;

const token = (() => {
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
  }
  return given || sessionStorage.getItem(TOKEN_KEY) || "";
})();

const state = {
  where: "", columns: [], sort: "started_at", desc: true, offset: 0, selected: [],
  charts: [], label: "", sx: "", sy: "", sagg: "last", x: "step", log: false, smooth: 0,
  lo: null, hi: null, run: null, group: "", compare: false,
};
const view = { total: 0, rows: [], chart: null, series: [], groups: null, job: null };
window.__retrolog = view; // for the browser tests: the drawn chart and its data

const $ = (id) => document.getElementById(id);

function readState() {
  const q = new URLSearchParams(location.search);
  state.where = q.get("where") || "";
  state.columns = (q.get("columns") || "").split(",").filter(Boolean);
  state.sort = q.get("sort") || "started_at";
  state.desc = q.get("desc") !== "0";
  state.offset = Number(q.get("offset") || 0);
  state.selected = (q.get("runs") || "").split(",").filter(Boolean);
  readChartState(q);
  state.x = q.get("x") || "step";
  state.log = q.get("log") === "1";
  state.smooth = Number(q.get("smooth") || 0);
  state.lo = q.has("lo") ? Number(q.get("lo")) : null;
  state.hi = q.has("hi") ? Number(q.get("hi")) : null;
  state.run = q.get("run");
  state.group = q.get("group") || "";
  state.compare = q.get("compare") === "1";
}

function writeState() {
  const q = new URLSearchParams();
  const put = (key, value, skip) => { if (value !== skip && value !== null) q.set(key, value); };
  put("where", state.where, "");
  put("columns", state.columns.join(","), "");
  put("sort", state.sort, "started_at");
  put("desc", state.desc ? "1" : "0", "1");
  put("offset", String(state.offset), "0");
  put("runs", state.selected.join(","), "");
  writeChartState(put);
  put("x", state.x, "step");
  put("log", state.log ? "1" : "0", "0");
  put("smooth", String(state.smooth), "0");
  put("lo", state.lo === null ? null : String(state.lo));
  put("hi", state.hi === null ? null : String(state.hi));
  put("run", state.run, null);
  put("group", state.group, "");
  put("compare", state.compare ? "1" : "0", "0");
  const text = q.toString();
  history.replaceState(null, "", text ? "?" + text : location.pathname);
}

// A newer load of the table or the chart replaces one still waiting: the older request is
// aborted, so its answer cannot overwrite the newer view, and the server stops its query
// (docs/ui.md, "Requests a client gave up on").
const pending = {};
function supersede(kind) {
  if (pending[kind]) pending[kind].abort();
  pending[kind] = new AbortController();
  return pending[kind].signal;
}
const aborted = (err) => err && err.name === "AbortError";

async function api(path, options = {}) {
  const headers = { "X-Retrolog-Token": token };
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, { ...options, headers });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function apiBytes(path, options = {}) {
  const response = await fetch(path, { ...options, headers: { "X-Retrolog-Token": token } });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(body.error || response.statusText);
  }
  return response.arrayBuffer();
}

function status(text) { $("status").textContent = text; }

// -- the runs table ------------------------------------------------------------------------

function runsQuery(extra = {}) {
  const q = new URLSearchParams({
    sort: state.sort, desc: state.desc ? "1" : "0", offset: String(state.offset),
    limit: String(PAGE), ...extra,
  });
  if (state.where) q.set("where", state.where);
  if (state.columns.length) q.set("columns", state.columns.join(","));
  return q;
}

async function loadRuns() {
  let data;
  try {
    data = await api("/api/runs?" + runsQuery(), { signal: supersede("runs") });
  } catch (err) {
    if (aborted(err)) return;
    $("where-error").textContent = err.message;
    $("where-error").hidden = false;
    return;
  }
  $("where-error").hidden = true;
  view.total = data.total;
  view.rows = data.rows;
  renderRuns(data);
  groupOptions();
  const csv = runsQuery({ format: "csv" });
  csv.delete("offset");
  csv.delete("limit");
  $("csv").href = "/api/runs?" + csv;
}

const FIELD_LABELS = {
  run_id: "run", tstamp: "started", filename: "script", status: "status",
  duration: "duration", code_version: "code version", args: "arguments",
};

function renderRuns(data) {
  const keys = ["run_id", "tstamp", "filename", "status", "duration", "code_version", "args",
    ...data.columns];
  const head = document.createElement("tr");
  head.append(document.createElement("th"));
  for (const key of keys) {
    const th = document.createElement("th");
    th.textContent = FIELD_LABELS[key] || key;
    th.dataset.key = key;
    if (key === state.sort) th.setAttribute("aria-sort", state.desc ? "descending" : "ascending");
    th.addEventListener("click", () => {
      state.desc = state.sort === key ? !state.desc : true;
      state.sort = key;
      state.offset = 0;
      writeState();
      loadRuns();
    });
    head.append(th);
  }
  $("runs").tHead.replaceChildren(head);
  const body = $("runs").tBodies[0];
  body.replaceChildren(...data.rows.map((row) => runRow(row, keys)));
  const last = Math.min(data.offset + data.rows.length, data.total);
  $("count").textContent = data.total
    ? `runs ${data.offset + 1}-${last} of ${data.total}` : "no run matches";
  $("prev").disabled = data.offset === 0;
  $("next").disabled = last >= data.total;
}

function runRow(row, keys) {
  const tr = document.createElement("tr");
  tr.dataset.run = row.run_id;
  const chosen = state.selected.includes(row.run_id);
  tr.classList.toggle("selected", chosen);
  const box = document.createElement("input");
  box.type = "checkbox";
  box.checked = chosen;
  box.setAttribute("aria-label", "select " + row.run_id);
  box.addEventListener("change", () => {
    state.selected = box.checked ? [...state.selected, row.run_id]
      : state.selected.filter((r) => r !== row.run_id);
    tr.classList.toggle("selected", box.checked);
    writeState();
  });
  const cell = document.createElement("td");
  cell.append(box);
  tr.append(cell);
  for (const key of keys) {
    const td = document.createElement("td");
    const value = row[key];
    if (key === "run_id") {
      const a = document.createElement("a");
      a.href = "#";
      a.className = "run-link";
      a.textContent = value;
      a.addEventListener("click", (event) => { event.preventDefault(); showRun(value); });
      td.append(a);
    } else {
      td.textContent = formatCell(key, value, row);
      td.title = typeof value === "object" ? JSON.stringify(value) : String(value ?? "");
    }
    if (key === "status") td.className = value;
    tr.append(td);
  }
  return tr;
}

function formatCell(key, value, row) {
  if (value === null || value === undefined) return "";
  if (key === "duration") return formatSeconds(value);
  if (key === "code_version") return value.slice(0, 10) + (row.dirty ? " +edits" : "");
  if (key === "args") return Object.entries(value).map(([k, v]) => `${k}=${v}`).join(" ");
  if (typeof value === "number") return Number.isInteger(value) ? String(value)
    : String(Number(value.toPrecision(6)));
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function formatSeconds(s) {
  if (s < 60) return s.toFixed(1) + "s";
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(Math.round(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(m / 60)}h${String(m % 60).padStart(2, "0")}m`;
}

function groupOptions() {
  // The arguments of the runs seen so far, kept as the table pages and filters.
  const select = $("chart-group");
  const known = [...select.options].map((o) => o.value).filter(Boolean);
  const all = [...new Set([...known, ...view.rows.flatMap((r) => Object.keys(r.args || {})),
    state.group].filter(Boolean))].sort();
  if (all.length === known.length) return;
  select.replaceChildren(...["", ...all].map((n) => {
    const option = document.createElement("option");
    option.value = n;
    option.textContent = n || "(no grouping)";
    return option;
  }));
  select.value = state.group;
}

// -- one run, and runs compared -----------------------------------------------------------

function facts(pairs) {
  const dl = document.createElement("dl");
  dl.className = "facts";
  for (const [key, value] of pairs) {
    if (value === null || value === undefined || value === "") continue;
    const dt = document.createElement("dt");
    dt.textContent = key;
    const dd = document.createElement("dd");
    dd.textContent = typeof value === "object" ? JSON.stringify(value) : String(value);
    dl.append(dt, dd);
  }
  return dl;
}

function heading(text) {
  const h = document.createElement("h3");
  h.textContent = text;
  return h;
}

async function showRun(runId) {
  state.run = runId;
  writeState();
  let details;
  let ckpts;
  try {
    [details, ckpts] = await Promise.all([
      api("/api/runs/" + encodeURIComponent(runId)),
      api("/api/runs/" + encodeURIComponent(runId) + "/checkpoints"),
    ]);
  } catch (err) {
    status(err.message);
    return;
  }
  $("run-title").textContent = "run " + details.run_id;
  const numerics = details.numerics || {};
  const blocks = ckpts.filter((c) => c.kind === "block");
  const ck = details.checkpoints;
  $("run-details").replaceChildren(
    facts([["status", details.status + (details.error ? ` (${details.error})` : "")],
      ["script", details.filename], ["started", details.tstamp],
      ["duration", details.duration], ["argv", (details.argv || []).join(" ")],
      ["code version", `${details.code_commit} (tree ${details.code_tree})`
        + (details.dirty ? ", with uncommitted edits" : "")],
      ["HEAD then", details.head_commit], ["host", `${details.host} (pid ${details.pid})`],
      ["python", details.python]]),
    heading("Arguments"), facts(Object.entries({ ...(details.parsed_args || {}),
      ...(details.args || {}) })),
    heading("Loops and names"),
    facts([...details.loops.map((l) => [l.name, `${l.iterations} iterations (depth ${l.depth})`]),
      ...details.names.map((n) => [n.name, `${n.count} value(s), ${n.level} level, ${n.origin}`])]),
    heading("Checkpoints"),
    facts([["written", `${ck.count} (${(ck.bytes / 1e6).toFixed(2)} MB)`],
      ["chosen / written / abandoned", ck.chosen === undefined ? null
        : `${ck.chosen} / ${ck.written} / ${ck.abandoned}`],
      ["at", blocks.map((c) => `${c.loop} ${c.iteration} (${(c.nbytes / 1e6).toFixed(2)} MB)`)
        .join(", ") + (ckpts.some((c) => c.kind === "end") ? ", the end" : "")]]),
    heading("Timing profile"),
    facts(Object.entries(details.profile).map(([phase, p]) =>
      [phase, `${p.seconds.toFixed(3)} s over ${p.count}`])),
    heading("Environment"),
    facts([["numerics", numerics], ["packages", details.packages]]),
  );
  $("run-view").hidden = false;
  showRunCharts(runId, details.names);
  try {
    const code = await api("/api/runs/" + encodeURIComponent(runId) + "/code");
    $("run-code-path").textContent = `${code.path} (${code.files.length} file(s) in the version)`;
    $("run-code").textContent = code.text;
  } catch (err) {
    $("run-code").textContent = err.message;
  }
}

function renderDiff(text) {
  const pre = document.createElement("pre");
  pre.className = "diff";
  for (const line of text.split("\n")) {
    const span = document.createElement("span");
    span.textContent = line || " ";
    if (line.startsWith("+") && !line.startsWith("+++")) span.className = "add";
    else if (line.startsWith("-") && !line.startsWith("---")) span.className = "del";
    else if (line.startsWith("@@")) span.className = "hunk";
    pre.append(span);
  }
  return pre;
}

async function showCompare() {
  if (state.selected.length < 2) {
    status("Select two or more runs to compare.");
    return;
  }
  state.compare = true;
  writeState();
  let found;
  try {
    found = await api("/api/compare?runs=" + encodeURIComponent(state.selected.join(",")));
  } catch (err) {
    status(err.message);
    return;
  }
  $("compare-title").textContent = found.runs.join(", ");
  const head = document.createElement("tr");
  head.append(...["argument", ...found.runs].map((t) => {
    const th = document.createElement("th");
    th.textContent = t;
    return th;
  }));
  const rows = Object.entries(found.args_differ).map(([name, values]) => {
    const tr = document.createElement("tr");
    const label = document.createElement("td");
    label.textContent = name;
    tr.append(label, ...values.map((v) => {
      const td = document.createElement("td");
      td.textContent = v === null || v === undefined ? "-" : JSON.stringify(v);
      return td;
    }));
    return tr;
  });
  $("compare-args").replaceChildren(head, ...rows);
  $("compare-same").textContent = "the same in all: " + (Object.entries(found.args_same)
    .map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ") || "-");
  $("compare-diffs").replaceChildren(...found.diffs.flatMap((d) => {
    const title = document.createElement("p");
    title.textContent = d.same_code ? `${d.from} -> ${d.to}: the same code`
      : `${d.from} -> ${d.to}:`;
    return d.same_code ? [title] : [title, renderDiff(d.diff)];
  }));
  $("compare-view").hidden = false;
  await loadChart(); // their curves, overlaid
}

// -- replays -------------------------------------------------------------------------------

async function loadScriptNames(project) {
  // What today's script logs that no run has yet: what a replay can fill in.
  const script = project.scripts.length ? project.scripts[0].filename : null;
  if (!script) return;
  try {
    const found = await api("/api/script?script=" + encodeURIComponent(script));
    $("script-names").replaceChildren(...found.names.map((n) => {
      const option = document.createElement("option");
      option.value = n.name;
      return option;
    }));
    const fresh = found.names.filter((n) => n.new).map((n) => n.name);
    $("replay-hint").textContent = fresh.length
      ? `${script} logs today what no run has yet: ${fresh.join(", ")}`
      : `every name ${script} logs today is in the store already`;
  } catch (err) {
    $("replay-hint").textContent = err.message;
  }
}

function replayRequest() {
  const names = $("replay-names").value.split(",").map((n) => n.trim()).filter(Boolean);
  const body = { names };
  if ($("replay-runs").value === "selected") {
    if (!state.selected.length) throw new Error("Select the runs to replay in the table first.");
    body.runs = state.selected;
  } else if (state.where) {
    body.where = state.where;
  }
  return body;
}

async function showPlan() {
  $("replay-start").disabled = true;
  $("replay-output").textContent = "planning...";
  try {
    const plan = await api("/api/replay/plan", { method: "POST",
      body: JSON.stringify(replayRequest()) });
    $("replay-output").textContent = plan.output;
    $("replay-start").disabled = plan.returncode !== 0;
  } catch (err) {
    $("replay-output").textContent = err.message;
  }
}

async function startReplay() {
  $("replay-start").disabled = true;
  try {
    view.job = await api("/api/replay", { method: "POST", body: JSON.stringify(replayRequest()) });
  } catch (err) {
    $("replay-output").textContent = err.message;
    return;
  }
  $("replay-cancel").hidden = false;
  followReplay();
}

async function followReplay() {
  const job = await api("/api/replay/" + view.job.id);
  view.job = job;
  $("replay-output").textContent = job.output.join("\n");
  await Promise.all([loadRuns(), loadChart()]); // backfilled values fill in as they land
  if (job.running) {
    setTimeout(followReplay, 1000);
    return;
  }
  $("replay-cancel").hidden = true;
  await loadNames();
  if (view.project) loadScriptNames(view.project);
  status(job.returncode === 0 ? "replay finished" : `replay ended with status ${job.returncode}`);
}

// -- wiring --------------------------------------------------------------------------------

function wire() {
  $("where").value = state.where;
  $("columns").value = state.columns.join(", ");
  $("filter").addEventListener("submit", (event) => {
    event.preventDefault();
    state.where = $("where").value.trim();
    state.columns = $("columns").value.split(",").map((c) => c.trim()).filter(Boolean);
    state.offset = 0;
    writeState();
    loadRuns();
  });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE);
    writeState(); loadRuns(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; writeState(); loadRuns(); });
  $("compare-selected").addEventListener("click", showCompare);
  wireCharts();
  $("replay-plan").addEventListener("click", showPlan);
  $("replay-names").addEventListener("focus", () => {
    if (view.project) loadScriptNames(view.project); // the script may have been edited
  });
  $("replay-start").addEventListener("click", startReplay);
  $("replay-cancel").addEventListener("click", () =>
    api(`/api/replay/${view.job.id}/cancel`, { method: "POST", body: "{}" }));
  // Running runs update live: every 2 s while any is shown.
  setInterval(() => {
    if (document.visibilityState !== "visible") return;
    if (view.rows.some((r) => r.status === "running")) {
      loadRuns();
      if (view.series.length) loadChart();
    }
  }, 2000);
}

async function main() {
  readState();
  writeState(); // drops the token from the address bar and history
  wire();
  try {
    const project = await api("/api/project");
    $("project").textContent = project.root;
    view.project = project;
    loadScriptNames(project);
  } catch (err) {
    status(err.message);
  }
  await Promise.all([loadRuns(), loadNames()]);
  await loadChart();
  loadExplore();
  if (state.run) showRun(state.run);
  if (state.compare) showCompare();
  document.body.dataset.ready = "1";
}

main();
