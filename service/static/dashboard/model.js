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
  return diagnostics.units.some((count) => count > 0) || (diagnostics.rest?.units ?? 0) > 0;
}

// K: every arm of the experiment, those a summarised response (?arms=N) left out included.
export function armCount(experiment) {
  return experiment.arms.length + (experiment.rest?.arms ?? 0);
}

const total = (values) => values.reduce((sum, value) => sum + value, 0);
const sameArms = (from, to) => from.length === to.length && from.every((position, k) => position === to[k]);

// `values` aligned with the arm positions `from`, realigned with the positions `to`: an arm `from`
// does not hold gets `fill`.
function realign(values, from, to, fill) {
  if (sameArms(from, to)) return values;
  const at = new Map(from.map((position, k) => [position, k]));
  return to.map((position) => (at.has(position) ? values[at.get(position)] : fill));
}

// Summarised responses (docs/api.md, "?arms=N") in one frame of arms: the experiment's kept arms.
// The diagnostics and each round were summarised on the arms of largest max(p_t, deployed) when
// they were read, which can be another set (the mixture moves every round, and a round is read once):
// their arrays are realigned to the experiment's arms, an arm they left out counting 0, and each
// round's rest recomputed so that kept arms plus rest is still the round's whole. Each round carries
// `armPositions`, its page's arm_summary.arms (set by the page). Unsummarised responses pass as they are.
export function alignToExperiment(experiment, diagnostics, rounds) {
  if (!experiment.arm_summary) return { diagnostics, rounds };
  const to = experiment.arm_summary.arms;
  const alignedRounds = rounds.map((round) => {
    if (!round.armPositions) return round;
    const probabilities = realign(round.probabilities, round.armPositions, to, 0);
    const counts = realign(round.counts, round.armPositions, to, 0);
    if (probabilities === round.probabilities && counts === round.counts) return round;
    return {
      ...round, probabilities, counts,
      rest: {
        ...round.rest,
        probabilities: total(round.probabilities) + round.rest.probabilities - total(probabilities),
        counts: total(round.counts) + round.rest.counts - total(counts),
      },
    };
  });
  const from = diagnostics.arm_summary?.arms;
  if (!from || sameArms(from, to)) return { diagnostics, rounds: alignedRounds };
  const perMetric = (arrays) => Object.fromEntries(Object.entries(arrays).map(([metric, values]) => [metric, realign(values, from, to, null)]));
  const units = realign(diagnostics.units, from, to, 0);
  const segments = diagnostics.segments && {
    ...diagnostics.segments,
    segments: diagnostics.segments.segments.map((segment) => ({
      ...segment, probabilities: realign(segment.probabilities, from, to, 0), deployed: realign(segment.deployed, from, to, 0),
    })),
  };
  return {
    rounds: alignedRounds,
    diagnostics: {
      ...diagnostics,
      units,
      estimate: { means: perMetric(diagnostics.estimate.means), standard_errors: perMetric(diagnostics.estimate.standard_errors) },
      ...(segments ? { segments } : {}),
      // The rest's deployed sums are over the arms the diagnostics left out, not the experiment's:
      // the deployed mixture's estimate is unknown for this poll (the next one reads both anew).
      rest: { ...diagnostics.rest, units: total(diagnostics.units) + diagnostics.rest.units - total(units), deployed_means: null, deployed_variances: null },
    },
  };
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
    // A summarised response: the arms left out, summed by the server under the deployed mixture.
    if (diagnostics.rest) {
      const rest = diagnostics.rest;
      if (probabilities !== experiment.deployed || !rest.deployed_means || rest.deployed_means[metric] === null) return null;
      estimate += weight * rest.deployed_means[metric];
      const restVariance = rest.deployed_variances[metric];
      variance = restVariance === null || variance === null ? null : variance + weight ** 2 * restVariance;
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
// Ties go by arm position: `positions` maps an index of a summarised response's arrays to its arm's
// position (experiment.arm_summary.arms), so a tie is broken as in the full response.
export function topArms(probabilities, count, positions = null) {
  const position = positions ? (index) => positions[index] : (index) => index;
  const order = probabilities.map((_, arm) => arm).sort((a, b) => probabilities[b] - probabilities[a] || position(a) - position(b));
  return order.length <= count + 1 ? order : order.slice(0, count);
}

// The arms a chart names for `weights` (K,): topArms, and when not every arm gets a name, only arms of
// positive weight (an arm of weight 0 goes to "other": a 0 picked by arm position says nothing, and a
// summarised response need not keep the zero-weight arms the full one would pick).
function namedArms(experiment, weights, count) {
  const ranked = topArms(weights, count, experiment.arm_summary?.arms);
  return ranked.length < armCount(experiment) ? ranked.filter((arm) => weights[arm] > 0) : ranked;
}

function sumOf(values, indices) {
  return indices.reduce((sum, index) => sum + values[index], 0);
}

// Stacked-area series of p_t: the top arms by current probability (namedArms), then "other".
export function mixtureSeries(experiment, rounds, count) {
  const top = namedArms(experiment, experiment.probabilities, count);
  const series = top.map((arm) => ({
    arm, label: experiment.arms[arm].name, data: rounds.map((round) => round.probabilities[arm]),
  }));
  const rest = armCount(experiment) - top.length;
  if (rest > 0) {
    series.push({
      arm: null,
      label: `other (${rest} arms)`,
      data: rounds.map((round) => Math.max(0, 1 - sumOf(round.probabilities, top))),
    });
  }
  return series;
}

// The deployed mixture's largest arms (namedArms), at most `count`, then "other" for the remaining arms.
export function deployedBars(experiment, count) {
  const top = namedArms(experiment, experiment.deployed, count);
  const bars = top.map((arm) => ({ arm, label: experiment.arms[arm].name, value: experiment.deployed[arm] }));
  const rest = armCount(experiment) - top.length;
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

// The objective chart's y-range: from the lines that must be told apart (deployed mixture, best
// mixture, best single arm), padded by a tenth of their spread, not from the served line, whose
// exploration rounds can dip far below and would squash the others into one line. `clipped` lists
// the positions of the served values outside the range (drawn as markers on its edge).
export function objectiveRange(series) {
  const values = [...series.deployed, ...series.bestSingle, ...series.bestMixture].filter(Number.isFinite);
  if (!values.length) return null;
  const low = values.reduce((a, b) => Math.min(a, b));
  const high = values.reduce((a, b) => Math.max(a, b));
  const pad = (high - low) / 10 || Math.abs(high) / 20 || 1;
  const range = { min: low - pad, max: high + pad };
  range.clipped = series.served.flatMap((value, position) =>
    Number.isFinite(value) && (value < range.min || value > range.max) ? [position] : []);
  return range;
}

// The lift of `mixture` ("served" or "deployed") on the primary metric over the baseline arm, from
// diagnostics: null when the objective has no baseline arm.
export function liftOf(diagnostics, mixture) {
  const lift = diagnostics.lift;
  return lift ? { baseline: lift.baseline, ...lift[mixture].primary } : null;
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
  const totals = rounds.map(roundObservations);
  const open = rounds.map((round) => round.closed_at === null);
  return {
    onTime: totals.map((total, position) => (open[position] ? null : total - rounds[position].late_observations)),
    late: rounds.map((round, position) => (open[position] ? null : round.late_observations)),
    inProgress: totals.map((total, position) => (open[position] ? total : null)),
  };
}

// A round's observations: every arm's, those a summarised round sums in its rest included.
export function roundObservations(round) {
  return total(round.counts) + (round.rest?.counts ?? 0);
}

// Observations over every round, of every arm.
export function observationsTotal(rounds) {
  return rounds.reduce((sum, round) => sum + roundObservations(round), 0);
}

// Observations per arm over every round (of a summarised history: over the rounds that kept the arm).
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
