"""The few functions of :mod:`scipy.special` that pasto uses, with scipy.special imported at first use.

Importing scipy.special costs about 0.25 s of CPU (mostly its array-API layer), and every process
that imports the service imports pasto's state classes and with them this package: web workers,
gunicorn workers and CLI commands (``pasto tokens``, ``pasto db upgrade``) that never close a round
would pay it for nothing. Each function is scipy's own; only the import moves.
"""

from __future__ import annotations

from typing import Any

__all__ = ["logsumexp", "ndtr", "ndtri", "softmax", "stdtrit"]


def _special() -> Any:
    import scipy.special

    return scipy.special


def ndtr(x: Any) -> Any:
    """The standard normal CDF, elementwise (:func:`scipy.special.ndtr`)."""
    return _special().ndtr(x)


def ndtri(p: Any) -> Any:
    """The standard normal quantile, elementwise (:func:`scipy.special.ndtri`)."""
    return _special().ndtri(p)


def stdtrit(degrees: Any, p: Any) -> Any:
    """Student's t quantile with ``degrees`` degrees of freedom (:func:`scipy.special.stdtrit`; what
    ``scipy.stats.t.ppf(p, degrees)`` computes, without importing scipy.stats: about 0.5 s of CPU)."""
    return _special().stdtrit(degrees, p)


def logsumexp(a: Any, **options: Any) -> Any:
    """log(sum(exp(a))) without overflow (:func:`scipy.special.logsumexp`; ``axis``, ``keepdims``)."""
    return _special().logsumexp(a, **options)


def softmax(x: Any, **options: Any) -> Any:
    """exp(x) / sum(exp(x)) without overflow (:func:`scipy.special.softmax`; ``axis``)."""
    return _special().softmax(x, **options)
