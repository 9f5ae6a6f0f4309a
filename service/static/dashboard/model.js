// Pure functions from API responses (docs/api.md) to what the pages draw. No DOM, no charts: the
// shapes of the JSON API are read here and nowhere else.

const Z_95 = 1.959963984540054;

// { metric: weight } of the objective's linear part.
export function primaryWeights(experiment) {
  const primary = experiment.objective.primary;
  return typeof primary === "string" ? { [primary]: 1 } : primary;
}

export function primaryLabel(experiment) {
  const weights = primaryWeights(experiment);
  return Object.entries(weights)
    .map(([metric, weight]) => (weight === 1 ? metric : `${weight}·${metric}`))
    .join(" + ");
}

// Per arm: estimated mean and 95% interval of each metric, from the diagnostics' current estimate.
export function armEstimates(experiment, diagnostics) {
  const { means, standard_errors: errors } = diagnostics.estimate;
  return Object.fromEntries(experiment.metrics.map((metric) => [metric, experiment.arms.map((_, arm) => {
    const mean = means[metric][arm];
    const error = errors[metric][arm];
    return {
      mean,
      interval: mean === null || error === null ? null : [mean - Z_95 * error, mean + Z_95 * error],
    };
  })]));
}

// Whether any unit has been observed: before that, estimates are the estimator's fallback values.
export function hasData(diagnostics) {
  return diagnostics.units.some((count) => count > 0);
}

// The primary metric under a mixture, with a 95% interval treating arms' estimates as independent;
// null before any data.
export function primaryEstimate(experiment, diagnostics, probabilities) {
  if (!hasData(diagnostics)) return null;
  let estimate = 0;
  let variance = 0;
  for (const [metric, weight] of Object.entries(primaryWeights(experiment))) {
    const means = diagnostics.estimate.means[metric];
    const errors = diagnostics.estimate.standard_errors[metric];
    for (let arm = 0; arm < probabilities.length; arm += 1) {
      if (probabilities[arm] === 0) continue;
      if (means[arm] === null) return null;
      estimate += weight * probabilities[arm] * means[arm];
      variance = errors[arm] === null || variance === null ? null : variance + (weight * probabilities[arm] * errors[arm]) ** 2;
    }
  }
  const half = variance === null ? null : Z_95 * Math.sqrt(variance);
  return { estimate, interval: half === null ? null : [estimate - half, estimate + half] };
}

// Guardrails broken on the point estimate by the traffic being served (exploration included: what
// users get) and by the deployed mixture; `violated` is every metric broken by either.
export function guardrailSummary(diagnostics) {
  const deployed = diagnostics.guardrails_deployed ?? diagnostics.guardrails;
  const served = diagnostics.guardrails_served ?? [];
  const broken = (reports) => reports.filter((guardrail) => guardrail.holds === false).map((guardrail) => guardrail.metric);
  const violatedServed = broken(served);
  const violatedDeployed = broken(deployed);
  return {
    total: deployed.length,
    known: hasData(diagnostics),
    violatedServed,
    violatedDeployed,
    violated: [...new Set([...violatedServed, ...violatedDeployed])],
  };
}

// The words of a guardrail summary's badge: which guardrails are broken and by which mixture.
export function guardrailVerdict(summary) {
  if (summary.violated.length === 0) return `${summary.total} OK (served and deployed)`;
  const by = (metric) => [summary.violatedServed.includes(metric) ? "served" : null,
    summary.violatedDeployed.includes(metric) ? "deployed" : null].filter(Boolean).join(" and ");
  return `${summary.violated.length} of ${summary.total} violated: ${summary.violated.map((metric) => `${metric} (${by(metric)})`).join(", ")}`;
}

// Indices of the `count` arms with the largest probabilities, largest first; all of them when at most
// one arm would be left over (an "other" band of one arm hides its name for nothing).
export function topArms(probabilities, count) {
  const order = probabilities.map((_, arm) => arm).sort((a, b) => probabilities[b] - probabilities[a] || a - b);
  return order.length <= count + 1 ? order : order.slice(0, count);
}

function sumOf(values, indices) {
  return indices.reduce((sum, index) => sum + values[index], 0);
}

// Stacked-area series of p_t: the top arms by current probability, then "other".
export function mixtureSeries(experiment, rounds, count) {
  const top = topArms(experiment.probabilities, count);
  const series = top.map((arm) => ({
    arm, label: experiment.arms[arm].name, data: rounds.map((round) => round.probabilities[arm]),
  }));
  const rest = experiment.arms.length - top.length;
  if (rest > 0) {
    series.push({
      arm: null,
      label: `other (${rest} arms)`,
      data: rounds.map((round) => Math.max(0, 1 - sumOf(round.probabilities, top))),
    });
  }
  return series;
}

export function deployedBars(experiment, count) {
  const top = topArms(experiment.deployed, count);
  const bars = top.map((arm) => ({ arm, label: experiment.arms[arm].name, value: experiment.deployed[arm] }));
  const rest = experiment.arms.length - top.length;
  if (rest > 0) {
    bars.push({ arm: null, label: `other (${rest})`, value: Math.max(0, 1 - sumOf(experiment.deployed, top)) });
  }
  return bars;
}

// Per round, on the estimate right after that round's update (null until the update has run).
export function objectiveSeries(rounds) {
  return {
    served: rounds.map((round) => round.objective),
    deployed: rounds.map((round) => round.objective_deployed),
    bestSingle: rounds.map((round) => round.best_single?.value ?? null),
    bestMixture: rounds.map((round) => round.best_mixture),
  };
}

export function cumulativeRegret(rounds) {
  let total = 0;
  return rounds.map((round) => {
    if (round.regret === null || round.regret === undefined) return null;
    total += round.regret;
    return total;
  });
}

// One entry per guardrail of the objective: per-round estimate, interval and threshold (the
// threshold moves over rounds when it is relative to a baseline arm), and the current report.
export function guardrailSeries(experiment, rounds, diagnostics) {
  return experiment.objective.guardrails.map((spec, position) => {
    // Reports are in the objective's guardrail order (a metric may carry two thresholds).
    const perRound = rounds.map((round) => round.guardrails?.[position] ?? null);
    return {
      metric: spec.metric,
      spec,
      current: diagnostics.guardrails[position] ?? null,
      served: diagnostics.guardrails_served?.[position] ?? null,
      estimate: perRound.map((entry) => entry?.estimate ?? null),
      lower: perRound.map((entry) => entry?.interval?.[0] ?? null),
      upper: perRound.map((entry) => entry?.interval?.[1] ?? null),
      threshold: perRound.map((entry) => entry?.threshold ?? null),
    };
  });
}

// Observations per round, split into those that arrived before the round's update and late ones;
// the round still being served (not closed) is its own series: its count so far is not a finished
// round's traffic, and drawn like one it reads as a drop.
export function observationsSeries(rounds) {
  const totals = rounds.map((round) => round.counts.reduce((sum, count) => sum + count, 0));
  const open = rounds.map((round) => round.closed_at === null);
  return {
    onTime: totals.map((total, position) => (open[position] ? null : total - rounds[position].late_observations)),
    late: rounds.map((round, position) => (open[position] ? null : round.late_observations)),
    inProgress: totals.map((total, position) => (open[position] ? total : null)),
  };
}

// Observations per arm over every round.
export function armSamples(experiment, rounds) {
  const samples = experiment.arms.map(() => 0);
  for (const round of rounds) round.counts.forEach((count, arm) => { samples[arm] += count; });
  return samples;
}

// What each event kind is called on the charts (GET .../events; "created" is where the axis starts,
// so it is not marked).
const EVENT_NAMES = {
  paused: "paused", resumed: "resumed", stopped: "stopped", controller_started: "controller restarted",
};

// Markers for the round axis: one per round with events, in round order, for the rounds shown.
// Each: { round, label: "paused, resumed", description: "Round 4: paused at 10:02:11 UTC; ..." }.
export function eventMarkers(events, rounds) {
  if (!rounds.length) return [];
  const first = rounds[0].index;
  const last = rounds[rounds.length - 1].index;
  const byRound = new Map();
  for (const event of events) {
    const name = EVENT_NAMES[event.kind];
    if (!name || event.round < first || event.round > last) continue;
    if (!byRound.has(event.round)) byRound.set(event.round, []);
    byRound.get(event.round).push({ name, at: event.at });
  }
  return [...byRound.entries()].sort(([a], [b]) => a - b).map(([round, happened]) => ({
    round,
    label: [...new Set(happened.map((entry) => entry.name))].join(", "),
    description: `Round ${round}: ${happened.map((entry) => `${entry.name} at ${entry.at.replace("T", " ").replace(/\.\d+/, "").replace("Z", " UTC")}`).join("; ")}`,
  }));
}
