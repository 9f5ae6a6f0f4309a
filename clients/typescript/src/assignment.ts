/**
 * pasto's assignment contract (docs/assignment.md) in TypeScript: the arm a unit gets in a round of an
 * experiment, exactly as the server and the Python client assign it. No dependency; the template for
 * ports to other languages. Checked against spec/assignment-vectors.json by test/vectors.test.ts.
 */

/** FNV-1a 32-bit offset basis and prime (step 2). */
export const FNV_OFFSET_BASIS = 2166136261;
export const FNV_PRIME = 16777619;

/** What a port may change to prove that the vectors catch it (the tests do); never in use. */
export interface HashConstants {
  offsetBasis: number;
  prime: number;
}

const CONTRACT: HashConstants = { offsetBasis: FNV_OFFSET_BASIS, prime: FNV_PRIME };
const encoder = new TextEncoder();

/** A seed of up to 64 bits: a bigint, a decimal string, or a safe integer. */
export type Seed = bigint | string | number;

/** The seed in base 10 without sign or padding (step 1). JSON numbers above 2^53 lose digits in
 * JavaScript: parse an experiment's `seed` losslessly and pass it as a bigint or a string. */
export function seedText(seed: Seed): string {
  if (typeof seed === "number") {
    if (!Number.isSafeInteger(seed) || seed < 0) {
      throw new RangeError(`A seed given as a number must be a safe non-negative integer, got ${seed}; pass a bigint or a string.`);
    }
    return String(seed);
  }
  const text = typeof seed === "bigint" ? seed.toString() : seed;
  if (!/^(0|[1-9][0-9]*)$/.test(text)) {
    throw new RangeError(`A seed is a non-negative integer in base 10, got ${JSON.stringify(text)}.`);
  }
  return text;
}

/** FNV-1a, 32 bit, over `data` (step 2). `Math.imul` keeps the product modulo 2^32. */
export function fnv1a32(data: Uint8Array, constants: HashConstants = CONTRACT): number {
  let h = constants.offsetBasis >>> 0;
  for (let i = 0; i < data.length; i++) {
    h = Math.imul(h ^ data[i], constants.prime) >>> 0;
  }
  return h;
}

/** MurmurHash3's 32-bit finaliser (step 3). */
export function fmix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b) >>> 0;
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35) >>> 0;
  h ^= h >>> 16;
  return h >>> 0;
}

/** The key's bytes: `"{seed}:{round}:{unit}"` in UTF-8, no normalisation (step 1). */
export function key(seed: Seed, round: number, unit: string): Uint8Array {
  if (!Number.isSafeInteger(round) || round < 0) {
    throw new RangeError(`A round is a non-negative integer, got ${round}.`);
  }
  if (/[\uD800-\uDFFF]/.test(unit.replace(/[\uD800-\uDBFF][\uDC00-\uDFFF]/g, ""))) {
    throw new TypeError("The unit must be valid Unicode (no unpaired surrogates).");
  }
  return encoder.encode(`${seedText(seed)}:${round}:${unit}`);
}

/** The unit's 32-bit hash (steps 1 to 3). */
export function hash(seed: Seed, round: number, unit: string, constants: HashConstants = CONTRACT): number {
  return fmix32(fnv1a32(key(seed, round, unit), constants));
}

/** The unit's bucket in [0, 1) (step 4). */
export function bucket(seed: Seed, round: number, unit: string, constants: HashConstants = CONTRACT): number {
  return hash(seed, round, unit, constants) / 4294967296;
}

/** numpy's float64 summation order (numpy.sum): pairwise above 128 values, eight running sums below. */
export function pairwiseSum(values: ArrayLike<number>, start = 0, count = values.length - start): number {
  if (count < 8) {
    let total = 0.0;
    for (let i = start; i < start + count; i++) total += values[i];
    return total;
  }
  if (count <= 128) {
    const r = [0, 1, 2, 3, 4, 5, 6, 7].map((j) => values[start + j]);
    let i = 8;
    for (; i < count - (count % 8); i += 8) {
      for (let j = 0; j < 8; j++) r[j] += values[start + i + j];
    }
    let total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < count; i++) total += values[start + i];
    return total;
  }
  let half = Math.floor(count / 2);
  half -= half % 8;
  return pairwiseSum(values, start, half) + pairwiseSum(values, start + half, count - half);
}

/** Normalised cumulative probabilities, the last exactly 1 (step 5). */
export function cumulativeProbabilities(probabilities: ArrayLike<number>): Float64Array {
  const k = probabilities.length;
  if (k === 0) throw new RangeError("The mixture is empty.");
  for (let i = 0; i < k; i++) {
    const p = probabilities[i];
    if (!Number.isFinite(p) || p < 0) throw new RangeError(`Probability ${i} is ${p}: give finite non-negative numbers.`);
  }
  const total = pairwiseSum(probabilities);
  if (!(total > 0)) throw new RangeError("The probabilities are all zero.");
  const cumulative = new Float64Array(k);
  let running = 0.0;
  for (let i = 0; i < k; i++) {
    running += probabilities[i];
    cumulative[i] = running / total;
  }
  cumulative[k - 1] = 1.0;
  return cumulative;
}

/** The smallest k with u < cumulative[k] (step 6): binary search, upper-bound semantics. */
export function chooseArm(cumulative: ArrayLike<number>, u: number): number {
  let low = 0;
  let high = cumulative.length;
  while (low < high) {
    const middle = (low + high) >>> 1;
    if (u < cumulative[middle]) high = middle;
    else low = middle + 1;
  }
  return Math.min(low, cumulative.length - 1);
}

/** One served mixture of an experiment in one round, precomputed for repeated assignment. */
export class Mixture {
  readonly cumulative: Float64Array;

  constructor(readonly seed: Seed, readonly round: number, readonly probabilities: ArrayLike<number>) {
    this.cumulative = cumulativeProbabilities(probabilities);
  }

  /** The arm position of `unit` and its propensity. */
  assign(unit: string): { arm: number; probability: number } {
    const arm = chooseArm(this.cumulative, bucket(this.seed, this.round, unit));
    return { arm, probability: this.probabilities[arm] };
  }
}

/** A segmented experiment's mixtures (docs/assignment.md, "Segments"). */
export class SegmentedMixtures {
  private readonly mixtures: Map<string, Mixture>;

  /** `names` as the experiment lists them (an open set's long tail, "(other)", first). */
  constructor(seed: Seed, round: number, readonly names: string[], probabilities: Record<string, ArrayLike<number>>,
              readonly open: boolean) {
    this.mixtures = new Map(names.map((name) => [name, new Mixture(seed, round, probabilities[name])]));
  }

  /** The segment whose mixture serves `segment` (an open set's long tail for a value without one). */
  served(segment: string | null | undefined): string {
    if (segment != null && this.mixtures.has(segment)) return segment;
    if (this.open) return this.names[0];
    if (segment == null) throw new SegmentError("segment_required", `Give the unit's segment, one of ${this.names.join(", ")}.`);
    throw new SegmentError("segment_unknown", `Unknown segment ${JSON.stringify(segment)}; the segments are ${this.names.join(", ")}.`);
  }

  assign(unit: string, segment: string | null | undefined): { arm: number; probability: number; segment: string } {
    const served = this.served(segment);
    return { ...this.mixtures.get(served)!.assign(unit), segment: served };
  }
}

export class SegmentError extends Error {
  constructor(readonly code: "segment_required" | "segment_unknown", message: string) {
    super(message);
  }
}
