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
    """Vectorised ``bucket`` over many units: ``buckets(seed, units, r)[i] == bucket(seed, units[i], r)``.

    Parameters
    ----------
    seed : int
    units : sequence of str, length N
    round_index : int

    Returns
    -------
    numpy.ndarray of float64, shape (N,)
    """
    if not isinstance(units, (list, tuple)):
        units = list(units)
    n = len(units)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    try:
        joined = "".join(units)  # also the type check, in C
    except TypeError:
        for unit in units:
            if not isinstance(unit, str):
                _bad_unit(unit)
        raise
    if joined.isascii():
        # One byte per character. Without NUL in the units, NUL separators give every unit's end
        # in one pass over the bytes (no per-unit Python call at all).
        if "\x00" not in joined:
            data = np.frombuffer(("\x00".join(units) + "\x00").encode("ascii"), dtype=np.uint8)
            ends = np.flatnonzero(data == 0)
            starts = np.empty(n, dtype=np.intp)
            starts[0] = 0
            starts[1:] = ends[:-1] + 1
            lengths = ends - starts
        else:
            lengths = np.fromiter(map(len, units), dtype=np.intp, count=n)
            data = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
            starts = np.cumsum(lengths) - lengths
        encoded: Sequence[str] | list[bytes] = units
    else:
        encoded = [unit.encode("utf-8") for unit in units]
        lengths = np.fromiter(map(len, encoded), dtype=np.intp, count=n)
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        starts = np.cumsum(lengths) - lengths
    prefix = fnv1a_32(_key_prefix(seed, round_index))
    h = np.full(n, prefix, dtype=np.uint32)
    # A few very long units would make the column loop as long as the longest of them: they are
    # hashed one by one instead (their length set to 0 for the loop, which then leaves them alone).
    long = _hashed_alone(lengths) if int(lengths.max()) > _LONG_UNIT else None
    if long is not None:
        lengths = lengths.copy()
        lengths[long] = 0
    _fnv1a_columns(h, data, starts, lengths)
    if long is not None:
        for i in long.tolist():
            unit = encoded[i]
            h[i] = fnv1a_32(unit.encode("utf-8") if isinstance(unit, str) else unit, prefix)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h * _SCALE


# Units this long or shorter always go through the column loop.
_LONG_UNIT = 64
# What a step of the column loop over N units costs, in bytes hashed one by one (``fnv1a_32``'s
# Python loop): _COLUMN_STEP + _COLUMN_UNIT * N (a few NumPy calls over N elements; measured).
_COLUMN_STEP = 50.0
_COLUMN_UNIT = 0.04


def _hashed_alone(lengths: np.ndarray) -> np.ndarray | None:
    """The units (indices) to hash one by one rather than in the column loop, or None: the k longest
    units of more than _LONG_UNIT bytes, with the k for which the loop (as long as the longest unit
    left in it) and the bytes hashed alone cost least. Two units of 20,000 bytes take 40,000 bytes
    hashed alone rather than 20,000 loop steps, and 10,000 units of 300 bytes stay in the loop."""
    candidates = np.flatnonzero(lengths > _LONG_UNIT)
    order = candidates[np.argsort(lengths[candidates])[::-1]]
    descending = lengths[order]
    short = lengths[lengths <= _LONG_UNIT]
    # Hashing the k longest alone (k = 0 .. len(order)): the loop is as long as the next one.
    loop_steps = np.append(descending, int(short.max()) if short.size else 0)
    alone_bytes = np.concatenate([[0], np.cumsum(descending)])
    cost = loop_steps * (_COLUMN_STEP + _COLUMN_UNIT * len(lengths)) + alone_bytes
    k = int(np.argmin(cost))
    return order[:k] if k else None


def _fnv1a_columns(h: np.ndarray, data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Continue FNV-1a in ``h`` (N,) over the bytes of N units, unit ``i`` being
    ``data[starts[i]:starts[i] + lengths[i]]``: one gather per byte position, in uint32 (whose
    multiplication wraps modulo 2**32 as FNV's does); only the positions past the shortest unit
    need the mask of the units still going."""
    shortest, longest = int(lengths.min()), int(lengths.max())
    if longest == 0:
        return
    # Positions past a unit's end read the next unit's bytes (or this padding), then are masked out.
    padded = np.concatenate([data, np.zeros(longest, dtype=np.uint8)])
    prime = np.uint32(FNV_PRIME)
    stepped = np.empty_like(h)
    for column in range(longest):
        byte = padded[starts + column]
        if column < shortest:
            np.bitwise_xor(h, byte, out=h)
            np.multiply(h, prime, out=h)
        else:
            np.bitwise_xor(h, byte, out=stepped)
            np.multiply(stepped, prime, out=stepped)
            np.copyto(h, stepped, where=lengths > column)


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
