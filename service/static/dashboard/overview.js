// The experiments list: one row per experiment, refreshed by polling.
import {
  apiGet, badge, config, element, formatAge, formatInteger, formatNumber, poll,
} from "./pasto.js";
import { guardrailSummary, guardrailVerdict, primaryEstimate, primaryLabel } from "./model.js";

const body = document.getElementById("experiments-body");

function cell(label, ...children) {
  return element("td", { "data-label": label }, ...children);
}

function row(experiment, diagnostics) {
  const link = element("a", { href: config.experimentPage.replace("__name__", encodeURIComponent(experiment.name)) }, experiment.name);
  const primary = primaryEstimate(experiment, diagnostics, experiment.deployed);
  const primaryText = primary === null ? "no data" : `${primaryLabel(experiment)} ${formatNumber(primary.estimate)}${
    primary.interval ? ` ± ${formatNumber((primary.interval[1] - primary.interval[0]) / 2, 2)}` : ""}`;
  const guardrails = guardrailSummary(diagnostics);
  const { srm } = diagnostics;
  const srmBadge = srm.p_value === null ? badge("no data", "")
    : badge(`${srm.ok ? "ok" : "mismatch"} · p=${formatNumber(srm.p_value, 2)}`, srm.ok ? "ok" : "bad");
  const updated = experiment.updated_at;
  return element(
    "tr", { dataset: { experiment: experiment.name } },
    element("td", { class: "title", "data-label": "Experiment" }, link),
    cell("Status", badge(experiment.status, experiment.status),
      diagnostics.source_error ? badge("source failing", "bad") : ""),
    element("td", { class: "num", "data-label": "Round" }, formatInteger(experiment.round.index)),
    cell("Primary metric", primaryText),
    cell("Guardrails", guardrails.total === 0 ? "none" : !guardrails.known ? badge("no data", "")
      : badge(guardrailVerdict(guardrails), guardrails.violated.length ? "bad" : "ok")),
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
