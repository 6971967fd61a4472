"""Libraries that branch on fake tensors, told that memplan's are not a trace.

memplan's fake tensors stand for the real ones of an eager step. transformers takes any
FakeTensor for a trace (``is_tracing``: export, compile) and then builds attention masks that
its eager forward skips (an all-ones padding mask), so a capture would see other ops than the
step runs: a Llama's plan 512 B over its measured peak, M2M100 not captured at all. While
memplan's fake mode runs, transformers' ``is_fake_tensor`` answers False for that mode's
tensors; what the eager path then reads (``mask.all()``) is sized from one real forward, as
every data-dependent value is (``datadep``). Only a library already imported is touched.

Where that real forward cannot run (a model built on the meta device to plan one larger than
the machine), the step is captured on the libraries' trace path instead (``trace_path``): no
data is read there, masks are built, and the plan's peak is an upper bound.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_TRANSFORMERS = "transformers.utils.import_utils"
_TRACE_PATH: ContextVar[bool] = ContextVar("memplan_library_trace_path", default=False)
TRACE_PATH_NOTE = (
    "libraries' trace path: the data-dependent values of their eager path could not be read "
    "(no real forward could run, e.g. a model on the meta device), so transformers built "
    "masks its eager forward may skip; the plan's peak is an upper bound by those bytes.")


@contextlib.contextmanager
def trace_path(on: bool = True) -> Iterator[None]:
    """Within (``on``): fake runs leave the libraries above their own view of fake tensors."""
    token = _TRACE_PATH.set(on)
    try:
        yield
    finally:
        _TRACE_PATH.reset(token)


@contextlib.contextmanager
def eager_libraries(mode: Any) -> Iterator[None]:
    """Within: tensors of the fake ``mode`` are not a trace to the libraries above (unless
    inside ``trace_path``)."""
    utils = sys.modules.get(_TRANSFORMERS)
    original = getattr(utils, "is_fake_tensor", None)
    if utils is None or original is None or _TRACE_PATH.get():
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and getattr(x, "fake_mode", None) is not mode

    setattr(utils, "is_fake_tensor", is_fake_tensor)  # noqa: B010  (a module's global)
    try:
        yield
    finally:
        setattr(utils, "is_fake_tensor", original)  # noqa: B010
