// Pure functions from API responses to what the pages draw. No DOM, no charts: the shapes of the
// JSON API (docs/api.md) are read here and nowhere else.

export function primaryMetricName(experiment) {
  const primary = experiment.objective?.primary;
  if (typeof primary === "string") return primary;
  if (primary && typeof primary === "object") return Object.keys(primary).join(" + ");
  return experiment.metrics?.[0] ?? "primary";
}

function primaryWeights(experiment) {
  const primary = experiment.objective?.primary;
  if (typeof primary === "string") return { [primary]: 1 };
  if (primary && typeof primary === "object") return primary;
  return { [experiment.metrics[0]]: 1 };
}

// Per-arm current estimates: { metric: { means: [K], intervals: [[lo, hi] | null] } } and samples [K].
export function armEstimates(experiment, diagnostics) {
  const arms = diagnostics?.arms;
  if (!Array.isArray(arms) || arms.length !== experiment.arms.length) return null;
  const metrics = {};
  for (const metric of experiment.metrics) {
    metrics[metric] = {
      means: arms.map((arm) => arm.means?.[metric]?.estimate ?? null),
      intervals: arms.map((arm) => arm.means?.[metric]?.interval ?? null),
    };
  }
  return { samples: arms.map((arm) => arm.samples ?? null), metrics };
}

// The primary metric under the served mixture: from the diagnostics when given, else p_t . means.
export function primaryEstimate(experiment, diagnostics) {
  if (diagnostics?.primary && diagnostics.primary.estimate !== undefined) return diagnostics.primary;
  const estimates = armEstimates(experiment, diagnostics);
  if (!estimates) return null;
  let total = 0;
  for (const [metric, weight] of Object.entries(primaryWeights(experiment))) {
    const means = estimates.metrics[metric]?.means;
    if (!means || means.some((mean) => mean === null)) return null;
    total += weight * means.reduce((sum, mean, arm) => sum + mean * experiment.probabilities[arm], 0);
  }
  return { estimate: total, interval: null };
}

export function guardrailSummary(diagnostics) {
  const guardrails = diagnostics?.guardrails ?? [];
  return {
    total: guardrails.length,
    violated: guardrails.filter((guardrail) => guardrail.holds === false).map((guardrail) => guardrail.metric),
  };
}

// When the controller last changed the mixture: the close of the latest round.
export function lastUpdate(experiment) {
  return experiment.updated_at ?? (experiment.round?.index > 0 ? experiment.round.started_at : null);
}

export function objectiveValues(diagnostics) {
  const objective = diagnostics?.objective;
  if (objective === null || objective === undefined) return { served: null, deployed: null };
  if (typeof objective === "number") return { served: objective, deployed: null };
  return { served: objective.served ?? objective.current ?? null, deployed: objective.deployed ?? null };
}

// Indices of the `count` arms with the largest probabilities, largest first; everything when at most
// one arm would be left over (an "other" band of one arm hides its name for nothing).
export function topArms(probabilities, count) {
  const order = probabilities.map((_, arm) => arm).sort((a, b) => probabilities[b] - probabilities[a] || a - b);
  return order.length <= count + 1 ? order : order.slice(0, count);
}

export function mixtureSeries(experiment, rounds, count) {
  const top = topArms(experiment.probabilities, count);
  const series = top.map((arm) => ({
    arm,
    label: experiment.arms[arm].name,
    data: rounds.map((round) => round.probabilities[arm]),
  }));
  if (top.length < experiment.arms.length) {
    series.push({
      arm: null,
      label: `other (${experiment.arms.length - top.length} arms)`,
      data: rounds.map((round) => Math.max(0, 1 - top.reduce((sum, arm) => sum + round.probabilities[arm], 0))),
    });
  }
  return series;
}

export function deployedSeries(experiment, count) {
  const top = topArms(experiment.deployed, count);
  const bars = top.map((arm) => ({ arm, label: experiment.arms[arm].name, value: experiment.deployed[arm] }));
  if (top.length < experiment.arms.length) {
    bars.push({
      arm: null,
      label: `other (${experiment.arms.length - top.length})`,
      value: Math.max(0, 1 - top.reduce((sum, arm) => sum + experiment.deployed[arm], 0)),
    });
  }
  return bars;
}

function field(round, ...names) {
  for (const name of names) {
    const value = name.split(".").reduce((node, key) => (node === null || node === undefined ? undefined : node[key]), round);
    if (value !== undefined) return value;
  }
  return undefined;
}

// Objective per round: served p_t always; deployed and best single when the API reports them per round.
export function objectiveSeries(rounds) {
  const series = [{ key: "served", label: "served p_t", data: rounds.map((round) => field(round, "objective.served", "objective") ?? null) }];
  const deployed = rounds.map((round) => field(round, "objective_deployed", "objective.deployed") ?? null);
  if (deployed.some((value) => value !== null)) series.push({ key: "deployed", label: "deployed mixture", data: deployed });
  const single = rounds.map((round) => field(round, "objective_best_single", "best_single.objective") ?? null);
  if (single.some((value) => value !== null)) series.push({ key: "best_single", label: "best single arm", data: single });
  // Objects under "objective" would otherwise be drawn as NaN.
  for (const entry of series) entry.data = entry.data.map((value) => (typeof value === "number" ? value : null));
  return series;
}

export function cumulativeRegret(rounds) {
  let total = 0;
  return rounds.map((round) => {
    const regret = field(round, "regret");
    if (typeof regret !== "number") return null;
    total += regret;
    return total;
  });
}

// One entry per guardrail of the objective, with per-round estimate, interval and threshold.
export function guardrailSeries(experiment, rounds, diagnostics) {
  const specs = experiment.objective?.guardrails ?? [];
  return specs.map((spec, position) => {
    const perRound = rounds.map((round) => {
      // Aligned with the objective's guardrails (a metric may carry two thresholds).
      const entries = round.guardrails ?? [];
      return entries.length === specs.length ? entries[position] : null;
    });
    const currentEntries = diagnostics?.guardrails ?? [];
    const current = currentEntries.length === specs.length ? currentEntries[position] : null;
    return {
      metric: spec.metric,
      spec,
      current,
      estimate: perRound.map((entry) => entry?.estimate ?? null),
      lower: perRound.map((entry) => entry?.interval?.[0] ?? null),
      upper: perRound.map((entry) => entry?.interval?.[1] ?? null),
      threshold: perRound.map((entry) => entry?.threshold ?? current?.threshold ?? (spec.relative_to ? null : spec.threshold)),
    };
  });
}

export function observationsSeries(rounds) {
  return {
    onTime: rounds.map((round) => (round.counts ?? []).reduce((sum, count) => sum + count, 0)),
    late: rounds.map((round) => field(round, "late_observations", "late") ?? 0),
  };
}
