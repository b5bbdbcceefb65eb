"""The one validator of every time bound a caller passes to afd_cupy.

A bound that is NaN, infinite, zero, negative, a bool or not a number would make a wait
unbounded (NaN compares false with every deadline), or fail late and confusingly (0: a launch
that reports its ranks "did not finish" after the terminate grace). Every public call that
takes a timeout checks it here, at the call, before anything starts: a
:class:`~afd_cupy.errors.ConfigError` naming the argument and the value.
"""
from __future__ import annotations

import math
import numbers

from afd_cupy.errors import ConfigError


def check_timeout(name: str, value, *, unit: str = "s") -> float:
    """``value`` as a float when it is a finite real number > 0 (not a bool); else
    ConfigError naming ``name``, ``value`` and ``unit`` ("s" or "ms")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        what = "seconds" if unit == "s" else "milliseconds"
        raise ConfigError(f"{name} must be a finite number of {what} > 0, got {value!r}")
    return float(value)


def check_optional_timeout(name: str, value, *, unit: str = "s") -> float | None:
    """:func:`check_timeout`, with None passed through (meaning "the default")."""
    return None if value is None else check_timeout(name, value, unit=unit)
