// The retrolog dashboard: a runs table, charts, a run's details and replays, over /api
// (docs/ui.md). Plain script, no build step; charts are uPlot's. The view's state lives in
// the URL's query so a view can be reloaded or shared; the launch token never does.
"use strict";

const TOKEN_KEY = "retrolog-token";
const PAGE = 100;
// The page's views, one shown at a time, each with its address (?view=...): the sections
// each shows and its title.
const VIEWS = {
  runs: { sections: ["runs-view", "chart-view", "explore-view"], title: "runs" },
  run: { sections: ["run-view"], title: "run" },
  compare: { sections: ["compare-view"], title: "compare" },
  // The table stays in sight while a replay runs, so its values are seen filling in.
  replay: { sections: ["runs-view", "replay-view"], title: "replay" },
};

const token = (() => {
  const url = new URL(location.href);
  const given = url.searchParams.get("token");
  if (given) {
    sessionStorage.setItem(TOKEN_KEY, given);
  }
  return given || sessionStorage.getItem(TOKEN_KEY) || "";
})();

// columns: null shows the default columns (the last value of each metric the runs log).
const state = {
  where: "", status: "", columns: null, sort: "started_at", desc: true, offset: 0, selected: [],
  charts: [], label: "", sx: "", sy: "", sagg: "last", x: "step", log: false, smooth: 0,
  lo: null, hi: null, run: null, group: "", view: "runs",
};
const view = { total: 0, rows: [], chart: null, series: [], groups: null, job: null,
  columns: [], metrics: [], requests: {} };
window.__retrolog = view; // for the browser tests: the drawn chart and its data

const $ = (id) => document.getElementById(id);

function readState() {
  const q = new URLSearchParams(location.search);
  state.where = q.get("where") || "";
  state.status = q.get("status") || "";
  state.columns = !q.has("columns") ? null
    : q.get("columns") === "-" ? [] : q.get("columns").split(",").filter(Boolean);
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
  state.view = VIEWS[q.get("view")] ? q.get("view") : "runs";
}

function stateQuery() {
  const q = new URLSearchParams();
  const put = (key, value, skip) => { if (value !== skip && value !== null) q.set(key, value); };
  put("where", state.where, "");
  put("status", state.status, "");
  if (state.columns !== null) q.set("columns", state.columns.join(",") || "-");
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
  put("view", state.view, "runs");
  return q;
}

// push: a new entry in the browser's history (another view), so Back returns to this one;
// otherwise the current entry is updated in place (a filter, a zoom).
function writeState(push = false) {
  const text = stateQuery().toString();
  const address = text ? "?" + text : location.pathname;
  if (push) history.pushState(null, "", address);
  else history.replaceState(null, "", address);
}

// Every request belongs to a view ("runs", "chart", "names", "replay", ...): a newer
// request of the same view replaces one still waiting. The older one is aborted, so the
// server stops its query (docs/ui.md, "Requests a client gave up on"), and an answer that
// arrives after its view was asked for again is dropped (a Stale error, which callers
// treat as an abort): it never overwrites the newer view.
const pending = {};
const requests = {}; // per view, how many were made: for the browser tests
view.requests = requests;
function supersede(kind) {
  if (pending[kind]) pending[kind].abort();
  pending[kind] = new AbortController();
  requests[kind] = (requests[kind] || 0) + 1;
  return pending[kind].signal;
}
class Stale extends Error {
  constructor(kind) { super(`a newer ${kind} request replaced this one`); this.name = "AbortError"; }
}
const aborted = (err) => err && err.name === "AbortError";

// options.view: the view the request belongs to (supersede); or options.signal, given.
function sent(options) {
  const { view: kind, ...rest } = options;
  const signal = kind ? supersede(kind) : rest.signal;
  const headers = { "X-Retrolog-Token": token };
  if (rest.body !== undefined) headers["Content-Type"] = "application/json";
  return { kind: kind || "request", signal, init: { ...rest, signal, headers } };
}

async function api(path, options = {}) {
  const { kind, signal, init } = sent(options);
  const response = await fetch(path, init);
  const body = await response.json();
  if (signal && signal.aborted) throw new Stale(kind);
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function apiBytes(path, options = {}) {
  const { kind, signal, init } = sent(options);
  const response = await fetch(path, init);
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    if (signal && signal.aborted) throw new Stale(kind);
    throw new Error(body.error || response.statusText);
  }
  const bytes = await response.arrayBuffer();
  if (signal && signal.aborted) throw new Stale(kind);
  return bytes;
}

function status(text) { $("status").textContent = text; }

// -- the runs table ------------------------------------------------------------------------

function runsQuery(extra = {}) {
  const q = new URLSearchParams({
    sort: state.sort, desc: state.desc ? "1" : "0", offset: String(state.offset),
    limit: String(PAGE), ...extra,
  });
  if (state.where) q.set("where", state.where);
  if (state.status) q.set("status", state.status);
  if (state.columns === null) q.set("default", "1");
  else if (state.columns.length) q.set("columns", state.columns.join(","));
  return q;
}

// The table's selection, for every view that acts on chosen runs (charts, compare,
// replay): get() the run ids, set(ids) them; each change is announced to the page as a
// "retrolog:selection" event on document, its detail {runs}.
const selection = {
  get: () => [...state.selected],
  set(ids) {
    state.selected = [...new Set(ids)];
    writeState();
    for (const tr of $("runs").tBodies[0].rows) {
      const chosen = state.selected.includes(tr.dataset.run);
      tr.classList.toggle("selected", chosen);
      const box = tr.querySelector("input[type=checkbox]");
      if (box) box.checked = chosen;
    }
    showSelected();
    document.dispatchEvent(new CustomEvent("retrolog:selection",
      { detail: { runs: selection.get() } }));
  },
};
window.retrolog = { ...(window.retrolog || {}), selection };

function showSelected() {
  const n = state.selected.length;
  $("selected-count").textContent = n ? `${n} selected` : "";
  const page = $("runs").tHead.querySelector("input[type=checkbox]");
  if (page) {
    const ids = view.rows.map((r) => r.run_id);
    const chosen = ids.filter((r) => state.selected.includes(r)).length;
    page.checked = ids.length > 0 && chosen === ids.length;
    page.indeterminate = chosen > 0 && chosen < ids.length;
  }
}

async function selectAll(matching) {
  // Every run (or every run the filter matches), not only this page's.
  const q = new URLSearchParams({ ids: "1", limit: "1", sort: state.sort,
    desc: state.desc ? "1" : "0", columns: "" });
  if (matching && state.where) q.set("where", state.where);
  if (matching && state.status) q.set("status", state.status);
  try {
    const found = await api("/api/runs?" + q, { view: "select" });
    selection.set(found.ids);
  } catch (err) {
    if (!aborted(err)) status(err.message);
  }
}

async function loadRuns() {
  let data;
  try {
    data = await api("/api/runs?" + runsQuery(), { view: "runs" });
  } catch (err) {
    if (aborted(err)) return;
    // The table shown stays: a failed refresh says why, and the next one may succeed.
    $("where-error").textContent = err.message;
    $("where-error").hidden = false;
    return;
  }
  $("where-error").hidden = true;
  view.total = data.total;
  view.rows = data.rows;
  view.columns = data.columns;
  view.metrics = data.metrics;
  if (state.columns === null && document.activeElement !== $("columns")) {
    $("columns").value = data.columns.join(", "); // the default columns, as typed ones
  }
  renderRuns(data);
  renderPicker(data);
  groupOptions();
  newNames(data.metrics);
  const csv = runsQuery({ format: "csv" });
  csv.delete("offset");
  csv.delete("limit");
  $("csv").href = "/api/runs?" + csv;
}

function newNames(metrics) {
  // A name that came into the store since the names were read (a replay's values landed).
  const select = $("chart-name");
  if (!select || typeof loadNames !== "function") return;
  const known = new Set([...select.options].map((o) => o.value));
  if (metrics.some((n) => !known.has(n))) loadNames().catch(() => {});
}

const FIELD_LABELS = {
  run_id: "run", tstamp: "started", filename: "script", status: "status",
  duration: "duration", code_version: "code version",
};

function argumentNames(rows) {
  return [...new Set(rows.flatMap((r) => Object.keys(r.args || {})))].sort();
}

function renderRuns(data) {
  const keys = ["run_id", "tstamp", "filename", "status", "duration", "code_version",
    ...argumentNames(data.rows).map((a) => "args." + a), ...data.columns];
  const head = document.createElement("tr");
  const all = document.createElement("th");
  const pageBox = document.createElement("input");
  pageBox.type = "checkbox";
  pageBox.setAttribute("aria-label", "select this page's runs");
  pageBox.addEventListener("change", () => {
    const ids = data.rows.map((r) => r.run_id);
    selection.set(pageBox.checked ? [...state.selected, ...ids]
      : state.selected.filter((r) => !ids.includes(r)));
  });
  all.append(pageBox);
  head.append(all);
  for (const key of keys) {
    const th = document.createElement("th");
    const argument = key.startsWith("args.");
    th.textContent = argument ? key.slice(5) : FIELD_LABELS[key] || key;
    th.title = argument ? `argument ${key.slice(5)}` : key;
    if (argument) th.className = "arg";
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
  $("runs-notes").textContent = (data.notes || []).join(" ");
  $("runs-notes").hidden = !(data.notes || []).length;
  showSelected();
}

const AGGREGATES = ["last", "first", "min", "max", "mean", "count"];

function renderPicker(data) {
  // A checkbox per metric and aggregate; the shown columns are checked.
  const shown = new Set(data.columns);
  const head = document.createElement("tr");
  head.append(...["metric", ...AGGREGATES].map((t) => {
    const th = document.createElement("th");
    th.textContent = t;
    return th;
  }));
  const names = [...new Set([...data.metrics, ...data.columns.map((c) => c.replace(/:[^:]*$/, ""))])];
  const rows = names.map((name) => {
    const tr = document.createElement("tr");
    const label = document.createElement("td");
    label.textContent = name;
    tr.append(label, ...AGGREGATES.map((agg) => {
      const td = document.createElement("td");
      const box = document.createElement("input");
      box.type = "checkbox";
      box.checked = shown.has(`${name}:${agg}`);
      box.dataset.column = `${name}:${agg}`;
      box.setAttribute("aria-label", `${name}:${agg}`);
      box.addEventListener("change", () => {
        const now = [...view.columns];
        state.columns = box.checked ? [...now, box.dataset.column]
          : now.filter((c) => c !== box.dataset.column);
        view.columns = state.columns;
        $("columns").value = state.columns.join(", ");
        if (!state.columns.includes(state.sort) && state.sort.includes(":")) state.sort = "started_at";
        state.offset = 0;
        writeState();
        loadRuns();
      });
      td.append(box);
      return td;
    }));
    return tr;
  });
  $("column-grid").tHead.replaceChildren(head);
  $("column-grid").tBodies[0].replaceChildren(...rows);
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
    selection.set(box.checked ? [...state.selected, row.run_id]
      : state.selected.filter((r) => r !== row.run_id));
  });
  const cell = document.createElement("td");
  cell.append(box);
  tr.append(cell);
  for (const key of keys) {
    const td = document.createElement("td");
    const value = key.startsWith("args.") ? (row.args || {})[key.slice(5)] : row[key];
    if (key === "run_id") {
      td.append(runLink(value));
    } else {
      td.textContent = formatCell(key, value, row);
      td.title = value !== null && typeof value === "object" ? JSON.stringify(value)
        : String(value ?? "");
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

// -- views and the address -----------------------------------------------------------------

function addressOf(changes) {
  // The address of this view with ``changes`` to its state, for a link's href (a new tab).
  const saved = { ...state };
  Object.assign(state, changes);
  const q = stateQuery();
  Object.assign(state, saved);
  return "?" + q;
}

function navigate(changes) {
  // Another view: a new history entry, so Back and Forward step through views.
  Object.assign(state, changes);
  writeState(true);
  route({ top: true });
}

async function route({ top = false } = {}) {
  const shown = new Set(VIEWS[state.view].sections);
  for (const about of Object.values(VIEWS)) {
    for (const id of about.sections) $(id).hidden = !shown.has(id);
  }
  for (const link of document.querySelectorAll("#nav a[data-view]")) {
    if (link.dataset.view === state.view) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  document.title = `retrolog · ${state.view === "run" && state.run ? "run " + state.run
    : VIEWS[state.view].title}`;
  if (top) window.scrollTo(0, 0);
  if (state.view === "run" && state.run) await showRun(state.run);
  else if (state.view === "compare") await showCompare();
}

function runLink(runId) {
  const a = document.createElement("a");
  a.href = addressOf({ view: "run", run: runId });
  a.className = "run-link";
  a.textContent = runId;
  a.addEventListener("click", (event) => {
    if (event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) return;
    event.preventDefault();
    navigate({ view: "run", run: runId });
  });
  return a;
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

function detailTable(className, header, rows) {
  // rows: arrays of cells, each a string or a node; a row that is a string is a section.
  const t = document.createElement("table");
  t.className = className;
  const head = document.createElement("tr");
  head.append(...header.map((text) => {
    const th = document.createElement("th");
    th.textContent = text;
    return th;
  }));
  t.createTHead().append(head);
  const body = t.createTBody();
  for (const row of rows) {
    const tr = document.createElement("tr");
    if (typeof row === "string") {
      const th = document.createElement("th");
      th.colSpan = header.length;
      th.scope = "rowgroup";
      th.textContent = row;
      tr.append(th);
    } else {
      tr.append(...row.map((cell) => {
        const td = document.createElement("td");
        if (cell instanceof Node) td.append(cell);
        else {
          td.textContent = cell;
          td.title = cell;
        }
        return td;
      }));
    }
    body.append(tr);
  }
  return t;
}

function flattenFacts(value, prefix = "", out = []) {
  // A nested object as [dotted key, text] pairs, for a table.
  if (value && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) {
      flattenFacts(v, prefix ? `${prefix}.${k}` : k, out);
    }
  } else {
    out.push([prefix, Array.isArray(value) ? value.join(", ") : String(value)]);
  }
  return out;
}

function environmentTable(details) {
  const numerics = details.numerics || {};
  const env = numerics.env || {};
  const set = Object.entries(env).filter(([, v]) => v !== null && v !== undefined);
  const unset = Object.keys(env).filter((k) => env[k] === null || env[k] === undefined);
  const rest = { ...numerics };
  delete rest.env;
  const rows = [
    "machine",
    ["python", details.python || ""],
    ["host", details.host ? `${details.host} (pid ${details.pid})` : ""],
    ...flattenFacts(rest),
    "environment variables",
    ...set.map(([k, v]) => [k, String(v)]),
  ];
  if (unset.length) rows.push(["not set", unset.join(", ")]);
  const packages = Object.entries(details.packages || {});
  if (packages.length) rows.push("packages", ...packages.map(([k, v]) => [k, String(v)]));
  return detailTable("env", ["setting", "value"], rows);
}

function checkpointTable(runId, ckpts) {
  // One row per checkpoint, its download the torch.save file of its named objects.
  const rows = ckpts.map((c) => {
    const at = c.kind === "end" ? "end" : String(c.iteration);
    const link = document.createElement("a");
    link.href = `/api/runs/${encodeURIComponent(runId)}/checkpoints/${at}`;
    link.textContent = "download .pt";
    link.setAttribute("download", "");
    link.dataset.at = at;
    link.addEventListener("click", (event) => {
      if (view.project && view.project.torch === false) { // the download would only fail
        event.preventDefault();
        $("run-checkpoint-error").textContent = "A checkpoint is downloaded as a torch.save "
          + "file, which needs torch where `retrolog ui` runs, and it is not installed there: "
          + "pip install 'retrolog[torch]' in that environment and restart the dashboard.";
        $("run-checkpoint-error").hidden = false;
      }
    });
    const written = c.created_at ? new Date(c.created_at * 1000).toLocaleString() : "";
    return [c.kind === "end" ? "the end" : `${c.loop} ${c.iteration}`,
      `${(c.nbytes / 1e6).toFixed(2)} MB`, written, link];
  });
  return detailTable("checkpoints", ["at", "stored", "written", "file"], rows);
}

async function showRun(runId) {
  const signal = supersede("run");
  if ($("run-view").dataset.run !== runId) { // another run's facts must not show meanwhile
    delete $("run-view").dataset.run;
    $("run-title").textContent = "";
    for (const id of ["run-details", "run-checkpoints", "run-environment"]) {
      $(id).replaceChildren();
    }
    $("run-code-path").textContent = $("run-code").textContent = "";
  }
  let details;
  let ckpts;
  try {
    [details, ckpts] = await Promise.all([
      api("/api/runs/" + encodeURIComponent(runId), { signal }),
      api("/api/runs/" + encodeURIComponent(runId) + "/checkpoints", { signal }),
    ]);
  } catch (err) {
    if (!aborted(err)) status(err.message);
    return;
  }
  $("run-title").textContent = "run " + details.run_id;
  $("run-view").dataset.run = runId;
  const ck = details.checkpoints;
  $("run-details").replaceChildren(
    facts([["status", details.status + (details.error ? ` (${details.error})` : "")],
      ["script", details.filename], ["started", details.tstamp],
      ["duration", details.duration], ["argv", (details.argv || []).join(" ")],
      ["code version", `${details.code_commit} (tree ${details.code_tree})`
        + (details.dirty ? ", with uncommitted edits" : "")],
      ["HEAD then", details.head_commit]]),
    heading("Arguments"), facts(Object.entries({ ...(details.parsed_args || {}),
      ...(details.args || {}) })),
    heading("Loops and names"),
    facts([...details.loops.map((l) => [l.name, `${l.iterations} iterations (depth ${l.depth})`]),
      ...details.names.map((n) => [n.name, `${n.count} value(s), ${n.level} level, ${n.origin}`])]),
  );
  $("run-checkpoint-error").hidden = true;
  $("run-checkpoints").replaceChildren(
    facts([["written", `${ck.count} (${(ck.bytes / 1e6).toFixed(2)} MB)`],
      ["chosen / written / abandoned", ck.chosen === undefined ? null
        : `${ck.chosen} / ${ck.written} / ${ck.abandoned}`]]),
    ckpts.length ? checkpointTable(details.run_id, ckpts)
      : document.createTextNode("no checkpoint is stored for this run"),
  );
  $("run-environment").replaceChildren(
    environmentTable(details),
    heading("Timing profile"),
    facts(Object.entries(details.profile).map(([phase, p]) =>
      [phase, `${p.seconds.toFixed(3)} s over ${p.count}`])),
  );
  showRunCharts(runId, details.names);
  try {
    const code = await api("/api/runs/" + encodeURIComponent(runId) + "/code", { signal });
    $("run-code-path").textContent = `${code.path} (${code.files.length} file(s) in the version)`;
    $("run-code").textContent = code.text;
  } catch (err) {
    if (!aborted(err)) $("run-code").textContent = err.message;
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

const compareCell = (v) => (v === null || v === undefined ? "-"
  : typeof v === "number" ? String(Number.isInteger(v) ? v : Number(v.toPrecision(6)))
    : JSON.stringify(v));

function metricTable(found) {
  // Per metric, each run's last, min and max, runs side by side.
  const rows = [];
  for (const name of found.metrics.names) {
    rows.push(name);
    for (const agg of ["last", "min", "max"]) {
      const cells = found.runs.map((run) => found.metrics.values[run][`${name}:${agg}`]);
      rows.push([agg, ...cells.map(compareCell)]);
    }
  }
  return detailTable("metrics", ["", ...found.runs], rows);
}

async function showCompare() {
  $("compare-title").textContent = "";
  for (const id of ["compare-args", "compare-metrics", "compare-diffs"]) $(id).replaceChildren();
  if (state.selected.length < 2) {
    $("compare-same").textContent = "Select two or more runs in the table to compare them.";
    return;
  }
  $("compare-same").textContent = "loading...";
  let found;
  try {
    found = await api("/api/compare?runs=" + encodeURIComponent(state.selected.join(",")),
      { signal: supersede("compare") });
  } catch (err) {
    if (!aborted(err)) status(err.message);
    return;
  }
  $("compare-title").replaceChildren(...found.runs.flatMap((r, i) =>
    (i ? [document.createTextNode(", "), runLink(r)] : [runLink(r)])));
  const rows = Object.entries(found.args_differ).map(([name, values]) => [name,
    ...values.map(compareCell)]);
  $("compare-args").replaceChildren(detailTable("", ["argument", ...found.runs], rows));
  $("compare-same").textContent = "the same in all: " + (Object.entries(found.args_same)
    .map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ") || "-");
  $("compare-metrics").replaceChildren(found.metrics.names.length ? metricTable(found)
    : document.createTextNode("these runs logged no metric"),
  ...(found.metrics.more ? [document.createTextNode(
    ` (and ${found.metrics.more} more name(s): pick them as columns of the runs table)`)] : []));
  $("compare-diffs").replaceChildren(...found.diffs.flatMap((d) => {
    const title = document.createElement("p");
    title.textContent = d.same_code ? `${d.from} -> ${d.to}: the same code`
      : `${d.from} -> ${d.to}:`;
    return d.same_code ? [title] : [title, renderDiff(d.diff)];
  }));
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
  let job;
  try {
    job = await api("/api/replay/" + view.job.id, { view: "replay" });
  } catch (err) {
    // A missed poll (the server busy, a request replaced) is tried again, never thrown.
    if (!aborted(err)) status(err.message);
    setTimeout(followReplay, 2000);
    return;
  }
  view.job = job;
  $("replay-output").textContent = job.output.join("\n");
  // Backfilled values fill in as each run's land; a failed refresh keeps what is shown.
  await Promise.all([loadRuns(), loadChart().catch((err) => status(err.message))]);
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
  $("columns").value = (state.columns || []).join(", ");
  $("status-filter").value = state.status;
  $("filter").addEventListener("submit", (event) => {
    event.preventDefault();
    state.where = $("where").value.trim();
    const typed = $("columns").value.split(",").map((c) => c.trim()).filter(Boolean);
    // Untouched default columns stay the default (they follow the metrics the runs log).
    if (state.columns !== null || typed.join(",") !== (view.columns || []).join(",")) {
      state.columns = typed;
    }
    state.status = $("status-filter").value;
    state.offset = 0;
    writeState();
    loadRuns();
  });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE);
    writeState(); loadRuns(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; writeState(); loadRuns(); });
  $("compare-selected").addEventListener("click", () => navigate({ view: "compare" }));
  for (const link of document.querySelectorAll("#nav a[data-view]")) {
    link.addEventListener("click", (event) => {
      if (event.button !== 0 || event.ctrlKey || event.metaKey || event.shiftKey) return;
      event.preventDefault();
      navigate({ view: link.dataset.view });
    });
  }
  // Back and Forward: the view and its state from the address.
  window.addEventListener("popstate", () => {
    readState();
    $("where").value = state.where;
    $("status-filter").value = state.status;
    $("columns").value = (state.columns || []).join(", ");
    if (state.view === "runs") { loadRuns(); loadChart().catch((err) => status(err.message)); }
    route();
  });
  $("status-filter").addEventListener("change", () => {
    state.status = $("status-filter").value;
    state.offset = 0;
    writeState();
    loadRuns();
  });
  $("select-all").addEventListener("click", () => selectAll(false));
  $("select-matching").addEventListener("click", () => selectAll(true));
  $("select-none").addEventListener("click", () => selection.set([]));
  wireCharts();
  $("replay-plan").addEventListener("click", showPlan);
  $("replay-names").addEventListener("focus", () => {
    if (view.project) loadScriptNames(view.project); // the script may have been edited
  });
  $("replay-start").addEventListener("click", startReplay);
  $("replay-cancel").addEventListener("click", () =>
    api(`/api/replay/${view.job.id}/cancel`, { method: "POST", body: "{}" }));
  // Running runs update live: every 2 s while any is shown. A refresh replaces one still
  // waiting (supersede) and a failed one keeps the table shown.
  setInterval(() => {
    if (document.visibilityState !== "visible") return;
    if (view.rows.some((r) => r.status === "running")) {
      loadRuns();
      if (view.series.length) loadChart().catch((err) => status(err.message));
    }
  }, 2000);
}

async function main() {
  readState();
  writeState(); // drops the token from the address bar and history
  wire();
  const routed = route(); // the view the address names, while the table loads
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
  await routed;
  document.body.dataset.ready = "1";
}

main();
