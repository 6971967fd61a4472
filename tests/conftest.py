"""Exactness tests compare bit patterns, and gradients differ between thread counts: fix it."""

from __future__ import annotations

import os

import torch

torch.set_num_threads(int(os.environ.get("MEMPLAN_TEST_THREADS", "1")))
