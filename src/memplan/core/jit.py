"""numba's ``njit`` with types kept for mypy; plain Python where numba is not installed (the
same code, only slower: tests and small chains still plan)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is a dependency; odd platforms still plan
    njit = None  # type: ignore[assignment]

Fn = TypeVar("Fn", bound=Callable[..., Any])


def jit(fn: Fn) -> Fn:
    """Compiled on first call, cached on disk next to the module (numba ``cache=True``)."""
    if njit is None:
        return fn
    return cast(Fn, njit(cache=True, nogil=True)(fn))
