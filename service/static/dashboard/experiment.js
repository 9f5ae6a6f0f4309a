// One experiment: mixture, objective, guardrails, regret, arms and data health, refreshed by polling.
import {
  OTHER_COLOUR, PALETTE, apiGet, badge, element, formatInteger, formatNumber, formatPercent, poll, withAlpha,
} from "./pasto.js";
import {
  alignToExperiment, armCount, armEstimates, armSamples, cumulativeRegret, deployedBars, eventMarkers, guardrailSeries, guardrailSummary,
  guardrailVerdict, hasData, liftOf, mixtureSeries, objectiveRange, objectiveSeries, observationsSeries, observationsTotal,
  primaryEstimate, primaryLabel,
} from "./model.js";

const name = document.getElementById("experiment").dataset.name;
const path = `/experiments/${encodeURIComponent(name)}`;
const TOP_ARMS = PALETTE.length - 1;
const TABLE_ROWS = 100;
// Above this many arms the page reads summaries: every read asks for ?arms=SUMMARY_ARMS, and the
// server keeps the SUMMARY_ARMS arms of largest max(p_t, deployed) in the per-arm arrays and sums
// the others into one rest entry (docs/api.md); with at most this many arms it answers in full. At
// K = 10,000 a full poll was about 3 MB, a summarised one tens of kilobytes.
const SUMMARY_ARMS = 100;

Chart.defaults.font.family = getComputedStyle(document.documentElement).fontFamily;
Chart.defaults.color = "#5b6575";
Chart.defaults.animation = false;
Chart.defaults.maintainAspectRatio = false;
Chart.defaults.plugins.legend.position = "bottom";
Chart.defaults.plugins.legend.labels.boxWidth = 12;
Chart.defaults.plugins.legend.labels.boxHeight = 12;
Chart.defaults.interaction.mode = "index";
Chart.defaults.interaction.intersect = false;
Chart.defaults.elements.point.radius = 0;
Chart.defaults.elements.point.hoverRadius = 3;

// A legend sample of a line series: a short stroke in its colour, width and dash pattern (Chart.js's
// own "line" point style is always solid, so a dashed threshold got a solid swatch).
function lineSwatch(colour, dash, width) {
  const canvas = document.createElement("canvas");
  canvas.width = 24;
  canvas.height = 12;
  const context = canvas.getContext("2d");
  context.strokeStyle = colour;
  context.lineWidth = Math.max(1.5, width ?? 2);
  context.setLineDash(dash ?? []);
  context.beginPath();
  context.moveTo(0, 6);
  context.lineTo(24, 6);
  context.stroke();
  return canvas;
}

// Line series show their legend sample as a line drawn like the series, bands as a box.
const LINE_LEGEND = {
  labels: {
    usePointStyle: true,
    generateLabels: (chart) => Chart.defaults.plugins.legend.labels.generateLabels(chart).map((item) => {
      const dataset = chart.data.datasets[item.datasetIndex];
      return dataset.pointStyle === "line"
        ? { ...item, pointStyle: lineSwatch(dataset.borderColor, dataset.borderDash, dataset.borderWidth) }
        : item;
    }),
  },
};

const charts = {};

// The markers every round-axis chart draws (eventMarkers of model.js), set by render().
let markers = [];
const MARKER_COLOUR = "#6a3d9a";

// Pauses, resumes, stops and controller restarts as labelled vertical lines at the round they happened
// in. Hovering near one names what happened, and when, in the canvas's tooltip (its title).
const eventMarkerPlugin = {
  id: "eventMarkers",
  afterDatasetsDraw(chart, _args, options) {
    const { ctx, chartArea, scales: { x } } = chart;
    ctx.save();
    ctx.strokeStyle = MARKER_COLOUR;
    ctx.fillStyle = MARKER_COLOUR;
    ctx.lineWidth = 1.5;
    ctx.setLineDash([4, 3]);
    ctx.font = `11px ${Chart.defaults.font.family}`;
    ctx.textBaseline = "top";
    // Right edge of the last label on each text row: a label that would overlap one goes a row lower.
    const rowEnds = [];
    for (const marker of options.markers ?? []) {
      const position = x.getPixelForValue(marker.round);
      if (position < chartArea.left - 1 || position > chartArea.right + 1) continue;
      ctx.beginPath();
      ctx.moveTo(position, chartArea.top);
      ctx.lineTo(position, chartArea.bottom);
      ctx.stroke();
      // The label goes to the line's left when it would run past the chart's right edge.
      const width = ctx.measureText(marker.label).width;
      const left = position + 3 + width > chartArea.right ? position - 3 - width : position + 3;
      let row = rowEnds.findIndex((end) => left > end + 4);
      if (row < 0) row = rowEnds.length;
      rowEnds[row] = left + width;
      ctx.fillText(marker.label, left, chartArea.top + 2 + 13 * row);
    }
    ctx.restore();
  },
  afterEvent(chart, args, options) {
    const { event } = args;
    if (event.type !== "mousemove" && event.type !== "mouseout") return;
    const x = chart.scales.x;
    const near = event.type === "mousemove"
      ? (options.markers ?? []).find((marker) => Math.abs(x.getPixelForValue(marker.round) - event.x) <= 5)
      : undefined;
    const title = near ? near.description : "";
    if (chart.canvas.title !== title) chart.canvas.title = title;
  },
};

function markerFooter(items) {
  const round = items.length ? items[0].parsed.x : null;
  return markers.find((marker) => marker.round === round)?.description ?? "";
}

// Creates the chart on first use; afterwards swaps its data and options in place, so polling does not
// flicker and the round axis follows new rounds. Round-axis charts (a linear x) get the event markers.
function drawChart(id, config) {
  if (config.options?.scales?.x?.type === "linear") {
    config.plugins = [eventMarkerPlugin];
    const tooltip = config.options.plugins?.tooltip ?? {};
    config.options.plugins = {
      ...config.options.plugins,
      eventMarkers: { markers },
      // The tooltip of a round with events ends with what happened in it.
      tooltip: { ...tooltip, callbacks: { ...tooltip.callbacks, footer: markerFooter } },
    };
  }
  if (charts[id]) {
    charts[id].data = config.data;
    charts[id].options = config.options;
    charts[id].update("none");
  } else {
    charts[id] = new Chart(document.getElementById(id), config);
  }
}

// Rounds as (x, y) points on a linear axis: spacing stays honest whatever the labels.
const points = (rounds, values) => rounds.map((round, position) => ({ x: round.index, y: values[position] }));

function roundAxis(rounds) {
  return {
    type: "linear",
    title: { display: true, text: "round" },
    min: rounds.length ? rounds[0].index : 0,
    max: rounds.length ? rounds[rounds.length - 1].index : 1,
    // Without includeBounds: false the last round gets a tick of its own, crowding its neighbour.
    ticks: { precision: 0, maxTicksLimit: 8, includeBounds: false },
  };
}

const percentAxis = (extra = {}) => ({
  min: 0, max: 1, ticks: { callback: (value) => `${Math.round(value * 100)}%`, maxTicksLimit: 6 }, ...extra,
});

function line(label, data, colour, extra = {}) {
  return { label, data, borderColor: colour, backgroundColor: colour, borderWidth: 2, pointStyle: "line", spanGaps: true, ...extra };
}

const numberTooltip = { callbacks: { label: (item) => `${item.dataset.label}: ${formatNumber(item.parsed.y)}` } };

// --- panels -------------------------------------------------------------------------------------

// An arm's colour follows its position in the experiment's definition, not its rank: the same arm
// keeps its colour across refreshes, pages and charts (area chart, deployed bars, arms table). The
// first arms take the palette; later ones a hue of their own, spread by the golden angle.
function definitionColour(index) {
  if (index < PALETTE.length) return PALETTE[index];
  const hue = (index * 137.508) % 360;
  const [s, l] = [0.55, 0.45];
  const a = s * Math.min(l, 1 - l);
  const channel = (n) => {
    const k = (n + hue / 30) % 12;
    const value = l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1));
    return Math.round(255 * value).toString(16).padStart(2, "0");
  };
  return `#${channel(0)}${channel(8)}${channel(4)}`;
}

// `arm` is a position in experiment.arms (null: the "other" series); a summarised response holds some
// arms only, and arm_summary.arms gives each one's position in the definition.
function colourMap(experiment) {
  return (arm) => (arm === null || arm === undefined ? OTHER_COLOUR
    : definitionColour(experiment.arm_summary ? experiment.arm_summary.arms[arm] : arm));
}

function drawMixture(experiment, rounds) {
  const series = mixtureSeries(experiment, rounds, TOP_ARMS);
  const colourOf = colourMap(experiment);
  drawChart("chart-mixture", {
    type: "line",
    data: {
      datasets: series.map((entry, position) => ({
        label: entry.label,
        data: points(rounds, entry.data),
        borderColor: colourOf(entry.arm),
        backgroundColor: withAlpha(colourOf(entry.arm), 0.55),
        borderWidth: 1,
        fill: position === 0 ? "origin" : "-1",
      })),
    },
    options: {
      scales: { x: roundAxis(rounds), y: percentAxis({ stacked: true, title: { display: true, text: "probability p_t (%)" } }) },
      plugins: { tooltip: { callbacks: { label: (item) => `${item.dataset.label}: ${formatPercent(item.parsed.y)}` } } },
    },
  });
  return colourOf;
}

function drawDeployed(experiment, colourOf) {
  const bars = deployedBars(experiment, TOP_ARMS);
  drawChart("chart-deployed", {
    type: "bar",
    data: {
      labels: bars.map((bar) => bar.label),
      datasets: [{
        label: "deployed",
        data: bars.map((bar) => bar.value),
        backgroundColor: bars.map((bar) => withAlpha(colourOf(bar.arm), 0.8)),
        borderColor: bars.map((bar) => colourOf(bar.arm)),
        borderWidth: 1,
      }],
    },
    options: {
      indexAxis: "y",
      interaction: { mode: "nearest", intersect: true },
      scales: {
        x: percentAxis({ title: { display: true, text: "deployed probability (%)" } }),
        y: { ticks: { autoSkip: false }, title: { display: true, text: "arm" } },
      },
      plugins: { legend: { display: false }, tooltip: { callbacks: { label: (item) => formatPercent(item.parsed.x) } } },
    },
  });
}

function drawObjective(rounds) {
  const series = objectiveSeries(rounds);
  const range = objectiveRange(series);
  const clipped = range?.clipped ?? [];
  // Served values off the axis: a marker on the edge they left by, pointing the way they went.
  const outside = clipped.map((position) => ({
    x: rounds[position].index, y: series.served[position] < range.min ? range.min : range.max,
    value: series.served[position],
  }));
  drawChart("chart-objective", {
    type: "line",
    data: {
      datasets: [
        line("served p_t", points(rounds, series.served), "#0072B2"),
        line("deployed mixture", points(rounds, series.deployed), "#009E73"),
        line("best single arm", points(rounds, series.bestSingle), "#D55E00", { borderDash: [6, 4] }),
        line("best mixture", points(rounds, series.bestMixture), "#8a93a3", { borderDash: [2, 3], borderWidth: 1.5 }),
        {
          label: "served p_t off the axis", data: outside, showLine: false, borderColor: "#0072B2",
          backgroundColor: "#0072B2", pointStyle: "triangle", pointRadius: 4, pointHoverRadius: 5,
          pointRotation: outside.map((point) => (point.y === range.min ? 180 : 0)),
        },
      ],
    },
    options: {
      scales: {
        x: roundAxis(rounds),
        y: { title: { display: true, text: "objective f(V p) (primary metric units)" }, ...(range ? { min: range.min, max: range.max } : {}) },
      },
      plugins: {
        legend: { labels: { ...LINE_LEGEND.labels, filter: (item) => item.datasetIndex !== 4 || clipped.length > 0 } },
        tooltip: { callbacks: { label: (item) => `${item.dataset.label}: ${formatNumber(item.raw.value ?? item.parsed.y)}` } },
      },
    },
  });
  document.getElementById("objective-clipped").textContent = clipped.length
    ? `The axis is scaled to the deployed mixture, the best mixture and the best single arm; the served p_t leaves it in ${formatInteger(clipped.length)} of these rounds (exploration), marked ▲▼ on its edge.`
    : "";
}

// `cumulative` is over every round; only the shown `rounds` (the last of them) are drawn.
function drawRegret(rounds, cumulative) {
  drawChart("chart-regret", {
    type: "line",
    data: {
      datasets: [line("cumulative regret of served p_t against the best mixture", points(rounds, cumulative.slice(-rounds.length)), "#CC79A7", {
        backgroundColor: withAlpha("#CC79A7", 0.15), fill: "origin",
      })],
    },
    options: {
      scales: { x: roundAxis(rounds), y: { beginAtZero: true, title: { display: true, text: "cumulative regret (objective units)" } } },
      plugins: { legend: { display: false }, tooltip: numberTooltip },
    },
  });
}

function guardrailHeading(entry, known) {
  const { spec, current, served } = entry;
  const bound = spec.relative_to
    ? `≥ ${spec.relative_to} ${spec.threshold < 0 ? "−" : "+"} ${formatPercent(Math.abs(spec.threshold))}`
    : `≥ ${formatNumber(spec.threshold)}`;
  // The served traffic (exploration included) is what users get: its badge comes first.
  const verdict = (report, mixture) => !known || report === null || report.estimate === null
    ? badge(`no data (${mixture})`, "")
    : report.holds ? badge(`holds (${mixture})`, "ok") : badge(`violated (${mixture})`, "bad");
  return element("h3", {}, `${entry.metric} ${bound}`, verdict(served, "served"), " ", verdict(current, "deployed"));
}

function drawGuardrails(experiment, rounds, diagnostics) {
  const container = document.getElementById("guardrail-panels");
  const series = guardrailSeries(experiment, rounds, diagnostics);
  document.getElementById("guardrails-empty").hidden = series.length > 0;
  if (container.children.length !== series.length) {
    container.replaceChildren(...series.map((entry, position) => element(
      "div", { class: "guardrail", dataset: { metric: entry.metric } },
      element("h3"),
      element("div", { class: "chart small" }, element("canvas", {
        id: `chart-guardrail-${position}`, role: "img", "aria-label": `Guardrail ${entry.metric} over rounds`,
      })),
    )));
  }
  series.forEach((entry, position) => {
    container.children[position].querySelector("h3").replaceWith(guardrailHeading(entry, hasData(diagnostics)));
    const band = withAlpha("#0072B2", 0.18);
    drawChart(`chart-guardrail-${position}`, {
      type: "line",
      data: {
        datasets: [
          // The band is the area between these two series; only the upper one is named in the legend.
          line("interval low", points(rounds, entry.lower), "transparent", { borderWidth: 0 }),
          line("95% interval", points(rounds, entry.upper), "transparent", { borderWidth: 0, fill: "-1", backgroundColor: band, pointStyle: "rect" }),
          line("estimate", points(rounds, entry.estimate), "#0072B2"),
          line("threshold", points(rounds, entry.threshold), "#B3261E", { borderDash: [6, 4] }),
        ],
      },
      options: {
        scales: { x: roundAxis(rounds), y: { title: { display: true, text: `${entry.metric} (mean per observation)` } } },
        plugins: {
          legend: { labels: { ...LINE_LEGEND.labels, filter: (item) => item.datasetIndex !== 0 } },
          tooltip: { ...numberTooltip, filter: (item) => item.datasetIndex !== 0 },
        },
      },
    });
  });
}

function drawObservations(rounds) {
  const { onTime, late, inProgress } = observationsSeries(rounds);
  const axis = roundAxis(rounds);
  drawChart("chart-observations", {
    type: "bar",
    data: {
      datasets: [
        { label: "on time", data: points(rounds, onTime), backgroundColor: withAlpha("#0072B2", 0.75) },
        { label: "late", data: points(rounds, late), backgroundColor: withAlpha("#E69F00", 0.9) },
        { label: "current round so far (in progress)", data: points(rounds, inProgress),
          backgroundColor: withAlpha("#8a93a3", 0.15), borderColor: "#8a93a3", borderWidth: 1 },
      ],
    },
    options: {
      scales: {
        // Half a round either side of the first and last bar: no empty slot before round 0
        // (the category-style offset added a whole one).
        x: { ...axis, min: axis.min - 0.5, max: axis.max + 0.5, offset: false, stacked: true },
        y: { stacked: true, beginAtZero: true, ticks: { precision: 0 }, title: { display: true, text: "observations" } },
      },
    },
  });
}

// --- arms table ---------------------------------------------------------------------------------

const sort = { key: "probability", direction: "descending" };
let showAllArms = false;

function armRows(experiment, rounds, diagnostics) {
  const estimates = armEstimates(experiment, diagnostics);
  // Summarised (K > SUMMARY_ARMS): an arm's observations in the rounds are known only for the rounds
  // read while it was among the kept arms, so the column shows its distinct units over every round
  // (diagnostics), which is known exactly.
  const samples = experiment.arm_summary ? diagnostics.units : armSamples(experiment, rounds);
  return experiment.arms.map((arm, position) => ({
    position,
    // The arm's position among all K (a summarised response holds some arms only): ties sort by it.
    armPosition: experiment.arm_summary ? experiment.arm_summary.arms[position] : position,
    name: arm.name,
    params: Object.entries(arm.params).map(([key, value]) => `${key}=${JSON.stringify(value)}`).join(", "),
    probability: experiment.probabilities[position],
    deployed: experiment.deployed[position],
    samples: samples[position],
    means: Object.fromEntries(experiment.metrics.map((metric) => [metric, estimates[metric][position]])),
  }));
}

function sortValue(row, key) {
  return key.startsWith("mean:") ? row.means[key.slice(5)].mean : row[key];
}

function compareRows(a, b) {
  const left = sortValue(a, sort.key);
  const right = sortValue(b, sort.key);
  if (left === right) return a.armPosition - b.armPosition;
  if (left === null) return 1; // arms without data last, in either direction
  if (right === null) return -1;
  const order = typeof left === "string" ? left.localeCompare(right, undefined, { numeric: true }) : left - right;
  return sort.direction === "ascending" ? order : -order;
}

function drawArms(experiment, rounds, diagnostics, colourOf) {
  const columns = [
    { key: "name", label: "Arm" },
    { key: "params", label: "Params" },
    { key: "probability", label: "p_t", numeric: true },
    { key: "deployed", label: "Deployed", numeric: true },
    { key: "samples", label: experiment.arm_summary ? "Units" : "Observations", numeric: true },
    ...experiment.metrics.map((metric) => ({ key: `mean:${metric}`, label: metric, numeric: true })),
  ];
  document.getElementById("arms-head").replaceChildren(...columns.map((column) => {
    const button = element("button", { type: "button" }, column.label);
    button.addEventListener("click", () => {
      if (sort.key === column.key) sort.direction = sort.direction === "ascending" ? "descending" : "ascending";
      else Object.assign(sort, { key: column.key, direction: column.numeric ? "descending" : "ascending" });
      render();
    });
    return element("th", {
      scope: "col", class: column.numeric ? "num" : null, dataset: { key: column.key },
      "aria-sort": sort.key === column.key ? sort.direction : "none",
    }, button);
  }));

  const rows = armRows(experiment, rounds, diagnostics).sort(compareRows);
  const shown = showAllArms ? rows : rows.slice(0, TABLE_ROWS);
  // Summarised: the arms the server left out, as one last row whatever the sort.
  const rest = experiment.rest && element(
    "tr", { class: "other", dataset: { arm: "(other)" } },
    element("td", { class: "arm-name" }, element("span", { class: "swatch", style: `background:${OTHER_COLOUR}` }),
      `other (${formatInteger(experiment.rest.arms)} arms)`),
    element("td", { class: "params" }, `the ${formatInteger(experiment.rest.arms)} arms of smallest p_t and deployed probability, summed`),
    element("td", { class: "num" }, formatPercent(experiment.rest.probabilities)),
    element("td", { class: "num" }, formatPercent(experiment.rest.deployed)),
    element("td", { class: "num" }, formatInteger(diagnostics.rest?.units ?? 0)),
    ...experiment.metrics.map(() => element("td", { class: "num" }, "–")),
  );
  document.getElementById("arms-body").replaceChildren(...shown.map((row) => element(
    "tr", { dataset: { arm: row.name } },
    element("td", { class: "arm-name" }, element("span", { class: "swatch", style: `background:${colourOf(row.position)}` }), row.name),
    element("td", { class: "params" }, row.params),
    element("td", { class: "num" }, formatPercent(row.probability)),
    element("td", { class: "num" }, formatPercent(row.deployed)),
    element("td", { class: "num" }, formatInteger(row.samples)),
    ...experiment.metrics.map((metric) => {
      const { mean, interval } = row.means[metric];
      return element("td", { class: "num" }, formatNumber(mean),
        interval && element("span", { class: "interval" }, `[${formatNumber(interval[0])}, ${formatNumber(interval[1])}]`));
    }),
  )), ...(rest ? [rest] : []));
  document.getElementById("arms-note").hidden = rows.length <= TABLE_ROWS;
  document.getElementById("arms-show-all").textContent = showAllArms
    ? `Show the first ${TABLE_ROWS} only` : `Show all ${rows.length} arms (${TABLE_ROWS} shown)`;
}

document.getElementById("arms-show-all").addEventListener("click", () => {
  showAllArms = !showAllArms;
  render();
});

// --- segments -----------------------------------------------------------------------------------

// The top arms of a mixture as "name 62%, name 30%" (the rest left out): a segment's row stays short at large K.
function topArms(experiment, mixture, count = 3) {
  return mixture.map((p, k) => [p, experiment.arms[k].name]).sort((a, b) => b[0] - a[0]).slice(0, count)
    .map(([p, arm]) => `${arm} ${formatPercent(p)}`).join(", ");
}

function guardrailCell(guardrails) {
  return guardrails.map((entry) => badge(`${entry.metric} ${formatNumber(entry.estimate)}`, entry.holds ? "ok" : "bad"));
}

function drawSegments(experiment, diagnostics) {
  const report = diagnostics.segments;
  document.getElementById("panel-segments").hidden = !report;
  if (!report) return;
  document.getElementById("segments-body").replaceChildren(...report.segments.map((segment) => element(
    "tr", { dataset: { segment: segment.name } },
    element("th", { scope: "row" }, segment.name),
    element("td", { class: "num", dataset: { share: String(segment.share) } }, formatPercent(segment.share)),
    element("td", { class: "num" }, formatInteger(segment.observations)),
    element("td", { class: "params" }, topArms(experiment, segment.deployed)),
    element("td", { class: "num", dataset: { objective: String(segment.objective) } }, formatNumber(segment.objective)),
    element("td", {}, ...guardrailCell(segment.guardrails)),
  )));
  show("fig-segments-objective", formatNumber(report.objective));
  show("fig-segments-global", formatNumber(report.global_mixture.objective));
  const [low, high] = report.gain.interval;
  show("fig-segments-gain", formatNumber(report.gain.value),
    element("span", { class: "interval" }, `[${formatNumber(low)}, ${formatNumber(high)}]`));
  show("fig-segments-platform", ...report.platform_guardrails.map((entry) => badge(
    `${entry.metric} (${entry.scope}) ${formatNumber(entry.estimate)} ≥ ${formatNumber(entry.threshold)}`,
    entry.holds ? "ok" : "bad")));
}

// --- figures ------------------------------------------------------------------------------------

function show(id, ...content) {
  document.getElementById(id).replaceChildren(...content);
}

// "+0.59 [0.52, 0.66] +13%": the lift on the primary metric over the baseline arm with its 95% interval.
function showLift(mixture, lift) {
  const id = `fig-lift-${mixture}`;
  document.getElementById(`${id}-label`).textContent = lift
    ? `Lift over ${lift.baseline}, ${mixture === "served" ? "served" : "deployed"}` : `Lift, ${mixture}`;
  if (!lift) {
    show(id, "no baseline");
    return;
  }
  const signed = (value, format) => (value === null ? "–" : `${value > 0 ? "+" : ""}${format(value)}`);
  const [low, high] = lift.interval;
  if (lift.estimate === null) {
    show(id, ...noData(hasData(latest.diagnostics) ? "not estimated yet" : "no observations yet"));
    document.getElementById(id).dataset.verdict = "unknown";
    return;
  }
  const deployed = mixture === "served" ? liftOf(latest.diagnostics, "deployed") : null;
  const dips = mixture === "served" && lift.estimate < 0 && deployed?.estimate !== null && deployed?.estimate > lift.estimate;
  show(id, signed(lift.estimate, formatNumber),
    element("span", { class: "interval" }, low === null ? " [no interval yet]" : ` [${formatNumber(low)}, ${formatNumber(high)}]`),
    lift.relative === null ? "" : element("span", { class: "interval" }, ` ${signed(lift.relative, formatPercent)}`),
    dips ? explorationNote() : "");
  const verdict = low === null ? "unknown" : low > 0 ? "above" : high < 0 ? "below" : "unclear";
  document.getElementById(id).dataset.verdict = verdict;
}

// Why a served figure can sit below the deployed one: p_t explores. One line under the card.
const EXPLORATION_NOTE = "below the deployed mixture: this round's p_t also explores arms still being measured";

function explorationNote() {
  return element("span", { class: "interval note exploration-note" }, EXPLORATION_NOTE);
}

// "–" and why: a figure that needs data the experiment does not have yet (the API gives null).
function noData(reason) {
  return ["–", element("span", { class: "interval no-data" }, ` ${reason}`)];
}

function figure(id, value, reason, ...detail) {
  if (value === null || value === undefined) show(id, ...noData(reason));
  else show(id, formatNumber(value), ...detail);
}

function drawFigures(experiment, rounds, diagnostics) {
  const status = document.getElementById("status-badge");
  status.textContent = experiment.status;
  status.className = `badge ${experiment.status}`;
  // A failing metric source holds the round open: say why, with the source's own sentence.
  const sourceError = diagnostics.source_error;
  const sourceBanner = document.getElementById("source-error");
  sourceBanner.hidden = !sourceError;
  sourceBanner.textContent = sourceError
    ? `Metric source failing since ${sourceError.since} (${formatInteger(sourceError.failures)} failed attempts): `
      + `${sourceError.message} Round ${formatInteger(experiment.round.index)} stays open and is served until the source answers.`
    : "";
  // The charts run to the current round, whose bar is "in progress" and whose objective is not known
  // until its update: say so here, so the card and the charts tell the same story.
  const applied = experiment.applied_rounds;
  show("fig-round", formatInteger(experiment.round.index), element("span", { class: "interval" },
    experiment.status === "stopped" ? " stopped" : " in progress",
    applied > 0 ? ` · updated through ${formatInteger(applied - 1)}` : " · no update yet"));
  const primary = primaryEstimate(experiment, diagnostics, experiment.deployed);
  document.getElementById("fig-primary-label").textContent = `${primaryLabel(experiment)}, deployed`;
  // Null figures: before the first observation nothing is estimated.
  const reason = hasData(diagnostics) ? "not estimated yet" : "no observations yet";
  figure("fig-primary", primary?.estimate, reason,
    primary?.interval ? element("span", { class: "interval" }, ` ± ${formatNumber((primary.interval[1] - primary.interval[0]) / 2, 2)}`) : "");
  const { probabilities: servedValue, deployed: deployedValue } = diagnostics.objective;
  figure("fig-objective", servedValue, reason,
    servedValue !== null && deployedValue !== null && servedValue < deployedValue ? explorationNote() : "");
  figure("fig-deployed", diagnostics.objective.deployed, reason);
  figure("fig-best-single", diagnostics.best_single?.value, reason,
    element("span", { class: "interval" }, ` ${diagnostics.best_single?.arm}`));
  figure("fig-gain", diagnostics.mixing_gain, reason);
  for (const mixture of ["served", "deployed"]) showLift(mixture, liftOf(diagnostics, mixture));
  const guardrails = guardrailSummary(diagnostics);
  show("fig-guardrails", guardrails.total === 0 ? "none" : !guardrails.known ? "no data"
    : badge(guardrailVerdict(guardrails), guardrails.violated.length ? "bad" : "ok"));
  const { srm } = diagnostics;
  const srmKnown = srm.p_value !== null;
  show("fig-srm", !srmKnown ? "no data" : srm.ok ? badge("ok", "ok") : badge("mismatch", "bad"));
  const observations = observationsTotal(rounds);
  show("fig-observations", observations === 0 ? "none yet" : formatInteger(observations));
  show("fig-late", diagnostics.late_observations === 0 ? "none" : formatInteger(diagnostics.late_observations));
  const srmReason = hasData(diagnostics) ? "not enough arms served" : "no units observed yet";
  show("fig-srm-p", ...(srmKnown ? [formatNumber(srm.p_value, 2)] : noData(srmReason)));
  // A unit on an arm of probability 0 is an outright mismatch: statistic infinite (null in JSON), p-value 0.
  show("fig-srm-stat", ...(!srmKnown ? noData(srmReason) : [srm.statistic === null ? "∞" : formatNumber(srm.statistic)]));
  document.title = `${experiment.name} · round ${experiment.round.index} · pasto`;
}

// --- refresh ------------------------------------------------------------------------------------

let latest = null;

// The time range: the charts draw the last N rounds only, so thousands of rounds stay quick to draw
// and to read; totals (observations per arm, cumulative regret) still count every round.
const rangeSelect = document.getElementById("round-range");
rangeSelect.addEventListener("change", () => render());

function shownRounds(rounds) {
  const limit = rangeSelect.value === "all" ? rounds.length : Number(rangeSelect.value);
  const shown = rounds.slice(-limit);
  document.getElementById("round-range-note").textContent = shown.length < rounds.length
    ? `(rounds ${formatInteger(shown[0].index)}–${formatInteger(shown[shown.length - 1].index)} of ${formatInteger(rounds.length)})`
    : "";
  return shown;
}

function drawEventNote(shownMarkers) {
  document.getElementById("event-note").textContent = shownMarkers.length
    ? `Marked on the charts: ${shownMarkers.map((marker) => `round ${formatInteger(marker.round)} ${marker.label}`).join("; ")}.`
    : "";
}

function render() {
  if (!latest) return;
  const { experiment, rounds, diagnostics, events } = latest;
  const shown = shownRounds(rounds);
  markers = eventMarkers(events, shown);
  drawEventNote(markers);
  const colourOf = drawMixture(experiment, shown);
  drawDeployed(experiment, colourOf);
  drawObjective(shown);
  drawRegret(shown, cumulativeRegret(rounds));
  drawGuardrails(experiment, shown, diagnostics);
  drawObservations(shown);
  drawArms(experiment, rounds, diagnostics, colourOf);
  drawSegments(experiment, diagnostics);
  drawFigures(experiment, rounds, diagnostics);
  // Charts over rounds have nothing to draw before the first round's update: say so instead of a blank.
  for (const id of ["mixture-empty", "objective-empty", "regret-empty"]) {
    document.getElementById(id).hidden = experiment.applied_rounds > 0;
  }
  // Tells a reader (and the browser test) which response the page shows.
  document.getElementById("experiment").dataset.rounds = String(rounds.length);
  document.getElementById("experiment").dataset.summarised = String(Boolean(experiment.arm_summary));
  document.getElementById("experiment").dataset.arms = String(armCount(experiment));
}

// The round history, fetched incrementally: a round whose update has run and whose summary is
// stored (applied_at and best_mixture set) changes only when a late observation arrives for it, so
// a poll re-reads from the first round that is not final yet, or everything when the experiment's
// count of late observations moved. The server pages the history: follow next_since to the end.
let history = { rounds: [], late: null };

// `onPage(rounds so far)` after each page but the last: a long history's first read (at K = 10,000,
// 1,000 rounds are 50 pages) is drawn as it arrives instead of after the last page.
async function roundsFrom(since, onPage = null) {
  const rounds = [];
  let cursor = since;
  while (cursor !== null && cursor !== undefined) {
    const page = await apiGet(`${path}/rounds?since=${cursor}&arms=${SUMMARY_ARMS}`);
    // A summarised page: its rounds' arrays hold the arms of page.arm_summary (alignToExperiment).
    const armPositions = page.arm_summary?.arms ?? null;
    rounds.push(...(armPositions ? page.rounds.map((round) => ({ ...round, armPositions })) : page.rounds));
    cursor = page.next_since;
    if (onPage && cursor !== null && cursor !== undefined) onPage(rounds);
  }
  return rounds;
}

// The experiment's events (pauses, restarts, ...), fetched incrementally: events never change, so a
// poll asks only for those after the last one it has, following next_since to the end.
let events = [];

async function eventsAfter(known) {
  const fresh = [];
  let cursor = known.length ? known[known.length - 1].id + 1 : 0;
  while (cursor !== null && cursor !== undefined) {
    const page = await apiGet(`${path}/events?since=${cursor}`);
    fresh.push(...page.events);
    cursor = page.next_since;
  }
  return known.concat(fresh);
}

async function refresh() {
  const [experiment, diagnosticsRead, allEvents] = await Promise.all([
    apiGet(`${path}?arms=${SUMMARY_ARMS}`), apiGet(`${path}/diagnostics?arms=${SUMMARY_ARMS}`), eventsAfter(events)]);
  events = allEvents;
  let since = history.rounds.findIndex((entry) => entry.applied_at === null || entry.best_mixture === null);
  if (since < 0) since = history.rounds.length;
  if (diagnosticsRead.late_observations !== history.late) since = 0;
  const known = history.rounds.slice(0, since);
  // A round that closed after the experiment was read is left for the next poll: the history is
  // read after the experiment, and drawing it would put the charts one round ahead of the Round card
  // (a paired suite run saw 34 rounds charted beside "32 in progress").
  const upToExperiment = (rounds) => rounds.filter((round) => round.index <= experiment.round.index);
  const draw = (read) => {
    const { diagnostics, rounds } = alignToExperiment(experiment, diagnosticsRead, read);
    latest = { experiment, rounds, diagnostics, events };
    render();
  };
  const fresh = await roundsFrom(since, (partial) => {
    draw(upToExperiment(known.concat(partial)));
    document.getElementById("refresh-state").textContent =
      `Reading the history: ${formatInteger(known.length + partial.length)} of ${formatInteger(experiment.round.index + 1)} rounds…`;
  });
  const read = upToExperiment(known.concat(fresh));
  history = { rounds: read, late: diagnosticsRead.late_observations };
  draw(read);
}

poll(refresh);
