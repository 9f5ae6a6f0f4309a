"""Assignment hashing: published FNV-1a vectors, frozen golden buckets, batch == scalar, inverse CDF."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pasto.hashing import (
    PrefixHasher,
    bucket,
    buckets,
    choose_arm,
    choose_arms,
    cumulative_probabilities,
    fmix32,
    fnv1a_32,
)


@pytest.mark.parametrize(
    ("data", "expected"),
    [(b"", 0x811C9DC5), (b"a", 0xE40C292C), (b"foobar", 0xBF9CF968)],
)
def test_fnv1a_matches_published_test_vectors(data, expected):
    assert fnv1a_32(data) == expected


def test_fmix32_is_the_murmur3_finaliser():
    assert fmix32(0) == 0
    # fmix32 is a bijection: distinct inputs give distinct outputs on a sample.
    sample = [fmix32(i) for i in range(10_000)]
    assert len(set(sample)) == len(sample)


# These values are a promise to every client that assigns locally: they must never change.
GOLDEN = [
    ((0, "u1", 0), 0.4948772930074483),
    ((0, "", 0), 0.44327281485311687),
    ((42, "user-123", 7), 0.16198004106990993),
    ((2**31, "héllo wörld ✓", 123456), 0.9166789732407779),
    ((1, "a" * 200, 0), 0.40139255532994866),
]


@pytest.mark.parametrize(("arguments", "expected"), GOLDEN)
def test_bucket_golden_values(arguments, expected):
    seed, unit, round_index = arguments
    assert bucket(seed, unit, round_index) == expected
    assert PrefixHasher(seed, round_index)(unit) == expected
    assert buckets(seed, [unit], round_index)[0] == expected


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**63),
    round_index=st.integers(min_value=0, max_value=10**9),
    units=st.lists(st.text(max_size=40), min_size=1, max_size=30),
)
def test_batch_prefix_and_scalar_forms_agree(seed, round_index, units):
    hasher = PrefixHasher(seed, round_index)
    batch = buckets(seed, units, round_index)
    for unit, value in zip(units, batch):
        expected = bucket(seed, unit, round_index)
        assert 0.0 <= expected < 1.0
        assert hasher(unit) == expected
        assert value == expected


def test_buckets_are_uniform_and_rounds_are_independent():
    units = [f"user-{i}" for i in range(50_000)]
    first = buckets(11, units, 0)
    second = buckets(11, units, 1)
    counts, _ = np.histogram(first, bins=10, range=(0.0, 1.0))
    expected = len(units) / 10
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 30.0  # 9 degrees of freedom: p < 0.0005 beyond this
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.03


def test_choose_arm_is_inverse_cdf_and_skips_zero_probability_arms():
    cumulative = cumulative_probabilities([0.5, 0.0, 0.5])
    assert cumulative[-1] == 1.0
    assert choose_arm(cumulative, 0.0) == 0
    assert choose_arm(cumulative, 0.4999) == 0
    assert choose_arm(cumulative, 0.5) == 2
    assert choose_arm(cumulative, 0.999999) == 2
    np.testing.assert_array_equal(choose_arms([0.5, 0.0, 0.5], np.array([0.0, 0.49, 0.5, 0.99])), [0, 0, 2, 2])


def test_choose_arms_frequencies_follow_the_probabilities():
    probabilities = np.array([0.1, 0.2, 0.3, 0.4])
    arms = choose_arms(probabilities, buckets(3, [str(i) for i in range(40_000)], 2))
    frequencies = np.bincount(arms, minlength=4) / arms.size
    np.testing.assert_allclose(frequencies, probabilities, atol=0.01)


@pytest.mark.parametrize("bad", [[], [0.0, 0.0], [0.5, -0.1], [np.nan, 1.0], [[0.5, 0.5]]])
def test_cumulative_probabilities_rejects_bad_vectors(bad):
    with pytest.raises(ValueError, match="probabilities"):
        cumulative_probabilities(bad)


def test_units_must_be_strings():
    with pytest.raises(TypeError, match="string"):
        bucket(0, 12, 0)
    with pytest.raises(TypeError, match="string"):
        buckets(0, ["a", 3], 0)


# Units as the batch hash meets them: ASCII ids, any unicode (no lone surrogates: they have no UTF-8),
# trailing and embedded NUL characters, and a few units far longer than the rest (hashed outside the
# padded byte matrix).
_encodable_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60)
_unit = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=127), max_size=40),
    _encodable_text,
    _encodable_text.map(lambda text: text + "\x00" * 3),
    st.builds(lambda text, repeat: text * repeat, _encodable_text, st.integers(min_value=1, max_value=400)),
)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**63),
    round_index=st.integers(min_value=0, max_value=10**9),
    units=st.lists(_unit, min_size=1, max_size=60),
)
def test_batch_hash_equals_the_scalar_hash_for_unicode_nul_and_long_units(seed, round_index, units):
    batch = buckets(seed, units, round_index)
    assert batch.dtype == np.float64 and batch.shape == (len(units),)
    assert batch.tolist() == [bucket(seed, unit, round_index) for unit in units]
    # As a tuple and as a generator: the same values.
    assert buckets(seed, tuple(units), round_index).tolist() == batch.tolist()
    assert buckets(seed, iter(units), round_index).tolist() == batch.tolist()


def test_batch_hash_of_one_very_long_unit_among_short_ones():
    units = [f"user-{i}" for i in range(1000)] + ["é" * 100_000, "x" * 50_000, ""]
    assert buckets(5, units, 9).tolist() == [bucket(5, unit, 9) for unit in units]


def test_batch_hash_rejects_what_the_scalar_hash_rejects():
    with pytest.raises(TypeError, match="Every unit must be a string, got bytes"):
        buckets(0, ["a", b"b"], 0)
    with pytest.raises(UnicodeEncodeError):
        bucket(0, "a\ud800", 0)
    with pytest.raises(UnicodeEncodeError):
        buckets(0, ["é", "a\ud800"], 0)
    assert buckets(0, [], 0).shape == (0,)
