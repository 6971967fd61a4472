"""Identical sub-chains: the optimal planner solves each distinct one once.

Deep nets repeat themselves (residual units, LSTM steps, decoder layers), so most sub-chains
s..t of the chain equal others stage for stage. Inside a recompute region (t < K-1) a
sub-chain's least cost as a function of free bytes depends only on its stages' values and on
gradient bytes *relative to* gb[t]: C(s, t, m) = C'(class, m - gb[t]) (every constraint of
``chain._run`` inside a region holds gb of one of its stages). Stages are typed by those
values, and sub-chains by their type strings: two are in one class when their strings match.
A stage's type holds its step in gradient bytes to the next stage, gb[q] - gb[q+1]; the last
stage of a sub-chain is typed without it (it lies outside), else the sub-chains ending where
the weights' gradients are made (an LSTM's last steps) would each be a class of their own.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core.jit import jit

I64 = npt.NDArray[np.int64]
I32 = npt.NDArray[np.int32]


def stage_types(rows: I64) -> I64:
    """One id per stage (column of ``rows``), equal ids for equal columns; ids in order of
    first appearance (deterministic)."""
    _, first, inverse = np.unique(rows.T, axis=0, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.ravel()]


@jit
def classes(types: I64, end_types: I64, gb: I64) -> tuple[I32, I64]:
    """(cid, min_gb): cid[s, n-1] is the class of the sub-chain of n stages from s (valid
    for s + n <= K): equal ``types`` but for the last stage, equal ``end_types`` there (a
    coarser typing); classes are numbered by length, then by first start. min_gb[c] is the
    least gb[t] over the class's members ending before the last stage (the slack its
    frontier needs above the budget, see ``frontier.fill``)."""
    k = types.shape[0]
    cid = np.empty((k, k), np.int32)
    # first[s, n-1]: the earliest start of the same string (one pass per diagonal s - s').
    covered = np.zeros(k, np.int64)  # lengths for which an earlier equal start was found
    for delta in range(k - 1, 0, -1):  # largest distance first: the earliest start wins
        run = 0  # the strings from i and s agree on this many stages
        for i in range(k - 1 - delta, -1, -1):
            s = i + delta
            run = run + 1 if types[i] == types[s] else 0
            # Sub-chains of up to run stages match, and one more if their last stages do.
            ext = run + 1 if s + run < k and end_types[i + run] == end_types[s + run] else run
            for n in range(covered[s], ext):
                cid[s, n] = i
            covered[s] = max(covered[s], ext)
    for s in range(k):
        for n in range(covered[s], k - s):
            cid[s, n] = s
    count = 0
    for n in range(k):
        for s in range(k - n):
            first = cid[s, n]
            if first == s:
                cid[s, n] = count
                count += 1
            else:
                cid[s, n] = cid[first, n]
    min_gb = np.full(count, np.iinfo(np.int64).max, np.int64)
    for n in range(k - 1):
        for s in range(k - 1 - n):
            c = cid[s, n]
            min_gb[c] = min(min_gb[c], gb[s + n])
    return cid, min_gb
