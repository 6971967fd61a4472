"""numba's ``njit`` with types kept for mypy; plain Python where numba is not installed (the
same code, only slower: tests and small chains still plan)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

try:
    from numba import njit
except ImportError as err:  # pragma: no cover - numba is a dependency; odd platforms still plan
    njit = None  # type: ignore[assignment]
    # Said, not silent: a module shadowing one numba imports (a local timeit.py) once made
    # every plan run uncompiled, minutes per long chain, with no sign of why.
    warnings.warn(f"numba could not be imported ({err}): memplan's planners run as plain "
                  "Python, much slower on long chains. Install numba, or remove what breaks "
                  "its import.", RuntimeWarning, stacklevel=2)

Fn = TypeVar("Fn", bound=Callable[..., Any])


def jit(fn: Fn) -> Fn:
    """Compiled on first call, cached on disk next to the module (numba ``cache=True``)."""
    if njit is None:
        return fn
    return cast(Fn, njit(cache=True, nogil=True)(fn))
