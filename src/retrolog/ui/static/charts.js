// The dashboard's charts (docs/ui.md): uPlot time series of a logged name over the selected
// runs, or over groups of them. Loaded before app.js, whose state, view and api it uses;
// app.js calls loadNames and loadChart.
"use strict";

const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf",
  "#7f7f7f", "#bcbd22", "#d62728"];
const ORIGIN = { recorded: 0, backfilled: 1, inexact: 2 };

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

async function loadNames() {
  const names = await api("/api/names");
  const select = $("chart-name");
  select.replaceChildren(...["", ...names].map((n) => {
    const option = document.createElement("option");
    option.value = n;
    option.textContent = n || "(pick a name)";
    return option;
  }));
  select.value = state.name;
  $("name-list").replaceChildren(...names.map((n) => {
    const option = document.createElement("option");
    option.value = n;
    return option;
  }));
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

async function loadChart() {
  const signal = supersede("chart");
  const target = $("chart");
  if (!state.name || !state.selected.length) {
    if (view.chart) view.chart.destroy();
    view.chart = null;
    view.series = [];
    $("chart-info").textContent = state.name ? "select runs in the table" : "";
    return;
  }
  const width = Math.max(200, target.clientWidth || 800);
  const q = new URLSearchParams({ name: state.name, runs: state.selected.join(","), x: state.x,
    width: String(width) });
  if (state.lo !== null) q.set("lo", String(state.lo));
  if (state.hi !== null) q.set("hi", String(state.hi));
  if (state.group) q.set("by", state.group);
  let found;
  try {
    found = state.group ? await api("/api/groups?" + q, { signal })
      : decodeSeries(await apiBytes("/api/series?format=binary&" + q, { signal }));
  } catch (err) {
    if (aborted(err)) return;
    $("chart-info").textContent = err.message;
    return;
  }
  if (signal.aborted) return; // a newer chart was asked for meanwhile
  if (state.group) {
    view.series = [];
    view.groups = found;
    drawGroups(found, width);
    $("chart-info").textContent = `${found.length} group(s) by ${state.group}: `
      + "the mean of each pixel column's values, in their min-max band";
    return;
  }
  await new Promise((resolve) => setTimeout(resolve, 0)); // decoding was one task, this another
  view.groups = null;
  view.series = found;
  drawChart(found, width);
  const sent = found.reduce((n, s) => n + s.x.length, 0);
  const stored = found.reduce((n, s) => n + s.in_range, 0);
  $("chart-info").textContent = found.length
    ? `${found.length} run(s), ${sent} of ${stored} points drawn`
      + (sent < stored ? " (each pixel's first, last, min and max)" : " (all)")
    : `none of the selected runs logged ${state.name}`;
}

function drawChart(found, width) {
  if (view.chart) view.chart.destroy();
  view.chart = null;
  if (!found.length) return;
  const tables = [];
  const series = [{ label: state.x }];
  const lines = []; // drawn by drawLines, a few runs per frame
  const slots = []; // per run, each point's place on the shared grid (null: not on one)
  const lineWidth = found.length > 10 ? 1 : 1.5; // many runs: thin lines, drawn faster
  const line = (options) => {
    lines.push({ index: series.length, ...options });
    series.push({ ...options, spanGaps: true, paths: NO_PATH });
  };
  found.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pick = (test) => s.y.map((y, j) => (test(s.origin[j]) ? positive(y) : null));
    // A downsampled run's points sit on the pixel columns every run shares, so the runs
    // line up in one table instead of a union of all their x values.
    const placed = s.grid ? onGrid(s.x, s.grid) : null;
    s.shown_x = placed ? placed.xs : s.x;
    slots.push(placed && placed.slots);
    const table = [s.shown_x, smooth(pick((o) => o === ORIGIN.recorded), state.smooth)];
    line({ label: s.run_id, stroke: color, width: lineWidth });
    if (s.origin.some((o) => o !== ORIGIN.recorded)) {
      table.push(smooth(pick((o) => o !== ORIGIN.recorded), state.smooth));
      line({ label: s.run_id + " backfilled", stroke: color, width: lineWidth, dash: [6, 4],
        points: { show: true, size: 4, fill: color } });
    }
    if (s.origin.some((o) => o === ORIGIN.inexact)) {
      table.push(pick((o) => o === ORIGIN.inexact));
      series.push({ label: s.run_id + " inexact", stroke: "#d62728", paths: () => null,
        points: { show: true, size: 7, fill: "#d62728" } });
    }
    tables.push(table);
  });
  const data = joinOnGrid(tables, slots, found[0].grid) || uPlot.join(tables);
  const xRange = state.lo !== null || state.hi !== null
    ? { auto: false, range: [state.lo ?? data[0][0], state.hi ?? data[0][data[0].length - 1]] }
    : {};
  view.chart = new uPlot({
    width, height: 360,
    scales: { x: { time: false, ...xRange }, y: state.log ? { distr: 3 } : {} },
    series,
    legend: { show: false },
    cursor: { drag: { x: true, y: false, setScale: false } },
    axes: [{ label: axisLabel(found) }, { size: axisSize }],
    hooks: {
      setSelect: [zoomTo],
      setCursor: [(u) => showTip(u.cursor.idx)],
      draw: [(u) => drawLines(u, lines)],
    },
  }, data, $("chart"));
}

const NO_PATH = () => null;
const LINEAR = uPlot.paths.linear();
const POINTS_PER_FRAME = 40000;

function drawLines(u, lines) {
  // uPlot draws the axes and the points; the runs' lines are stroked here, a few runs per
  // animation frame. In one go, 50 runs of 4,800 points are 0.3-0.6 s of canvas work in a
  // single task (software rendering: about 1.4 µs a point), and the page would freeze.
  const generation = (view.drawing = (view.drawing || 0) + 1);
  view.drawn = false;
  let next = 0;
  const frame = () => {
    if (view.drawing !== generation || view.chart !== u) return; // redrawn or replaced
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
    else view.drawn = true;
  };
  requestAnimationFrame(frame);
}

function drawGroups(groups, width) {
  if (view.chart) view.chart.destroy();
  view.chart = null;
  if (!groups.length) return;
  const tables = [];
  const series = [{ label: state.x }];
  const bands = [];
  groups.forEach((g, i) => {
    const color = COLORS[i % COLORS.length];
    tables.push([g.x, smooth(g.mean.map(positive), state.smooth), g.high.map(positive),
      g.low.map(positive)]);
    const base = series.length;
    const label = `${state.group}=${JSON.stringify(g.key)} (${g.run_ids.length} runs)`;
    series.push(
      { label, stroke: color, width: 2, spanGaps: true },
      { label: label + " max", stroke: color + "55", width: 1, spanGaps: true },
      { label: label + " min", stroke: color + "55", width: 1, spanGaps: true },
    );
    bands.push({ series: [base + 1, base + 2], fill: color + "22" });
  });
  view.chart = new uPlot({
    width, height: 360, bands,
    scales: { x: { time: false }, y: state.log ? { distr: 3 } : {} },
    axes: [{ label: state.x }, { size: axisSize }],
    series,
    legend: { show: false },
    cursor: { drag: { x: true, y: false, setScale: false } },
    hooks: {
      setSelect: [zoomTo],
      setCursor: [(u) => {
        const idx = u.cursor.idx;
        if (idx === null || idx === undefined) return;
        const x = u.data[0][idx];
        $("chart-tip").textContent = [`${state.x} ~${x}`, ...groups.map((g) => {
          const j = g.x.indexOf(x);
          return j < 0 ? null : `${state.group}=${JSON.stringify(g.key)}: mean ${g.mean[j]}`
            + ` [${g.low[j]}..${g.high[j]}] over ${g.count[j]} value(s)`;
        }).filter(Boolean)].join("\n");
      }],
    },
  }, uPlot.join(tables), $("chart"));
  view.drawn = true; // a group is one line per pixel column: uPlot draws it at once
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

function positive(y) {
  return state.log && y !== null && y <= 0 ? null : y;
}

function axisLabel(found) {
  if (state.x === "time") return "seconds since the run started";
  const loops = [...new Set(found.map((s) => s.loop).filter(Boolean))];
  return loops.length === 1 ? `${loops[0]} (counted across outer iterations)` : "value number";
}

function showTip(idx) {
  if (idx === null || idx === undefined || !view.chart) {
    $("chart-tip").textContent = "";
    return;
  }
  const x = view.chart.data[0][idx];
  const lines = [];
  for (const s of view.series) {
    const j = (s.shown_x || s.x).indexOf(x);
    if (j < 0) continue;
    if (!lines.length) lines.push(`${state.x} ${s.x[j]}`);
    const value = s.y[j] === null ? (s.y_text[j] || "null") : String(s.y[j]);
    let how = "recorded";
    if (s.origin[j] !== ORIGIN.recorded) {
      const code = (s.code_commit || "").slice(0, 10);
      how = `backfilled by replay ${s.replay ? s.replay[j] : "?"} in code version ${code}`;
      if (s.origin[j] === ORIGIN.inexact) how += ", INEXACT (the replay's check found differences)";
    }
    lines.push(`${s.run_id}: ${value}  (${how})`);
  }
  $("chart-tip").textContent = lines.join("\n");
}

