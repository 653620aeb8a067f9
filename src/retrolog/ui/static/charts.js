// The dashboard's charts (docs/ui.md): a grid of uPlot charts, one per logged name, over the
// selected runs or groups of them; parallel coordinates and a scatter over the runs'
// arguments and final metrics, brushed to select runs. Loaded before app.js, whose state,
// view, api and writeState it uses. app.js calls: readChartState, writeChartState,
// wireCharts, loadNames, loadChart, loadExplore, showRunCharts.
"use strict";

const ORIGIN = { recorded: 0, backfilled: 1, inexact: 2 };
const CHART_HEIGHT = 300; // css pixels of a chart's canvas; the server's points budget too
// AGGREGATES (app.js): the per-run aggregates the scatter offers, as the runs table does.

// -- the table's selection --------------------------------------------------------------------
// The runs table owns the selection; it offers `selection` (get(), set(ids)) and fires
// `retrolog:selection` on document when it changes. Until it does, the address's runs.
const chartSelection = {
  get() {
    return typeof selection === "object" && selection ? selection.get() : state.selected;
  },
  set(ids) {
    if (typeof selection === "object" && selection) {
      selection.set(ids);
      return;
    }
    state.selected = [...ids];
    writeState();
    for (const tr of document.querySelectorAll("#runs tbody tr")) {
      const chosen = state.selected.includes(tr.dataset.run);
      tr.classList.toggle("selected", chosen);
      const box = tr.querySelector("input[type=checkbox]");
      if (box) box.checked = chosen;
    }
    document.dispatchEvent(new CustomEvent("retrolog:selection", { detail: ids }));
  },
};

// -- colours ------------------------------------------------------------------------------------
// A run's colour comes from its id (FNV-1a hash to a hue), so it is the same in every chart,
// whatever the order or the other runs drawn.
function hashText(text) {
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

function runColor(id) {
  // The hash's bits mixed (murmur3's finalizer), then a hue in OKLCH, where equal steps of
  // hue look equally different (in HSL, a third of the circle is one green), at one of two
  // lightnesses so that neighbouring hues still differ.
  let h = hashText(String(id));
  h = Math.imul(h ^ (h >>> 16), 0x85ebca6b);
  h = Math.imul(h ^ (h >>> 13), 0xc2b2ae35);
  h = (h ^ (h >>> 16)) >>> 0;
  return oklchHex(h & 1 ? 0.52 : 0.66, 0.15, ((h >>> 1) % 3600) / 10);
}

function oklchHex(l, c, hue) {
  const a = c * Math.cos((hue * Math.PI) / 180);
  const b = c * Math.sin((hue * Math.PI) / 180);
  const l1 = (l + 0.3963377774 * a + 0.2158037573 * b) ** 3;
  const m1 = (l - 0.1055613458 * a - 0.0638541728 * b) ** 3;
  const s1 = (l - 0.0894841775 * a - 1.291485548 * b) ** 3;
  const linear = [4.0767416621 * l1 - 3.3077115913 * m1 + 0.2309699292 * s1,
    -1.2684380046 * l1 + 2.6097574011 * m1 - 0.3413193965 * s1,
    -0.0041960863 * l1 - 0.7034186147 * m1 + 1.707614701 * s1];
  return "#" + linear.map((v) => {
    const x = Math.max(0, Math.min(1, v));
    const srgb = x <= 0.0031308 ? 12.92 * x : 1.055 * x ** (1 / 2.4) - 0.055;
    return Math.round(srgb * 255).toString(16).padStart(2, "0");
  }).join("");
}

// -- the address ----------------------------------------------------------------------------------

function readChartState(q) {
  const listed = (q.get("charts") || q.get("name") || "").split(",").filter(Boolean);
  state.charts = [...new Set(listed)];
  state.label = q.get("label") || "";
  state.sx = q.get("sx") || "";
  state.sy = q.get("sy") || "";
  state.sagg = AGGREGATES.includes(q.get("sagg")) ? q.get("sagg") : "last";
}

function writeChartState(put) {
  put("charts", state.charts.join(","), "");
  put("label", state.label, "");
  put("sx", state.sx, "");
  put("sy", state.sy, "");
  put("sagg", state.sagg, "last");
}

// -- names and controls ------------------------------------------------------------------------

async function loadNames() {
  const names = await api("/api/names");
  view.names = names;
  const select = $("chart-name");
  select.replaceChildren(...["", ...names].map((n) => option(n, n || "(add a chart)")));
  select.value = "";
  $("name-list").replaceChildren(...names.map((n) => option(n, n)));
  fillSelect($("scatter-y"), names, state.sy, "(a metric)");
}

function option(value, text) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = text;
  return o;
}

function fillSelect(select, values, chosen, empty) {
  if (!select) return;
  const all = [...new Set([...values, chosen].filter(Boolean))];
  select.replaceChildren(option("", empty), ...all.map((v) => option(v, v)));
  select.value = chosen || "";
}

function wireCharts() {
  // For the browser tests: the first chart of the grid as `chart`, `series`, `groups`,
  // `drawn`; the grids and the explored runs.
  for (const key of ["chart", "series", "groups", "drawn"]) {
    const field = key === "chart" ? "u" : key;
    Object.defineProperty(view, key, {
      configurable: true,
      get() {
        const first = mainGrid.cells.get(mainGrid.names[0]);
        if (first) return first[field];
        return key === "series" ? [] : key === "chart" ? null : false;
      },
      set() {},
    });
  }
  view.grid = mainGrid;
  view.explore = explore;
  $("chart-x").value = state.x;
  $("chart-log").checked = state.log;
  $("chart-smooth").value = String(state.smooth);
  $("scatter-agg").value = state.sagg;
  const redraw = () => { writeState(); loadChart(); };
  // A slider sends many events a frame: one redraw per frame, with the latest value.
  let styling = 0;
  const restyle = () => {
    writeState();
    cancelAnimationFrame(styling);
    for (const cell of mainGrid.cells.values()) { // drawn, but not with these settings yet
      cell.state = "loading";
      cell.el.dataset.state = "loading";
    }
    styling = requestAnimationFrame(() => loadChart(true));
  };
  $("chart-selected").addEventListener("click", () => { state.lo = state.hi = null; redraw(); });
  $("chart-name").addEventListener("change", () => {
    const name = $("chart-name").value;
    $("chart-name").value = "";
    if (!name) return;
    // The newest choice comes first, top left, where the eye starts.
    state.charts = [name, ...state.charts.filter((n) => n !== name)];
    redraw();
    loadExplore();
  });
  $("chart-x").addEventListener("change", () => { state.x = $("chart-x").value;
    state.lo = state.hi = null; redraw(); });
  $("chart-log").addEventListener("change", () => { state.log = $("chart-log").checked;
    restyle(); });
  $("chart-group").addEventListener("change", () => { state.group = $("chart-group").value;
    state.lo = state.hi = null; redraw(); });
  $("chart-label").addEventListener("change", () => { state.label = $("chart-label").value;
    restyle(); });
  $("chart-smooth").addEventListener("input", () => {
    state.smooth = Number($("chart-smooth").value);
    restyle();
  });
  $("chart-reset").addEventListener("click", () => { state.lo = state.hi = null; redraw(); });
  $("scatter-x").addEventListener("change", () => { state.sx = $("scatter-x").value;
    writeState(); drawExplore(); });
  $("scatter-y").addEventListener("change", () => { state.sy = $("scatter-y").value;
    writeState(); loadExplore(); });
  $("scatter-agg").addEventListener("change", () => { state.sagg = $("scatter-agg").value;
    writeState(); loadExplore(); });
  $("filter").addEventListener("submit", () => setTimeout(loadExplore, 0));
  for (const plot of ["parallel", "scatter"]) {
    const bar = document.querySelector(`.exports[data-plot="${plot}"]`);
    if (!bar) continue;
    const button = (text, label, action) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = text;
      b.title = label;
      b.addEventListener("click", action);
      bar.append(b);
    };
    button("PNG", "export as PNG", () => exportPlotPng(plot));
    button("SVG", "export as SVG", () => exportPlotSvg(plot));
    button("CSV", "export the data as CSV", () => exportPlotCsv(plot));
  }
  document.addEventListener("retrolog:selection", () => { loadChart(); drawExplore(); });
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      mainGrid.refresh();
      if (runGrid) runGrid.refresh();
      drawExplore();
    }, 200);
  });
}

// -- a grid of charts ---------------------------------------------------------------------------

// What a chart draws, fixed when it is asked for: an answer is drawn with the spec of its
// own request, never with the controls as they are when it arrives.
function chartSpec(runs) {
  return { runs: [...runs], x: state.x, log: state.log, smooth: state.smooth,
    group: state.group, lo: state.lo, hi: state.hi, label: state.label };
}

class ChartGrid {
  constructor(container, { editable, tip, legend }) {
    this.container = container;
    this.editable = editable; // the main grid: reorder, remove, zoom
    this.tip = tip;
    this.legend = legend;
    this.cells = new Map();
    this.names = [];
    this.base = null;
  }

  // reuse: a chart whose request would be the same is redrawn from the answer it has (a
  // change of smoothing, scale or labels); otherwise it asks again (values may have arrived).
  show(names, base, reuse = false) {
    this.names = [...names];
    this.base = base;
    for (const [name, cell] of this.cells) {
      if (!names.includes(name)) { this.drop(cell); this.cells.delete(name); }
    }
    const order = names.map((name) => {
      if (!this.cells.has(name)) this.cells.set(name, this.makeCell(name));
      return this.cells.get(name);
    });
    this.container.replaceChildren(...order.map((c) => c.el));
    order.forEach((cell, i) => {
      if (cell.left) cell.left.disabled = i === 0;
      if (cell.right) cell.right.disabled = i === order.length - 1;
      this.load(cell, reuse);
    });
    if (!names.length) this.renderLegend();
  }

  refresh() { if (this.base) this.show(this.names, this.base, true); }

  clear() { this.show([], null); }

  drop(cell) {
    cell.generation++;
    if (cell.controller) cell.controller.abort();
    if (cell.u) cell.u.destroy();
    cell.u = null;
  }

  makeCell(name) {
    const el = document.createElement("figure");
    el.className = "chart-cell";
    el.dataset.name = name;
    const head = document.createElement("figcaption");
    const title = document.createElement("span");
    title.className = "chart-title";
    title.textContent = name;
    head.append(title);
    const cell = { name, el, u: null, series: [], groups: null, drawn: false, spec: null,
      key: null, data: null, generation: 0, controller: null, state: "loading" };
    const button = (text, label, action) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = text;
      b.title = label;
      b.setAttribute("aria-label", `${label} ${name}`);
      b.addEventListener("click", action);
      head.append(b);
      return b;
    };
    if (this.editable) {
      cell.left = button("\u2190", "move left", () => moveChart(name, -1));
      cell.right = button("\u2192", "move right", () => moveChart(name, 1));
      button("\u00d7", "remove", () => moveChart(name, 0));
    }
    button("PNG", "export as PNG", () => exportPng(cell));
    button("SVG", "export as SVG", () => exportSvg(cell));
    button("CSV", "export the data as CSV", () => exportCsv(cell));
    cell.plot = document.createElement("div");
    cell.plot.className = "chart-plot";
    cell.info = document.createElement("div");
    cell.info.className = "muted chart-info";
    el.append(head, cell.plot, cell.info);
    return cell;
  }

  async load(cell, reuse) {
    const base = this.base;
    const width = Math.max(200, Math.floor(cell.plot.clientWidth || 600));
    const spec = { ...base, name: cell.name, width, height: CHART_HEIGHT };
    if (!spec.runs.length) {
      this.drop(cell);
      cell.series = [];
      cell.groups = null;
      cell.spec = spec;
      cell.key = null;
      cell.info.textContent = "select runs in the table";
      this.settle(cell, "empty");
      return;
    }
    const q = new URLSearchParams({ name: spec.name, runs: spec.runs.join(","), x: spec.x,
      width: String(width), height: String(CHART_HEIGHT) });
    if (spec.lo !== null) q.set("lo", String(spec.lo));
    if (spec.hi !== null) q.set("hi", String(spec.hi));
    if (spec.group) q.set("by", spec.group);
    const key = q.toString();
    const generation = ++cell.generation;
    if (cell.controller) cell.controller.abort();
    cell.controller = null;
    if (reuse && cell.key === key && cell.data) {
      this.draw(cell, spec, cell.data);
      return;
    }
    cell.state = "loading";
    cell.el.dataset.state = "loading";
    const controller = (cell.controller = new AbortController());
    let found;
    try {
      found = spec.group ? await api("/api/groups?" + q, { signal: controller.signal })
        : decodeSeries(await apiBytes("/api/series?format=binary&" + q,
          { signal: controller.signal }));
    } catch (err) {
      if (aborted(err) || generation !== cell.generation) return;
      cell.info.textContent = err.message;
      this.drop(cell);
      cell.spec = spec;
      this.settle(cell, "error");
      return;
    }
    // A newer request for this chart started meanwhile, or the chart was removed: this
    // answer is stale and is dropped.
    if (generation !== cell.generation || !cell.el.isConnected) return;
    cell.key = key;
    cell.data = found;
    this.draw(cell, spec, found);
  }

  draw(cell, spec, found) {
    cell.spec = spec;
    if (spec.group) drawGroups(this, cell, spec, found);
    else drawChart(this, cell, spec, found);
    this.renderLegend();
  }

  settle(cell, how) {
    cell.state = how;
    cell.el.dataset.state = how;
    if (how !== "drawn") cell.drawn = true;
    this.renderLegend();
  }

  // One legend for the grid: the runs (or groups) its charts draw, in their colours.
  renderLegend() {
    if (!this.legend) return;
    const entries = new Map();
    for (const cell of this.cells.values()) {
      if (!cell.spec) continue;
      if (cell.groups) {
        for (const g of cell.groups) entries.set(groupLabel(cell.spec.group, g.key),
          { color: groupColor(g.key), text: `${groupLabel(cell.spec.group, g.key)}`
            + ` (${g.run_ids.length} run${g.run_ids.length === 1 ? "" : "s"})` });
      } else {
        for (const s of cell.series) entries.set(s.run_id,
          { color: runColor(s.run_id), text: runLabel(s.run_id, cell.spec.label), run: s.run_id });
      }
    }
    this.legend.replaceChildren(...[...entries.values()].map((e) => {
      const item = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = e.color;
      item.append(swatch, document.createTextNode(e.text));
      if (e.run) item.dataset.run = e.run;
      return item;
    }));
  }
}

function moveChart(name, by) {
  const charts = state.charts.filter((n) => n !== name);
  if (by !== 0) {
    const at = state.charts.indexOf(name) + by;
    charts.splice(Math.max(0, Math.min(charts.length, at)), 0, name);
  }
  state.charts = charts;
  writeState();
  loadChart(true);
}

function runLabel(runId, label) {
  if (!label) return runId;
  const row = view.rows.find((r) => r.run_id === runId);
  const args = explore.args.get(runId) || (row && row.args) || {};
  const value = args[label];
  return value === undefined ? `${runId} (no ${label})` : `${label}=${formatValue(value)}`;
}

function groupLabel(by, key) {
  if (Array.isArray(key) && key.length === 2 && typeof key[0] === "number") {
    return `${by} ${formatValue(key[0])}..${formatValue(key[1])}`;
  }
  return `${by}=${JSON.stringify(key)}`;
}

function groupColor(key) { return runColor("group:" + JSON.stringify(key)); }

function formatValue(v) {
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(4)));
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

const mainGrid = new ChartGrid(document.getElementById("charts"),
  { editable: true, tip: document.getElementById("chart-tip"),
    legend: document.getElementById("chart-legend") });
let runGrid = null; // made in the run view's container when a run is shown

async function loadChart(reuse = false) {
  const names = state.charts;
  const runs = chartSelection.get();
  $("chart-info").textContent = !names.length ? "add a chart: pick a name"
    : !runs.length ? "select runs in the table" : "";
  mainGrid.show(names, chartSpec(runs), reuse);
}

function showRunCharts(runId, names) {
  // A run's page: a chart of each name it logged more than once, for that run alone, in
  // the run view's container.
  const container = $("run-charts");
  if (!container) return;
  if (!runGrid || !runGrid.container.isConnected) {
    const cells = document.createElement("div");
    cells.className = "chart-grid";
    const tip = document.createElement("pre");
    tip.className = "tip";
    container.append(cells, tip);
    runGrid = new ChartGrid(cells, { editable: false, tip, legend: null });
    view.runGrid = runGrid;
  }
  const many = (names || []).filter((n) => n.count > 1).map((n) => n.name);
  runGrid.show(many, { runs: [runId], x: "step", log: false, smooth: 0, group: "", lo: null,
    hi: null, label: "" });
}

// -- drawing one chart ------------------------------------------------------------------------

const SPECIAL = (y) => (Number.isNaN(y) ? "NaN" : y > 0 ? "Infinity" : "-Infinity");

function decodeSeries(buffer) {
  // /api/series?format=binary (encode_series in _query/series.py): a JSON header, then the
  // points as raw arrays, viewed in place; each series gets the shape its JSON form has.
  const size = new DataView(buffer).getUint32(0, true);
  const about = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, size)));
  const n = about.reduce((total, s) => total + s.n, 0);
  let at = 4 + size;
  at += (8 - (at % 8)) % 8;
  const xs = new Float64Array(buffer, at, n);
  const ys = new Float64Array(buffer, (at += 8 * n), n);
  const replays = new Int32Array(buffer, (at += 8 * n), n);
  const origins = new Uint8Array(buffer, at + 4 * n, n);
  let first = 0;
  return about.map((s) => {
    const end = first + s.n;
    const y = new Array(s.n);
    const yText = {};
    for (let j = 0, k = first; k < end; j++, k++) {
      const v = ys[k];
      if (Number.isFinite(v)) y[j] = v;
      else { y[j] = null; yText[j] = SPECIAL(v); }
    }
    const replay = s.replay_ids.length
      ? Array.from(replays.subarray(first, end), (i) => (i < 0 ? null : s.replay_ids[i]))
      : null;
    const found = { ...s, x: Array.from(xs.subarray(first, end)), y, y_text: yText,
      origin: Array.from(origins.subarray(first, end)), replay };
    first = end;
    return found;
  });
}

function smooth(values, weight) {
  if (!weight) return values;
  let last = null;
  return values.map((v) => {
    if (v === null || v === undefined) return v;
    last = last === null ? v : last * weight + v * (1 - weight);
    return last;
  });
}

// The y axis as wide as its widest tick label: uPlot's fixed 50 px clips "12,345" and
// longer. uPlot calls this again while the labels settle (cycle 1, 2, ...); the first
// measure stands after that, so the axis cannot oscillate.
function axisSize(u, values, axisIdx, cycle) {
  const axis = u.axes[axisIdx];
  if (cycle > 1) return axis._size;
  let size = axis.ticks.size + axis.gap;
  const widest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
  if (widest) {
    u.ctx.font = axis.font[0];
    size += u.ctx.measureText(widest).width / devicePixelRatio;
  }
  return Math.ceil(size) + 2;
}

function positive(spec, y) {
  return spec.log && y !== null && y <= 0 ? null : y;
}

function chartOptions(grid, cell, spec, series, extra) {
  return {
    width: spec.width, height: CHART_HEIGHT, series,
    scales: { x: { time: false, ...(extra.xRange || {}) }, y: spec.log ? { distr: 3 } : {} },
    axes: [{ label: extra.xLabel }, { size: axisSize }],
    legend: { show: false },
    cursor: { drag: { x: grid.editable, y: false, setScale: false } },
    bands: extra.bands,
    hooks: {
      setSelect: grid.editable ? [zoomTo] : [],
      setCursor: [(u) => extra.tip(u.cursor.idx)],
      ...(extra.draw ? { draw: [extra.draw] } : {}),
    },
  };
}

function drawChart(grid, cell, spec, found) {
  grid.drop(cell);
  cell.generation++; // the drawing below is this chart's newest
  cell.groups = null;
  cell.series = found;
  cell.drawn = false;
  if (!found.length) {
    cell.info.textContent = `none of the selected runs logged ${spec.name}`;
    grid.settle(cell, "empty");
    return;
  }
  cell.state = "drawing";
  cell.el.dataset.state = "drawing";
  const tables = [];
  const series = [{ label: spec.x }];
  const lines = []; // drawn by drawLines, a few runs per frame
  const slots = []; // per run, each point's place on the shared grid (null: not on one)
  const lineWidth = found.length > 10 ? 1 : 1.5; // many runs: thin lines, drawn faster
  const line = (options) => {
    lines.push({ index: series.length, ...options });
    series.push({ ...options, spanGaps: true, paths: NO_PATH });
  };
  found.forEach((s) => {
    const color = runColor(s.run_id);
    const label = runLabel(s.run_id, spec.label);
    const pick = (test) => s.y.map((y, j) => (test(s.origin[j]) ? positive(spec, y) : null));
    // A downsampled run's points sit on the pixel columns every run shares, so the runs
    // line up in one table instead of a union of all their x values.
    const placed = s.grid ? onGrid(s.x, s.grid) : null;
    s.shown_x = placed ? placed.xs : s.x;
    slots.push(placed && placed.slots);
    const table = [s.shown_x, smooth(pick((o) => o === ORIGIN.recorded), spec.smooth)];
    line({ label, stroke: color, width: lineWidth });
    if (s.origin.some((o) => o !== ORIGIN.recorded)) {
      table.push(smooth(pick((o) => o !== ORIGIN.recorded), spec.smooth));
      line({ label: label + " backfilled", stroke: color, width: lineWidth, dash: [6, 4],
        points: { show: true, size: 4, fill: color } });
    }
    if (s.origin.some((o) => o === ORIGIN.inexact)) {
      table.push(pick((o) => o === ORIGIN.inexact));
      series.push({ label: label + " inexact", stroke: "#d62728", paths: () => null,
        points: { show: true, size: 7, fill: "#d62728" } });
    }
    tables.push(table);
  });
  const data = joinOnGrid(tables, slots, found[0].grid) || uPlot.join(tables);
  const xRange = spec.lo !== null || spec.hi !== null
    ? { auto: false, range: [spec.lo ?? data[0][0], spec.hi ?? data[0][data[0].length - 1]] }
    : {};
  const options = chartOptions(grid, cell, spec, series, {
    xRange, xLabel: axisLabel(spec, found), tip: (idx) => showTip(grid, cell, spec, idx),
    draw: (u) => drawLines(grid, cell, u, lines),
  });
  cell.u = new uPlot(options, data, cell.plot);
  const sent = found.reduce((n, s) => n + s.x.length, 0);
  const stored = found.reduce((n, s) => n + s.in_range, 0);
  cell.info.textContent = `${found.length} run(s), ${sent} of ${stored} points drawn`
    + (sent < stored ? " (each pixel's first, last, min and max)" : " (all)");
}

const NO_PATH = () => null;
const LINEAR = uPlot.paths.linear();
const POINTS_PER_FRAME = 40000;

function drawLines(grid, cell, u, lines) {
  // uPlot draws the axes and the points; the runs' lines are stroked here, a few runs per
  // animation frame. In one go, 50 runs of 4,800 points are 0.3-0.6 s of canvas work in a
  // single task (software rendering: about 1.4 µs a point), and the page would freeze.
  const generation = (cell.drawing = (cell.drawing || 0) + 1);
  cell.drawn = false;
  cell.state = "drawing";
  cell.el.dataset.state = "drawing";
  let next = 0;
  const frame = () => {
    if (cell.drawing !== generation || cell.u !== u) return; // redrawn or replaced
    const ctx = u.ctx;
    ctx.save();
    ctx.beginPath();
    ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
    ctx.clip();
    ctx.lineJoin = "round";
    for (let points = 0; next < lines.length && points < POINTS_PER_FRAME; next++) {
      const { index, stroke, width, dash } = lines[next];
      const s = u.series[index];
      if (!s.show || !s.idxs || s.idxs[0] === null) continue;
      const paths = LINEAR(u, index, s.idxs[0], s.idxs[1]);
      ctx.strokeStyle = stroke;
      ctx.lineWidth = width * uPlot.pxRatio;
      ctx.setLineDash((dash || []).map((d) => d * uPlot.pxRatio));
      ctx.stroke(paths.stroke);
      points += s.idxs[1] - s.idxs[0] + 1;
    }
    ctx.restore();
    if (next < lines.length) requestAnimationFrame(frame);
    else { cell.drawn = true; cell.state = "drawn"; cell.el.dataset.state = "drawn"; }
  };
  requestAnimationFrame(frame);
}

function drawGroups(grid, cell, spec, groups) {
  grid.drop(cell);
  cell.generation++;
  cell.series = [];
  cell.groups = groups;
  if (!groups.length) {
    cell.info.textContent = `none of the selected runs logged ${spec.name}`;
    grid.settle(cell, "empty");
    return;
  }
  const tables = [];
  const series = [{ label: spec.x }];
  const bands = [];
  groups.forEach((g) => {
    const color = groupColor(g.key);
    tables.push([g.x, smooth(g.mean.map((y) => positive(spec, y)), spec.smooth),
      g.high.map((y) => positive(spec, y)), g.low.map((y) => positive(spec, y))]);
    const base = series.length;
    const label = `${groupLabel(spec.group, g.key)} (${g.run_ids.length} runs)`;
    series.push(
      { label, stroke: color, width: 2, spanGaps: true },
      { label: label + " max", stroke: color + "55", width: 1, spanGaps: true },
      { label: label + " min", stroke: color + "55", width: 1, spanGaps: true },
    );
    bands.push({ series: [base + 1, base + 2], fill: color + "22" });
  });
  const tip = (idx) => {
    if (idx === null || idx === undefined || !cell.u) return;
    const x = cell.u.data[0][idx];
    grid.tip.textContent = [`${spec.name}, ${spec.x} ~${x}`, ...groups.map((g) => {
      const j = g.x.indexOf(x);
      return j < 0 ? null : `${groupLabel(spec.group, g.key)}: mean ${g.mean[j]}`
        + ` [${g.low[j]}..${g.high[j]}] over ${g.count[j]} value(s)`;
    }).filter(Boolean)].join("\n");
  };
  const options = chartOptions(grid, cell, spec, series, { xLabel: spec.x, bands, tip });
  cell.u = new uPlot(options, uPlot.join(tables), cell.plot);
  cell.info.textContent = `${groups.length} group(s) by ${spec.group}: `
    + "the mean of each pixel column's values, in their min-max band";
  cell.drawn = true; // a group is one line per pixel column: uPlot draws it at once
  grid.settle(cell, "drawn");
}

function zoomTo(u) {
  if (u.select.width < 3) return;
  state.lo = u.posToVal(u.select.left, "x");
  state.hi = u.posToVal(u.select.left + u.select.width, "x");
  writeState();
  loadChart();
}

function onGrid(xs, [first, last, width]) {
  // Each pixel column holds at most 4 of a run's points (its first, last, min and max):
  // they are drawn at 4 fixed places (slots) in the column, in their order. The tooltip
  // still shows each point's own x.
  const step = (last - first) / width;
  const out = new Array(xs.length);
  const slots = new Int32Array(xs.length);
  let column = -1;
  let rank = 0;
  for (let j = 0; j < xs.length; j++) {
    const c = Math.min(width - 1, Math.max(0, Math.floor((xs[j] - first) / step)));
    rank = c === column ? rank + 1 : 0;
    column = c;
    slots[j] = 4 * c + Math.min(rank, 3);
    out[j] = slotX(slots[j], first, step);
  }
  return { xs: out, slots };
}

function slotX(slot, first, step) {
  return first + (Math.floor(slot / 4) + ((slot % 4) + 0.5) / 4) * step;
}

function joinOnGrid(tables, slots, grid) {
  // uPlot.join for runs bucketed on one grid: their x values are slots of it, so the
  // joined table is indexed by slot, with no search (join's sets and maps of 240,000
  // values take 60 ms). Null when a run is not on the grid (sent whole).
  if (!grid || slots.some((s) => !s)) return null;
  const [first, last, width] = grid;
  const step = (last - first) / width;
  const row = new Int32Array(4 * width).fill(-1);
  for (const s of slots) for (let j = 0; j < s.length; j++) row[s[j]] = 0;
  const xs = [];
  for (let slot = 0; slot < row.length; slot++) {
    if (row[slot] === 0) {
      row[slot] = xs.length;
      xs.push(slotX(slot, first, step));
    }
  }
  const data = [xs];
  tables.forEach((table, t) => {
    for (const values of table.slice(1)) {
      const joined = new Array(xs.length).fill(null);
      for (let j = 0; j < values.length; j++) joined[row[slots[t][j]]] = values[j];
      data.push(joined);
    }
  });
  return data;
}

function axisLabel(spec, found) {
  if (spec.x === "time") return "seconds since the run started";
  const loops = [...new Set(found.map((s) => s.loop).filter(Boolean))];
  return loops.length === 1 ? `${loops[0]} (counted across outer iterations)` : "value number";
}

function showTip(grid, cell, spec, idx) {
  if (!grid.tip) return;
  if (idx === null || idx === undefined || !cell.u) {
    grid.tip.textContent = "";
    return;
  }
  const x = cell.u.data[0][idx];
  const lines = [];
  for (const s of cell.series) {
    const j = (s.shown_x || s.x).indexOf(x);
    if (j < 0) continue;
    if (!lines.length) lines.push(`${spec.name}, ${spec.x} ${s.x[j]}`);
    const value = s.y[j] === null ? (s.y_text[j] || "null") : String(s.y[j]);
    let how = "recorded";
    if (s.origin[j] !== ORIGIN.recorded) {
      const code = (s.code_commit || "").slice(0, 10);
      how = `backfilled by replay ${s.replay ? s.replay[j] : "?"} in code version ${code}`;
      if (s.origin[j] === ORIGIN.inexact) how += ", INEXACT (the replay's check found differences)";
    }
    lines.push(`${s.run_id}: ${value}  (${how})`);
  }
  grid.tip.textContent = lines.join("\n");
}

// -- export ------------------------------------------------------------------------------------

function download(name, blob) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

function fileName(cell, ext) {
  return `${cell.name.replace(/[^A-Za-z0-9_.-]+/g, "_")}.${ext}`;
}

// The drawn series: label, colour, dashed, and per row of the chart's table its value.
function drawnLines(cell) {
  const u = cell.u;
  if (!u) return [];
  return u.series.slice(1).map((s, i) => ({ label: s.label, color: s.stroke ? s.stroke() : "#000",
    values: u.data[i + 1], dash: Boolean(s.dash), band: / (max|min)$/.test(s.label) }));
}

const EXPORTED_ENTRIES = 40; // legend rows in an exported image; the rest are counted

function legendEntries(cell) {
  const entries = cell.groups
    ? cell.groups.map((g) => ({ color: groupColor(g.key),
      text: `${groupLabel(cell.spec.group, g.key)} (${g.run_ids.length} runs)` }))
    : cell.series.map((s) => ({ color: runColor(s.run_id),
      text: runLabel(s.run_id, cell.spec.label) }));
  if (entries.length <= EXPORTED_ENTRIES) return entries;
  return [...entries.slice(0, EXPORTED_ENTRIES - 1),
    { color: "#fff", text: `and ${entries.length - EXPORTED_ENTRIES + 1} more` }];
}

function exportCsv(cell) {
  const u = cell.u;
  if (!u) return;
  const quote = (t) => (/[",\n]/.test(t) ? `"${t.replace(/"/g, '""')}"` : t);
  const header = [cell.spec.x, ...drawnLines(cell).map((l) => l.label)].map(quote).join(",");
  const rows = u.data[0].map((x, i) => [x, ...u.data.slice(1).map((v) => v[i] ?? "")].join(","));
  download(fileName(cell, "csv"), new Blob([[header, ...rows].join("\n") + "\n"],
    { type: "text/csv" }));
}

const LEGEND_ROW = 16;

function exportPng(cell) {
  const u = cell.u;
  if (!u) return;
  const ratio = uPlot.pxRatio;
  const entries = legendEntries(cell);
  const source = u.ctx.canvas;
  const canvas = document.createElement("canvas");
  canvas.width = source.width;
  canvas.height = source.height + Math.round((24 + LEGEND_ROW * entries.length + 8) * ratio);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.scale(ratio, ratio);
  ctx.fillStyle = "#1d1d1f";
  ctx.font = "bold 14px system-ui, sans-serif";
  ctx.fillText(cell.name, 8, 17);
  ctx.drawImage(source, 0, 24, source.width / ratio, source.height / ratio);
  ctx.font = "12px system-ui, sans-serif";
  entries.forEach((e, i) => {
    const y = 24 + source.height / ratio + 4 + i * LEGEND_ROW;
    ctx.fillStyle = e.color;
    ctx.fillRect(8, y + 3, 10, 10);
    ctx.fillStyle = "#1d1d1f";
    ctx.fillText(e.text, 24, y + 12);
  });
  canvas.toBlob((blob) => download(fileName(cell, "png"), blob), "image/png");
}

function escapeXml(text) {
  return String(text).replace(/[<>&"]/g, (c) => ({ "<": "&lt;", ">": "&gt;", "&": "&amp;",
    '"': "&quot;" })[c]);
}

function chartSvg(cell) {
  // The chart as vector graphics: the same scales as on screen (uPlot's valToPos), its
  // axes' ticks, every drawn line, the title and the legend.
  const u = cell.u;
  const ratio = uPlot.pxRatio;
  const left = u.bbox.left / ratio;
  const top = 24 + u.bbox.top / ratio;
  const w = u.bbox.width / ratio;
  const h = u.bbox.height / ratio;
  const entries = legendEntries(cell);
  const width = u.width;
  const height = 24 + u.height + 8 + LEGEND_ROW * entries.length;
  const out = [`<svg xmlns="http://www.w3.org/2000/svg" width="${width}" height="${height}"`
    + ` viewBox="0 0 ${width} ${height}" font-family="system-ui, sans-serif" font-size="11">`,
  `<rect width="100%" height="100%" fill="#fff"/>`,
  `<text x="8" y="17" font-size="14" font-weight="bold">${escapeXml(cell.name)}</text>`,
  `<rect x="${left}" y="${top}" width="${w}" height="${h}" fill="none" stroke="#ddd"/>`];
  const [xAxis, yAxis] = u.axes;
  (xAxis._splits || []).forEach((v, i) => {
    const x = left + u.valToPos(v, "x");
    if (x < left - 0.5 || x > left + w + 0.5) return;
    out.push(`<line x1="${x}" y1="${top}" x2="${x}" y2="${top + h}" stroke="#eee"/>`,
      `<text x="${x}" y="${top + h + 14}" text-anchor="middle">${escapeXml(xAxis._values[i])}</text>`);
  });
  (yAxis._splits || []).forEach((v, i) => {
    const y = top + u.valToPos(v, "y");
    if (y < top - 0.5 || y > top + h + 0.5) return;
    out.push(`<line x1="${left}" y1="${y}" x2="${left + w}" y2="${y}" stroke="#eee"/>`,
      `<text x="${left - 4}" y="${y + 4}" text-anchor="end">${escapeXml(yAxis._values[i])}</text>`);
  });
  const xs = u.data[0];
  for (const line of drawnLines(cell)) {
    let path = "";
    let pen = "M";
    line.values.forEach((v, j) => {
      if (v === null || v === undefined) return; // gaps are spanned, as on screen
      const px = left + u.valToPos(xs[j], "x");
      const py = top + u.valToPos(v, "y");
      if (!Number.isFinite(px) || !Number.isFinite(py)) return;
      path += `${pen}${px.toFixed(1)} ${py.toFixed(1)}`;
      pen = "L";
    });
    if (!path) continue;
    const color = line.color.length === 9 ? line.color.slice(0, 7) : line.color;
    const opacity = line.band ? ' stroke-opacity="0.35"' : "";
    out.push(`<path d="${path}" fill="none" stroke="${color}" stroke-width="1.5"${opacity}`
      + `${line.dash ? ' stroke-dasharray="6 4"' : ""}><title>${escapeXml(line.label)}</title></path>`);
  }
  entries.forEach((e, i) => {
    const y = 24 + u.height + 8 + i * LEGEND_ROW;
    out.push(`<rect x="8" y="${y + 2}" width="10" height="10" fill="${e.color}"/>`,
      `<text x="24" y="${y + 11}">${escapeXml(e.text)}</text>`);
  });
  out.push("</svg>");
  return out.join("\n");
}

function exportSvg(cell) {
  if (!cell.u) return;
  download(fileName(cell, "svg"), new Blob([chartSvg(cell)], { type: "image/svg+xml" }));
}

// -- parallel coordinates and a scatter, linked to the table -----------------------------------

const explore = { rows: [], args: new Map(), columns: [], brushes: {}, generation: 0,
  controller: null };

async function loadExplore() {
  // The runs the table's filter chooses (up to 1,000), each with its arguments and the
  // aggregate of every charted name and of the scatter's metric.
  const metrics = [...new Set([...state.charts, state.sy].filter(Boolean))];
  const columns = metrics.map((m) => `${m}:${state.sagg}`);
  const q = new URLSearchParams({ limit: "1000", sort: "started_at", desc: "1" });
  if (state.where) q.set("where", state.where);
  if (columns.length) q.set("columns", columns.join(","));
  const generation = ++explore.generation;
  if (explore.controller) explore.controller.abort();
  explore.controller = new AbortController();
  let found;
  try {
    found = await api("/api/runs?" + q, { signal: explore.controller.signal });
  } catch (err) {
    if (aborted(err) || generation !== explore.generation) return;
    $("explore-info").textContent = err.message;
    return;
  }
  if (generation !== explore.generation) return;
  explore.rows = found.rows;
  explore.columns = found.columns;
  explore.aggregate = state.sagg;
  for (const row of found.rows) explore.args.set(row.run_id, row.args || {});
  const args = [...new Set(found.rows.flatMap((r) => Object.keys(r.args || {})))].sort();
  fillSelect($("scatter-x"), args, state.sx, "(an argument)");
  fillSelect($("chart-label"), args, state.label, "run id");
  $("explore-info").textContent = `${found.rows.length} of ${found.total} runs`
    + (found.total > found.rows.length ? " (the newest)" : "");
  drawExplore();
  mainGrid.renderLegend();
}

function numeric(v) { return typeof v === "number" && Number.isFinite(v); }

// An axis over the values of a numeric field: linear, or logarithmic when they are positive
// and span more than two decades (learning rates).
function axisOf(key, label, values) {
  const nums = values.filter(numeric);
  if (!nums.length) return null;
  let lo = Math.min(...nums);
  let hi = Math.max(...nums);
  const log = lo > 0 && hi / lo > 100;
  if (lo === hi) { lo -= 0.5; hi += 0.5; }
  const f = log ? Math.log10 : (v) => v;
  const a = f(lo);
  const b = f(hi);
  return { key, label, lo, hi, log, at: (v) => (numeric(v) && (!log || v > 0) ? (f(v) - a) / (b - a) : null) };
}

function exploreFields() {
  const rows = explore.rows;
  const args = [...new Set(rows.flatMap((r) => Object.keys(r.args || {})))].sort();
  const fields = [];
  for (const name of args) {
    const values = rows.map((r) => (r.args || {})[name]);
    if (new Set(values.map(String)).size < 2) continue; // the same in every run
    const axis = axisOf({ arg: name }, name, values);
    if (axis) fields.push(axis);
  }
  for (const column of explore.columns) {
    const axis = axisOf({ column }, column, rows.map((r) => r[column]));
    if (axis) fields.push(axis);
  }
  return fields;
}

function fieldValue(row, key) {
  return key.arg !== undefined ? (row.args || {})[key.arg] : row[key.column];
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function tickText(axis, t) {
  const v = axis.log ? 10 ** (Math.log10(axis.lo) + t * (Math.log10(axis.hi) - Math.log10(axis.lo)))
    : axis.lo + t * (axis.hi - axis.lo);
  return formatValue(Number(v.toPrecision(3)));
}

function drawExplore() {
  drawParallel();
  drawScatter();
}

function drawParallel() {
  const box = $("parallel");
  if (!box) return;
  const fields = exploreFields();
  const chosen = new Set(chartSelection.get());
  if (fields.length < 2) {
    box.replaceChildren();
    box.dataset.axes = "0";
    $("parallel-info").textContent = explore.rows.length
      ? "parallel coordinates need two or more arguments or metrics that vary: add a chart"
      : "";
    return;
  }
  $("parallel-info").textContent = "drag along an axis to select the runs in a range";
  const width = Math.max(400, box.clientWidth || 800);
  const height = 260;
  const pad = { left: 40, right: 60, top: 24, bottom: 24 };
  const step = (width - pad.left - pad.right) / (fields.length - 1);
  const y = (t) => pad.top + (1 - t) * (height - pad.top - pad.bottom);
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`,
    "font-size": 11, "font-family": "system-ui, sans-serif", role: "img",
    "aria-label": "parallel coordinates" });
  svg.append(svgEl("rect", { width, height, fill: "#fff" }));
  const lines = svgEl("g", { fill: "none" });
  // Unselected runs first, in grey, so the selected ones are drawn over them.
  const ordered = [...explore.rows].sort((a, b) => chosen.has(a.run_id) - chosen.has(b.run_id));
  for (const row of ordered) {
    const points = fields.map((f, i) => {
      const t = f.at(fieldValue(row, f.key));
      return t === null ? null : `${(pad.left + i * step).toFixed(1)},${y(t).toFixed(1)}`;
    });
    if (points.some((p) => p === null)) continue;
    const on = chosen.has(row.run_id);
    const line = svgEl("polyline", { points: points.join(" "),
      stroke: on ? runColor(row.run_id) : "#c7c7cc", "stroke-width": on ? 1.6 : 1,
      "stroke-opacity": on ? 0.95 : 0.6, "data-run": row.run_id });
    line.append(svgEl("title", {}, row.run_id));
    lines.append(line);
  }
  svg.append(lines);
  fields.forEach((f, i) => {
    const x = pad.left + i * step;
    const g = svgEl("g", { "data-axis": f.label });
    g.append(svgEl("line", { x1: x, x2: x, y1: y(1), y2: y(0), stroke: "#6e6e73" }));
    g.append(svgEl("text", { x, y: 14, "text-anchor": "middle", "font-weight": "bold" }, f.label
      + (f.log ? " (log)" : "")));
    for (const t of [0, 0.5, 1]) {
      g.append(svgEl("text", { x: x + 4, y: y(t) + 4, fill: "#6e6e73" }, tickText(f, t)));
    }
    const brush = explore.brushes[f.label];
    if (brush) {
      g.append(svgEl("rect", { x: x - 6, width: 12, y: y(brush[1]), height: y(brush[0]) - y(brush[1]),
        fill: "#1f77b433", stroke: "#1f77b4", class: "brush" }));
    }
    // A wide transparent strip to drag on.
    const grip = svgEl("rect", { x: x - 12, width: 24, y: y(1), height: y(0) - y(1),
      fill: "transparent", class: "grip", style: "cursor: ns-resize" });
    grip.addEventListener("pointerdown", (event) => brushAxis(event, svg, f, y, height, pad));
    g.append(grip);
    svg.append(g);
  });
  box.replaceChildren(svg);
  box.dataset.axes = String(fields.length);
}

function svgPoint(svg, event) {
  const r = svg.getBoundingClientRect();
  return { x: event.clientX - r.left, y: event.clientY - r.top };
}

function brushAxis(event, svg, field, y, height, pad) {
  event.preventDefault();
  // A brush that starts or ends within 3 px of an axis's end reaches the end: the runs at
  // the extreme value are in it.
  const span = height - pad.top - pad.bottom;
  const t = (py) => {
    const v = 1 - (py - pad.top) / span;
    return v > 1 - 3 / span ? 1 : v < 3 / span ? 0 : v;
  };
  const start = t(svgPoint(svg, event).y);
  const move = (e) => {
    const now = t(svgPoint(svg, e).y);
    explore.brushes[field.label] = [Math.min(start, now), Math.max(start, now)];
  };
  const up = (e) => {
    window.removeEventListener("pointermove", move);
    window.removeEventListener("pointerup", up);
    move(e);
    const [a, b] = explore.brushes[field.label];
    if (b - a < 0.01) delete explore.brushes[field.label]; // a click clears the axis's brush
    selectBrushed();
  };
  window.addEventListener("pointermove", move);
  window.addEventListener("pointerup", up);
}

function selectBrushed() {
  const fields = exploreFields();
  const active = fields.filter((f) => explore.brushes[f.label]);
  if (!active.length) { drawExplore(); return; }
  const ids = explore.rows.filter((row) => active.every((f) => {
    const t = f.at(fieldValue(row, f.key));
    const [a, b] = explore.brushes[f.label];
    return t !== null && t >= a - 1e-9 && t <= b + 1e-9;
  })).map((row) => row.run_id);
  chartSelection.set(ids);
  drawExplore();
}

function drawScatter() {
  const box = $("scatter");
  if (!box) return;
  const column = state.sy ? `${state.sy}:${explore.aggregate || state.sagg}` : "";
  if (!state.sx || !state.sy || !explore.columns.includes(column)) {
    box.replaceChildren();
    box.dataset.points = "0";
    $("scatter-info").textContent = "pick an argument and a metric";
    return;
  }
  const rows = explore.rows;
  const xAxis = axisOf({ arg: state.sx }, state.sx, rows.map((r) => (r.args || {})[state.sx]));
  const yAxis = axisOf({ column }, column, rows.map((r) => r[column]));
  if (!xAxis || !yAxis) {
    box.replaceChildren();
    box.dataset.points = "0";
    $("scatter-info").textContent = `no run has a number for both ${state.sx} and ${column}`;
    return;
  }
  $("scatter-info").textContent = "drag a rectangle to select the runs in it";
  const chosen = new Set(chartSelection.get());
  const width = Math.max(300, Math.min(700, box.clientWidth || 600));
  const height = 280;
  const pad = { left: 60, right: 16, top: 16, bottom: 36 };
  const px = (t) => pad.left + t * (width - pad.left - pad.right);
  const py = (t) => pad.top + (1 - t) * (height - pad.top - pad.bottom);
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}`, "font-size": 11,
    "font-family": "system-ui, sans-serif", role: "img", "aria-label": "scatter" });
  svg.append(svgEl("rect", { width, height, fill: "#fff" }));
  svg.append(svgEl("rect", { x: pad.left, y: pad.top, width: px(1) - px(0), height: py(0) - py(1),
    fill: "none", stroke: "#ddd" }));
  for (const t of [0, 0.5, 1]) {
    svg.append(svgEl("text", { x: px(t), y: height - 20, "text-anchor": "middle", fill: "#6e6e73" },
      tickText(xAxis, t)));
    svg.append(svgEl("text", { x: pad.left - 4, y: py(t) + 4, "text-anchor": "end", fill: "#6e6e73" },
      tickText(yAxis, t)));
  }
  svg.append(svgEl("text", { x: (px(0) + px(1)) / 2, y: height - 4, "text-anchor": "middle" },
    state.sx + (xAxis.log ? " (log)" : "")));
  svg.append(svgEl("text", { x: 12, y: (py(0) + py(1)) / 2, "text-anchor": "middle",
    transform: `rotate(-90 12 ${(py(0) + py(1)) / 2})` }, column + (yAxis.log ? " (log)" : "")));
  let points = 0;
  for (const row of rows) {
    const tx = xAxis.at((row.args || {})[state.sx]);
    const ty = yAxis.at(row[column]);
    if (tx === null || ty === null) continue;
    const on = chosen.has(row.run_id);
    const dot = svgEl("circle", { cx: px(tx).toFixed(1), cy: py(ty).toFixed(1), r: on ? 4.5 : 3.5,
      fill: on ? runColor(row.run_id) : "#c7c7cc", stroke: on ? "#1d1d1f" : "none",
      "data-run": row.run_id });
    dot.append(svgEl("title", {}, `${row.run_id}: ${state.sx}=${formatValue((row.args || {})[state.sx])}, `
      + `${column}=${formatValue(row[column])}`));
    svg.append(dot);
    points++;
  }
  const band = svgEl("rect", { fill: "#1f77b422", stroke: "#1f77b4", visibility: "hidden" });
  svg.append(band);
  svg.addEventListener("pointerdown", (event) => {
    event.preventDefault();
    const start = svgPoint(svg, event);
    const move = (e) => {
      const now = svgPoint(svg, e);
      Object.entries({ x: Math.min(start.x, now.x), y: Math.min(start.y, now.y),
        width: Math.abs(now.x - start.x), height: Math.abs(now.y - start.y), visibility: "visible" })
        .forEach(([k, v]) => band.setAttribute(k, String(v)));
    };
    const up = (e) => {
      window.removeEventListener("pointermove", move);
      window.removeEventListener("pointerup", up);
      const now = svgPoint(svg, e);
      const [x0, x1] = [Math.min(start.x, now.x), Math.max(start.x, now.x)];
      const [y0, y1] = [Math.min(start.y, now.y), Math.max(start.y, now.y)];
      const ids = [...svg.querySelectorAll("circle")].filter((c) => {
        const cx = Number(c.getAttribute("cx"));
        const cy = Number(c.getAttribute("cy"));
        return cx >= x0 && cx <= x1 && cy >= y0 && cy <= y1;
      }).map((c) => c.dataset.run);
      chartSelection.set(ids);
    };
    window.addEventListener("pointermove", move);
    window.addEventListener("pointerup", up);
  });
  box.replaceChildren(svg);
  box.dataset.points = String(points);
}

// -- exporting the parallel coordinates and the scatter ---------------------------------------

function plotSvg(plot) {
  const svg = $(plot).querySelector("svg");
  if (!svg) return null;
  const copy = svg.cloneNode(true);
  copy.setAttribute("xmlns", SVG);
  for (const grip of copy.querySelectorAll(".grip")) grip.remove();
  return new XMLSerializer().serializeToString(copy);
}

function exportPlotSvg(plot) {
  const text = plotSvg(plot);
  if (text) download(`${plot}.svg`, new Blob([text], { type: "image/svg+xml" }));
}

function exportPlotPng(plot) {
  const text = plotSvg(plot);
  if (!text) return;
  const svg = $(plot).querySelector("svg");
  const [width, height] = [Number(svg.getAttribute("width")), Number(svg.getAttribute("height"))];
  const image = new Image();
  const url = URL.createObjectURL(new Blob([text], { type: "image/svg+xml" }));
  image.onload = () => {
    const canvas = document.createElement("canvas");
    canvas.width = Math.round(width * devicePixelRatio);
    canvas.height = Math.round(height * devicePixelRatio);
    const ctx = canvas.getContext("2d");
    ctx.scale(devicePixelRatio, devicePixelRatio);
    ctx.drawImage(image, 0, 0, width, height);
    URL.revokeObjectURL(url);
    canvas.toBlob((blob) => download(`${plot}.png`, blob), "image/png");
  };
  image.src = url;
}

function exportPlotCsv(plot) {
  // One row per run drawn: its id, then the plot's fields.
  const fields = plot === "parallel" ? exploreFields().map((f) => ({ label: f.label, key: f.key }))
    : [{ label: state.sx, key: { arg: state.sx } },
      { label: `${state.sy}:${explore.aggregate || state.sagg}`,
        key: { column: `${state.sy}:${explore.aggregate || state.sagg}` } }];
  const drawn = new Set([...$(plot).querySelectorAll("[data-run]")].map((e) => e.dataset.run));
  const quote = (t) => (/[",\n]/.test(t) ? `"${t.replace(/"/g, '""')}"` : t);
  const cell = (v) => (v === null || v === undefined ? ""
    : quote(typeof v === "object" ? JSON.stringify(v) : String(v)));
  const rows = explore.rows.filter((r) => drawn.has(r.run_id))
    .map((r) => [r.run_id, ...fields.map((f) => cell(fieldValue(r, f.key)))].join(","));
  const header = ["run_id", ...fields.map((f) => quote(f.label))].join(",");
  download(`${plot}.csv`, new Blob([[header, ...rows].join("\n") + "\n"], { type: "text/csv" }));
}
