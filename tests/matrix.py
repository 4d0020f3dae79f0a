"""Big test matrices, sampled: every run (CI's, README's test command) runs the parameters a test keeps; the
others are marked ``slow`` and run with ``python -m pytest -m slow`` (or everything: ``-m "slow or not slow"``).
What is kept covers each code path once; the rest repeats it on more models or settings."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest


def sampled(params: Iterable[Any], keep: Callable[[Any], bool]) -> list:
    """params as `pytest.mark.parametrize` takes them (values, or tuples of values for several names); those that
    `keep` refuses are marked slow (their ids unchanged)."""
    out = []
    for p in params:
        if keep(p):
            out.append(p)
        else:
            values = p if isinstance(p, tuple) else (p,)
            out.append(pytest.param(*values, marks=pytest.mark.slow))
    return out
