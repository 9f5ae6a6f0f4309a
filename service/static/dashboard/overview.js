// The experiments list: one row per experiment, refreshed by polling.
import {
  apiGet, badge, config, element, formatAge, formatInteger, formatNumber, poll,
} from "./pasto.js";
import { guardrailSummary, lastUpdate, primaryEstimate, primaryMetricName } from "./model.js";

const body = document.getElementById("experiments-body");

function cell(label, ...children) {
  return element("td", { "data-label": label }, ...children);
}

function row(experiment, diagnostics) {
  const link = element("a", { href: config.experimentPage.replace("__name__", encodeURIComponent(experiment.name)) }, experiment.name);
  const primary = primaryEstimate(experiment, diagnostics);
  const primaryText = primary
    ? `${primaryMetricName(experiment)} ${formatNumber(primary.estimate)}${primary.interval ? ` [${formatNumber(primary.interval[0])}, ${formatNumber(primary.interval[1])}]` : ""}`
    : "–";
  const guardrails = guardrailSummary(diagnostics);
  const srm = diagnostics?.srm;
  const srmBadge = !srm || srm.p_value === null || srm.p_value === undefined
    ? badge("no data", "")
    : srm.ok ? badge(`ok · p=${formatNumber(srm.p_value, 2)}`, "ok") : badge(`mismatch · p=${formatNumber(srm.p_value, 2)}`, "bad");
  const updated = lastUpdate(experiment);
  return element(
    "tr", { dataset: { experiment: experiment.name } },
    element("td", { class: "title", "data-label": "Experiment" }, link),
    cell("Status", badge(experiment.status, experiment.status)),
    element("td", { class: "num", "data-label": "Round" }, formatInteger(experiment.round?.index)),
    cell("Primary metric", primaryText),
    cell("Guardrails", guardrails.total === 0 ? "none" : guardrails.violated.length === 0
      ? badge(`${guardrails.total} OK`, "ok")
      : badge(`${guardrails.violated.length} violated: ${guardrails.violated.join(", ")}`, "bad")),
    cell("Traffic split (SRM)", srmBadge),
    element("td", { "data-label": "Last update", title: updated ?? "" }, formatAge(updated)),
  );
}

async function refresh() {
  const { experiments } = await apiGet("/experiments");
  const diagnostics = await Promise.all(experiments.map(
    (experiment) => apiGet(`/experiments/${encodeURIComponent(experiment.name)}/diagnostics`),
  ));
  if (experiments.length === 0) {
    body.replaceChildren(element("tr", { class: "placeholder" }, element("td", { colspan: 7 }, "No experiments yet.")));
    return;
  }
  body.replaceChildren(...experiments.map((experiment, index) => row(experiment, diagnostics[index])));
}

poll(refresh);
