"""Deterministic assignment of units to arms.

``bucket(seed, unit, round_index)`` maps a unit to a number in [0, 1) that is the same for the same
inputs on every platform, Python version and process, forever. It is the contract between the
server and every client that assigns locally, so it must never change:

1. ``key = f"{seed}:{round_index}:{unit}"`` encoded as UTF-8 (``seed`` and ``round_index`` are
   base-10 integers without padding).
2. ``h`` = FNV-1a, 32 bit, over the bytes of ``key`` (offset basis 2166136261, prime 16777619).
3. ``h`` is passed through the MurmurHash3 32-bit finaliser (``fmix32``) so that keys differing
   only in their last characters still spread over the whole range.
4. ``bucket = h / 2**32``.

An arm is chosen from the probabilities ``p`` by inverse CDF: the smallest ``k`` with
``bucket < (p_0 + ... + p_k) / sum(p)``. The round is part of the key, so a unit keeps its arm
within a round (sticky) and is drawn afresh, independently, in the next one.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

import numpy as np

FNV_OFFSET_BASIS = 2166136261
FNV_PRIME = 16777619
_MASK = 0xFFFFFFFF
_SCALE = 1.0 / 4294967296.0

__all__ = [
    "fnv1a_32",
    "fmix32",
    "bucket",
    "buckets",
    "choose_arm",
    "choose_arms",
    "cumulative_probabilities",
    "PrefixHasher",
]


def fnv1a_32(data: bytes, state: int = FNV_OFFSET_BASIS) -> int:
    """FNV-1a 32-bit hash of ``data``, continuing from ``state`` (the offset basis by default)."""
    h = state
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK
    return h


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijection on 32-bit integers with full avalanche."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    h ^= h >> 16
    return h


def _key_prefix(seed: int, round_index: int) -> bytes:
    return f"{int(seed)}:{int(round_index)}:".encode("utf-8")


def bucket(seed: int, unit: str, round_index: int) -> float:
    """Return the unit's bucket in [0, 1) for ``round_index`` of an experiment with ``seed``.

    Parameters
    ----------
    seed : int
        The experiment's seed.
    unit : str
        The unit (user, request or session id) being assigned.
    round_index : int
        The round the assignment belongs to.

    Returns
    -------
    float
        A value in [0, 1), identical for identical inputs everywhere.
    """
    if not isinstance(unit, str):
        raise TypeError(f"The unit must be a string, got {type(unit).__name__}.")
    h = fnv1a_32(_key_prefix(seed, round_index) + unit.encode("utf-8"))
    return fmix32(h) * _SCALE


class PrefixHasher:
    """``bucket`` with the ``seed:round:`` prefix hashed once, for fast repeated assignment.

    ``PrefixHasher(seed, round_index)(unit) == bucket(seed, unit, round_index)`` for every unit.
    """

    __slots__ = ("seed", "round_index", "_state")

    def __init__(self, seed: int, round_index: int) -> None:
        self.seed = int(seed)
        self.round_index = int(round_index)
        self._state = fnv1a_32(_key_prefix(seed, round_index))

    def __call__(self, unit: str) -> float:
        h = self._state
        for byte in unit.encode("utf-8"):
            h = ((h ^ byte) * FNV_PRIME) & _MASK
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & _MASK
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & _MASK
        h ^= h >> 16
        return h * _SCALE


def buckets(seed: int, units: Sequence[str] | Iterable[str], round_index: int) -> np.ndarray:
    """Vectorised ``bucket`` over many units.

    Parameters
    ----------
    seed : int
    units : sequence of str, length N
    round_index : int

    Returns
    -------
    numpy.ndarray of float64, shape (N,)
    """
    encoded = [u.encode("utf-8") if isinstance(u, str) else _bad_unit(u) for u in units]
    n = len(encoded)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=n)
    width = int(lengths.max())
    matrix = np.zeros((n, max(width, 1)), dtype=np.uint8)
    if width:
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        rows = np.repeat(np.arange(n), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        cols = np.arange(flat.size) - starts
        matrix[rows, cols] = flat
    h = np.full(n, fnv1a_32(_key_prefix(seed, round_index)), dtype=np.uint64)
    prime = np.uint64(FNV_PRIME)
    mask = np.uint64(_MASK)
    for column in range(width):
        active = lengths > column
        stepped = ((h ^ matrix[:, column].astype(np.uint64)) * prime) & mask
        h = np.where(active, stepped, h)
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & mask
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & mask
    h ^= h >> np.uint64(16)
    return h.astype(np.float64) * _SCALE


def _bad_unit(unit: object) -> bytes:
    raise TypeError(f"Every unit must be a string, got {type(unit).__name__}.")


def cumulative_probabilities(probabilities: Sequence[float] | np.ndarray) -> list[float]:
    """Normalised cumulative sums of ``probabilities`` (last entry exactly 1.0), for ``choose_arm``."""
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError("The probabilities must be a non-empty one-dimensional array.")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or p.sum() <= 0:
        raise ValueError("The probabilities must be finite, non-negative and not all zero.")
    cumulative = np.cumsum(p) / p.sum()
    cumulative[-1] = 1.0
    return cumulative.tolist()


def choose_arm(cumulative: Sequence[float], u: float) -> int:
    """Inverse-CDF choice: the smallest ``k`` with ``u < cumulative[k]``.

    ``cumulative`` comes from :func:`cumulative_probabilities`; ``u`` is a bucket in [0, 1).
    Arms with probability zero are never chosen.
    """
    return min(bisect_right(cumulative, u), len(cumulative) - 1)


def choose_arms(probabilities: Sequence[float] | np.ndarray, u: np.ndarray) -> np.ndarray:
    """Vectorised inverse-CDF choice of arms.

    Parameters
    ----------
    probabilities : array_like, shape (K,)
    u : numpy.ndarray, shape (N,), values in [0, 1)

    Returns
    -------
    numpy.ndarray of int64, shape (N,)
    """
    cumulative = np.asarray(cumulative_probabilities(probabilities))
    index = np.searchsorted(cumulative, np.asarray(u, dtype=np.float64), side="right")
    return np.minimum(index, cumulative.size - 1).astype(np.int64)
