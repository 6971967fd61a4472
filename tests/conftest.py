"""Exactness tests compare bit patterns, and gradients differ between thread counts: fix it.
Without torch (tests/core runs anywhere), there is nothing to fix."""

from __future__ import annotations

import os

try:
    import torch
except ImportError:  # the torch-free core's tests
    torch = None  # type: ignore[assignment]

if torch is not None:
    torch.set_num_threads(int(os.environ.get("MEMPLAN_TEST_THREADS", "1")))
