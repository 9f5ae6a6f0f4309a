// One experiment: mixture, objective, guardrails, regret, arms and data health, refreshed by polling.
import {
  OTHER_COLOUR, PALETTE, apiGet, badge, element, formatInteger, formatNumber, formatPercent, poll, withAlpha,
} from "./pasto.js";
import {
  armEstimates, cumulativeRegret, deployedSeries, guardrailSeries, mixtureSeries, objectiveSeries,
  objectiveValues, observationsSeries,
} from "./model.js";

const name = document.getElementById("experiment").dataset.name;
const path = `/experiments/${encodeURIComponent(name)}`;
const TOP_ARMS = PALETTE.length - 1;
const TABLE_ROWS = 100;
const UNRANKED_COLOUR = "#5b6575";

Chart.defaults.font.family = getComputedStyle(document.documentElement).fontFamily;
Chart.defaults.color = "#5b6575";
Chart.defaults.animation = false;
Chart.defaults.maintainAspectRatio = false;
Chart.defaults.plugins.legend.labels.boxWidth = 12;
Chart.defaults.plugins.legend.labels.boxHeight = 12;

const charts = {};

function chart(id, config) {
  if (charts[id]) {
    charts[id].data = config.data;
    charts[id].update("none");
  } else {
    charts[id] = new Chart(document.getElementById(id), config);
  }
  return charts[id];
}

const roundAxis = (labels) => ({
  type: "linear",
  title: { display: true, text: "round" },
  min: labels.length ? labels[0] : 0,
  max: labels.length ? labels[labels.length - 1] : 1,
  ticks: { precision: 0, maxTicksLimit: 8 },
});

// Rounds as (x, y) points: a linear axis keeps the spacing honest if a round is ever missing.
const points = (labels, values) => labels.map((x, position) => ({ x, y: values[position] }));

const percentAxis = (extra = {}) => ({
  min: 0, max: 1, ticks: { callback: (value) => `${Math.round(value * 100)}%`, maxTicksLimit: 6 }, ...extra,
});

const boxLegend = { position: "bottom" };
// For line series: each dataset's `pointStyle` ("line", or "rect" for a band) is its legend sample,
// so a dashed line appears dashed; a box cannot show that.
const lineLegend = { position: "bottom", labels: { usePointStyle: true, pointStyleWidth: 24 } };

// --- panels -------------------------------------------------------------------------------------

function colourMap(series) {
  const colours = new Map();
  series.forEach((entry, position) => {
    colours.set(entry.arm, entry.arm === null ? OTHER_COLOUR : PALETTE[position % PALETTE.length]);
  });
  return (arm) => colours.get(arm) ?? UNRANKED_COLOUR;
}

function drawMixture(experiment, rounds, labels) {
  const series = mixtureSeries(experiment, rounds, TOP_ARMS);
  const colourOf = colourMap(series);
  chart("chart-mixture", {
    type: "line",
    data: {
      datasets: series.map((entry, position) => ({
        label: entry.label,
        data: points(labels, entry.data),
        borderColor: colourOf(entry.arm),
        backgroundColor: withAlpha(colourOf(entry.arm), 0.55),
        borderWidth: 1,
        fill: position === 0 ? "origin" : "-1",
        pointRadius: 0,
        tension: 0,
      })),
    },
    options: {
      interaction: { mode: "index", intersect: false },
      scales: { x: roundAxis(labels), y: percentAxis({ stacked: true, title: { display: true, text: "probability" } }) },
      plugins: {
        legend: boxLegend,
        tooltip: { callbacks: { label: (item) => `${item.dataset.label}: ${formatPercent(item.parsed.y)}` } },
      },
    },
  });
  return colourOf;
}

function drawDeployed(experiment, colourOf) {
  const bars = deployedSeries(experiment, TOP_ARMS);
  chart("chart-deployed", {
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
      scales: { x: percentAxis(), y: { ticks: { autoSkip: false } } },
      plugins: {
        legend: { display: false },
        tooltip: { callbacks: { label: (item) => formatPercent(item.parsed.x) } },
      },
    },
  });
}

const OBJECTIVE_STYLE = {
  served: { colour: "#0072B2", dash: [] },
  deployed: { colour: "#009E73", dash: [] },
  best_single: { colour: "#D55E00", dash: [6, 4] },
};

function drawObjective(rounds, labels, diagnostics) {
  const series = objectiveSeries(rounds);
  const datasets = series.map((entry) => ({
    label: entry.label,
    data: points(labels, entry.data),
    borderColor: OBJECTIVE_STYLE[entry.key].colour,
    backgroundColor: OBJECTIVE_STYLE[entry.key].colour,
    borderDash: OBJECTIVE_STYLE[entry.key].dash,
    borderWidth: 2,
    pointRadius: 0,
    pointStyle: "line",
    spanGaps: true,
  }));
  // Without a per-round history of the best single arm, show today's estimate as a reference line.
  const bestSingle = diagnostics?.best_single?.objective;
  if (!series.some((entry) => entry.key === "best_single") && typeof bestSingle === "number" && labels.length) {
    datasets.push({
      label: "best single arm (current estimate)",
      data: [{ x: labels[0], y: bestSingle }, { x: labels[labels.length - 1], y: bestSingle }],
      borderColor: OBJECTIVE_STYLE.best_single.colour,
      backgroundColor: OBJECTIVE_STYLE.best_single.colour,
      borderDash: OBJECTIVE_STYLE.best_single.dash,
      borderWidth: 2,
      pointRadius: 0,
      pointStyle: "line",
    });
  }
  chart("chart-objective", {
    type: "line",
    data: { datasets },
    options: {
      interaction: { mode: "index", intersect: false },
      scales: { x: roundAxis(labels), y: { title: { display: true, text: "f(V p)" } } },
      plugins: {
        legend: lineLegend,
        tooltip: { callbacks: { label: (item) => `${item.dataset.label}: ${formatNumber(item.parsed.y)}` } },
      },
    },
  });
}

function drawRegret(rounds, labels) {
  chart("chart-regret", {
    type: "line",
    data: {
      datasets: [{
        label: "cumulative regret",
        data: points(labels, cumulativeRegret(rounds)),
        borderColor: "#CC79A7",
        backgroundColor: withAlpha("#CC79A7", 0.15),
        fill: "origin",
        borderWidth: 2,
        pointRadius: 0,
        spanGaps: true,
      }],
    },
    options: {
      interaction: { mode: "index", intersect: false },
      scales: { x: roundAxis(labels), y: { beginAtZero: true } },
      plugins: {
        legend: { display: false },
        tooltip: { callbacks: { label: (item) => `regret so far: ${formatNumber(item.parsed.y)}` } },
      },
    },
  });
}

function guardrailTitle(entry) {
  const current = entry.current;
  const relation = entry.spec.relative_to
    ? `≥ ${entry.spec.relative_to} × (1 ${entry.spec.threshold < 0 ? "−" : "+"} ${formatPercent(Math.abs(entry.spec.threshold))})`
    : `≥ ${formatNumber(entry.spec.threshold)}`;
  const status = !current || current.estimate === null || current.estimate === undefined
    ? badge("no data", "")
    : current.holds ? badge("holds", "ok") : badge("violated", "bad");
  return element("h3", {}, `${entry.metric} ${relation}`, status);
}

function drawGuardrails(experiment, rounds, labels, diagnostics) {
  const container = document.getElementById("guardrail-panels");
  const series = guardrailSeries(experiment, rounds, diagnostics);
  document.getElementById("guardrails-empty").hidden = series.length > 0;
  if (container.children.length !== series.length) {
    container.replaceChildren(...series.map((_, position) => element(
      "div", { class: "guardrail", "data-guardrail": position },
      element("h3"),
      element("div", { class: "chart small" }, element("canvas", {
        id: `chart-guardrail-${position}`, role: "img", "aria-label": `Guardrail ${series[position].metric} over rounds`,
      })),
    )));
  }
  series.forEach((entry, position) => {
    const panel = container.children[position];
    panel.querySelector("h3").replaceWith(guardrailTitle(entry));
    chart(`chart-guardrail-${position}`, {
      type: "line",
      data: {
        datasets: [
          { label: "95% interval, low", data: points(labels, entry.lower), borderWidth: 0, pointRadius: 0, fill: false, borderColor: "transparent", spanGaps: true },
          { label: "95% interval", data: points(labels, entry.upper), borderWidth: 0, pointRadius: 0, fill: "-1", borderColor: "transparent", backgroundColor: withAlpha("#0072B2", 0.18), pointStyle: "rect", spanGaps: true },
          { label: "estimate", data: points(labels, entry.estimate), borderColor: "#0072B2", backgroundColor: "#0072B2", borderWidth: 2, pointRadius: 0, pointStyle: "line", spanGaps: true },
          { label: "threshold", data: points(labels, entry.threshold), borderColor: "#B3261E", backgroundColor: "#B3261E", borderDash: [6, 4], borderWidth: 2, pointRadius: 0, pointStyle: "line", spanGaps: true },
        ],
      },
      options: {
        interaction: { mode: "index", intersect: false },
        scales: { x: roundAxis(labels) },
        plugins: {
          legend: { ...lineLegend, labels: { ...lineLegend.labels, filter: (item) => item.text !== "95% interval, low" } },
          tooltip: {
            filter: (item) => item.dataset.label !== "95% interval, low",
            callbacks: { label: (item) => `${item.dataset.label}: ${formatNumber(item.parsed.y)}` },
          },
        },
      },
    });
  });
}

function drawObservations(rounds, labels) {
  const { onTime, late } = observationsSeries(rounds);
  chart("chart-observations", {
    type: "bar",
    data: {
      datasets: [
        { label: "observations", data: points(labels, onTime), backgroundColor: withAlpha("#0072B2", 0.75), stack: "n" },
        { label: "late", data: points(labels, late), backgroundColor: withAlpha("#E69F00", 0.9), stack: "n" },
      ],
    },
    options: {
      interaction: { mode: "index", intersect: false },
      scales: { x: { ...roundAxis(labels), type: "linear", offset: true, stacked: true }, y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } },
      plugins: { legend: boxLegend },
    },
  });
  return onTime.reduce((sum, count) => sum + count, 0);
}

// --- arms table ---------------------------------------------------------------------------------

const sortState = { key: "probability", direction: "descending" };
let showAllArms = false;

function armRows(experiment, rounds, diagnostics) {
  const estimates = armEstimates(experiment, diagnostics);
  const samples = estimates?.samples
    ?? experiment.arms.map((_, arm) => rounds.reduce((sum, round) => sum + (round.counts?.[arm] ?? 0), 0));
  return experiment.arms.map((arm, position) => ({
    position,
    name: arm.name,
    params: JSON.stringify(arm.params ?? {}),
    probability: experiment.probabilities[position],
    deployed: experiment.deployed[position],
    samples: samples[position],
    means: Object.fromEntries(experiment.metrics.map((metric) => [metric, {
      value: estimates?.metrics[metric].means[position] ?? null,
      interval: estimates?.metrics[metric].intervals[position] ?? null,
    }])),
  }));
}

function sortValue(row, key) {
  if (key.startsWith("mean:")) return row.means[key.slice(5)].value;
  return row[key];
}

function compareRows(a, b) {
  const left = sortValue(a, sortState.key);
  const right = sortValue(b, sortState.key);
  const sign = sortState.direction === "ascending" ? 1 : -1;
  if (left === right) return a.position - b.position;
  if (left === null || left === undefined) return 1; // missing values last in either direction
  if (right === null || right === undefined) return -1;
  return (typeof left === "string" ? left.localeCompare(right) : left - right) * sign;
}

function drawArms(experiment, rounds, diagnostics, colourOf) {
  const columns = [
    { key: "name", label: "Arm" },
    { key: "params", label: "Params" },
    { key: "probability", label: "p_t", numeric: true },
    { key: "deployed", label: "Deployed", numeric: true },
    { key: "samples", label: "Samples", numeric: true },
    ...experiment.metrics.map((metric) => ({ key: `mean:${metric}`, label: `${metric} mean`, numeric: true })),
  ];
  const head = document.getElementById("arms-head");
  head.replaceChildren(...columns.map((column) => {
    const button = element("button", { type: "button" }, column.label);
    button.addEventListener("click", () => {
      sortState.direction = sortState.key === column.key && sortState.direction === "descending" ? "ascending" : "descending";
      if (sortState.key !== column.key) sortState.direction = column.numeric ? "descending" : "ascending";
      sortState.key = column.key;
      render();
    });
    return element("th", {
      scope: "col", class: column.numeric ? "num" : null,
      "aria-sort": sortState.key === column.key ? sortState.direction : "none", dataset: { key: column.key },
    }, button);
  }));

  const rows = armRows(experiment, rounds, diagnostics).sort(compareRows);
  const shown = showAllArms ? rows : rows.slice(0, TABLE_ROWS);
  document.getElementById("arms-body").replaceChildren(...shown.map((row) => element(
    "tr", { dataset: { arm: row.name } },
    element("td", { class: "arm-name" }, element("span", { class: "swatch", style: `background:${colourOf(row.position)}` }), row.name),
    element("td", { class: "params" }, row.params),
    element("td", { class: "num" }, formatPercent(row.probability)),
    element("td", { class: "num" }, formatPercent(row.deployed)),
    element("td", { class: "num" }, formatInteger(row.samples)),
    ...experiment.metrics.map((metric) => {
      const { value, interval } = row.means[metric];
      return element("td", { class: "num" }, formatNumber(value),
        interval ? element("span", { class: "interval" }, `[${formatNumber(interval[0])}, ${formatNumber(interval[1])}]`) : null);
    }),
  )));
  const note = document.getElementById("arms-note");
  note.hidden = rows.length <= TABLE_ROWS;
  document.getElementById("arms-show-all").textContent = showAllArms
    ? `Show the first ${TABLE_ROWS} only` : `Show all ${rows.length} arms (${TABLE_ROWS} shown)`;
}

document.getElementById("arms-show-all").addEventListener("click", () => {
  showAllArms = !showAllArms;
  if (latest) render();
});

// --- summary ------------------------------------------------------------------------------------

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function setNode(id, ...nodes) {
  document.getElementById(id).replaceChildren(...nodes);
}

function drawSummary(experiment, diagnostics, totalObservations) {
  const status = document.getElementById("status-badge");
  status.textContent = experiment.status;
  status.className = `badge ${experiment.status}`;
  setText("fig-round", formatInteger(experiment.round?.index));
  const objective = objectiveValues(diagnostics);
  setText("fig-objective", formatNumber(objective.served));
  setText("fig-deployed", formatNumber(objective.deployed));
  const bestSingle = diagnostics?.best_single;
  const bestArm = bestSingle && Number.isInteger(bestSingle.arm) ? experiment.arms[bestSingle.arm]?.name : bestSingle?.arm;
  setText("fig-best-single", bestSingle ? `${formatNumber(bestSingle.objective)}${bestArm ? ` (${bestArm})` : ""}` : "–");
  const bestMixture = diagnostics?.best_mixture?.objective;
  const gain = diagnostics?.best_mixture?.gain ?? (typeof bestMixture === "number" && bestSingle ? bestMixture - bestSingle.objective : null);
  setText("fig-gain", formatNumber(gain));
  const guardrails = diagnostics?.guardrails ?? [];
  const violated = guardrails.filter((guardrail) => guardrail.holds === false);
  setNode("fig-guardrails", guardrails.length === 0 ? "none"
    : violated.length ? badge(`${violated.length} of ${guardrails.length} violated`, "bad") : badge(`${guardrails.length} OK`, "ok"));
  const srm = diagnostics?.srm;
  const srmKnown = srm && typeof srm.p_value === "number";
  setNode("fig-srm", !srmKnown ? "no data" : srm.ok ? badge("ok", "ok") : badge("mismatch", "bad"));
  setText("fig-observations", formatInteger(totalObservations));
  setText("fig-late", formatInteger(diagnostics?.late_observations));
  setText("fig-srm-p", srmKnown ? formatNumber(srm.p_value, 2) : "–");
  setText("fig-srm-stat", srmKnown ? formatNumber(srm.statistic) : "–");
  document.title = `${experiment.name} · round ${experiment.round?.index ?? "–"} · pasto`;
}

// --- refresh ------------------------------------------------------------------------------------

let latest = null;

function render() {
  const { experiment, rounds, diagnostics } = latest;
  const labels = rounds.map((round) => round.index);
  const colourOf = drawMixture(experiment, rounds, labels);
  drawDeployed(experiment, colourOf);
  drawObjective(rounds, labels, diagnostics);
  drawRegret(rounds, labels);
  drawGuardrails(experiment, rounds, labels, diagnostics);
  const totalObservations = drawObservations(rounds, labels);
  drawArms(experiment, rounds, diagnostics, colourOf);
  drawSummary(experiment, diagnostics, totalObservations);
  // Lets a reader (and the browser test) tell when the page shows a given response.
  document.getElementById("experiment").dataset.rounds = String(rounds.length);
}

async function refresh() {
  const [experiment, roundsBody, diagnostics] = await Promise.all([
    apiGet(path), apiGet(`${path}/rounds`), apiGet(`${path}/diagnostics`),
  ]);
  latest = { experiment, rounds: roundsBody.rounds, diagnostics };
  render();
}

poll(refresh);
