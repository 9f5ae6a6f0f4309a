// The golden vectors of the assignment contract (spec/assignment-vectors.json) against this package.
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import {
  FNV_OFFSET_BASIS, FNV_PRIME, HashConstants, Mixture, SegmentError, SegmentedMixtures, bucket, chooseArm,
  cumulativeProbabilities, fmix32, fnv1a32, hash, key,
} from "../src/assignment.js";

const VECTORS = process.env.PASTO_ASSIGNMENT_VECTORS
  ?? new URL("../../../../spec/assignment-vectors.json", import.meta.url);

interface MixtureSpec {
  probabilities?: number[];
  weights?: number[];
  rule?: "lcg" | "power2";
  k?: number; a?: number; c?: number; m?: number;
  sha256: string;
}

interface Case {
  seed: string; round: number; unit: string;
  mixture?: string; segments?: string; segment?: string | null;
  fnv?: number; hash?: number; bucket?: number; arm?: number; probability?: number;
  served_segment?: string; error?: string;
}

interface Vectors {
  format: string;
  mixtures: Record<string, MixtureSpec>;
  segment_sets: Record<string, { open: boolean; names: string[]; mixtures: Record<string, string> }>;
  cases: Case[];
}

// Seeds reach 2^63 - 1, beyond a double's 53 bits: read them as the decimal text they are.
const vectors: Vectors = JSON.parse(readFileSync(VECTORS, "utf8").replace(/"seed":(\d+)/g, '"seed":"$1"'));

function probabilitiesOf(spec: MixtureSpec): number[] {
  if (spec.probabilities) return spec.probabilities;
  let weights: number[];
  if (spec.weights) {
    weights = spec.weights;
  } else {
    const { k, a, c, m } = spec as Required<MixtureSpec>;
    const exponents = Array.from({ length: k }, (_, i) => (a * i + c) % m);
    weights = spec.rule === "lcg" ? exponents : exponents.map((e) => 2 ** e);
  }
  const total = weights.reduce((sum, w) => sum + w, 0);
  assert.ok(total < 2 ** 53);
  return weights.map((w) => w / total);
}

const mixtures = new Map(Object.entries(vectors.mixtures).map(([name, spec]) => [name, probabilitiesOf(spec)]));

function sha256(values: Float64Array): string {
  const view = new DataView(new ArrayBuffer(values.length * 8));
  values.forEach((value, i) => view.setFloat64(i * 8, value, true));
  return createHash("sha256").update(new Uint8Array(view.buffer)).digest("hex");
}

/** The cases this implementation gets wrong, with the given hash constants (empty: none). */
function mismatches(constants?: HashConstants): string[] {
  const problems: string[] = [];
  for (const c of vectors.cases) {
    const where = `${JSON.stringify(c.unit).slice(0, 40)} seed ${c.seed} round ${c.round}`;
    if (c.segments !== undefined) {
      const set = vectors.segment_sets[c.segments];
      const segmented = new SegmentedMixtures(c.seed, c.round, set.names,
        Object.fromEntries(set.names.map((name) => [name, mixtures.get(set.mixtures[name])!])), set.open);
      let served: string;
      try {
        served = segmented.served(c.segment);
      } catch (error) {
        if (!(error instanceof SegmentError) || error.code !== c.error) problems.push(`${where}: ${error}`);
        continue;
      }
      if (c.error !== undefined) { problems.push(`${where}: not refused`); continue; }
      if (served !== c.served_segment) problems.push(`${where}: served ${served}`);
      const probabilities = mixtures.get(set.mixtures[served])!;
      const got = chooseWith(new Mixture(c.seed, c.round, probabilities).cumulative, c, constants);
      if (got !== c.arm || probabilities[got] !== c.probability) problems.push(`${where}: arm ${got}`);
      continue;
    }
    if (c.error !== undefined) continue; // segment_not_accepted: a segment given to an unsegmented experiment
    const probabilities = mixtures.get(c.mixture!)!;
    const got = chooseWith(cumulativeProbabilities(probabilities), c, constants);
    if (got !== c.arm || probabilities[got] !== c.probability) problems.push(`${where}: arm ${got}, not ${c.arm}`);
  }
  return problems;
}

function chooseWith(cumulative: Float64Array, c: Case, constants?: HashConstants): number {
  return chooseArm(cumulative, bucket(c.seed, c.round, c.unit, constants));
}

test("the file is the format this package reads", () => {
  assert.equal(vectors.format, "pasto-assignment-vectors/1");
  assert.ok(vectors.cases.length > 500);
});

test("hash steps reproduce fnv, hash and bucket of every case", () => {
  for (const c of vectors.cases) {
    if (c.fnv === undefined) continue;
    const bytes = key(c.seed, c.round, c.unit);
    assert.equal(fnv1a32(bytes), c.fnv, c.unit);
    assert.equal(fmix32(c.fnv), c.hash, c.unit);
    assert.equal(hash(c.seed, c.round, c.unit), c.hash, c.unit);
    assert.equal(bucket(c.seed, c.round, c.unit), c.bucket, c.unit);
  }
});

test("cumulative probabilities match bit for bit (numpy's summation order)", () => {
  for (const [name, spec] of Object.entries(vectors.mixtures)) {
    assert.equal(sha256(cumulativeProbabilities(mixtures.get(name)!)), spec.sha256, name);
  }
});

test("every case gets its arm, propensity and segment", () => {
  assert.deepEqual(mismatches(), []);
  // And through the public classes, as a port would use them.
  for (const c of vectors.cases) {
    if (c.mixture === undefined || c.error !== undefined) continue;
    assert.deepEqual(new Mixture(BigInt(c.seed), c.round, mixtures.get(c.mixture)!).assign(c.unit),
      { arm: c.arm, probability: c.probability });
  }
});

test("a changed hash constant fails the vectors", () => {
  const valid = vectors.cases.filter((c) => c.error === undefined).length;
  for (const constants of [{ offsetBasis: FNV_OFFSET_BASIS, prime: FNV_PRIME + 2 },
                           { offsetBasis: FNV_OFFSET_BASIS ^ 1, prime: FNV_PRIME }]) {
    const wrong = mismatches(constants).length;
    assert.ok(wrong > valid / 4, `only ${wrong} of ${valid} cases noticed ${JSON.stringify(constants)}`);
  }
});

test("seeds beyond 2^53 are refused as numbers, taken as bigints and strings", () => {
  assert.throws(() => key(2 ** 63, 0, "u"), RangeError);
  assert.equal(hash(2n ** 63n - 1n, 0, "u"), hash("9223372036854775807", 0, "u"));
  assert.throws(() => key(1, 0, "\uD800"), TypeError);
});
