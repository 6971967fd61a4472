"""Libraries that branch on fake tensors, told that memplan's are not a trace.

memplan's fake tensors stand for the real ones of an eager step. transformers takes any
FakeTensor for a trace (``is_tracing``: export, compile) and then builds attention masks that
its eager forward skips (an all-ones padding mask), so a capture would see other ops than the
step runs: a Llama's plan 512 B over its measured peak, M2M100 not captured at all. While
memplan's fake mode runs, transformers' ``is_fake_tensor`` answers False for that mode's
tensors; what the eager path then reads (``mask.all()``) is sized from one real forward, as
every data-dependent value is (``datadep``). Only a library already imported is touched.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

_TRANSFORMERS = "transformers.utils.import_utils"


@contextlib.contextmanager
def eager_libraries(mode: Any) -> Iterator[None]:
    """Within: tensors of the fake ``mode`` are not a trace to the libraries above."""
    utils = sys.modules.get(_TRANSFORMERS)
    original = getattr(utils, "is_fake_tensor", None)
    if utils is None or original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and getattr(x, "fake_mode", None) is not mode

    setattr(utils, "is_fake_tensor", is_fake_tensor)  # noqa: B010  (a module's global)
    try:
        yield
    finally:
        setattr(utils, "is_fake_tensor", original)  # noqa: B010
