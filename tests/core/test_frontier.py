"""The optimal planner's frontier kernels equal their definitions on random frontiers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.core.planners import frontier as F


@st.composite
def frontiers(draw: st.DrawFn, choice: int, max_n: int = 40, min_n: int = 1) -> np.ndarray:
    """A frontier: needs strictly rising, costs strictly falling (n x 3: need, cost, choice)."""
    n = draw(st.integers(min_n, max_n))
    needs = np.cumsum(draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)))
    drops = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    costs = draw(st.integers(0, 40)) + np.cumsum(drops[::-1])[::-1]
    start = draw(st.integers(-10, 30))
    return np.stack([needs + start, costs, np.full(n, choice)], axis=1).astype(np.int64)


def value(front: np.ndarray, m: int) -> tuple[int, int] | None:
    """(cost, choice) of a frontier at m free (its point of largest need <= m)."""
    i = np.searchsorted(front[:, 0], m, side="right") - 1
    return None if i < 0 else (int(front[i, 1]), int(front[i, 2]))


def least(env: np.ndarray, a: np.ndarray, ash: int, b: np.ndarray, bsh: int, need: int,
          add: int, cap: int, cost_cap: int, choice: int) -> list[tuple[int, int, int]]:
    """``_with_region`` by its definition: at every need where either side changes, the least
    of env and the choice (from need on; its breakpoints above cap are not taken, costs above
    cost_cap never), ties to env; a point wherever the least falls."""
    marks = sorted({int(v) for v in env[:, 0]} | {int(v) + ash for v in a[:, 0]}
                   | {int(v) + bsh for v in b[:, 0]} | {need})
    out: list[tuple[int, int, int]] = []
    last_mark = max([v for v in marks if v <= cap and v >= need], default=None)
    for m in marks:
        best = value(env, m)
        at = m if m <= cap else last_mark  # the choice is held at its last point below cap
        if m >= need and at is not None and at >= need:
            va, vb = value(a, at - ash), value(b, at - bsh)
            if va is not None and vb is not None:
                v = va[0] + vb[0] + add
                if v <= cost_cap and (best is None or v < best[0]):
                    best = (v, choice)
        if best is not None and (not out or best[0] < out[-1][1]):
            out.append((m, best[0], best[1]))
    return out


@st.composite
def merges(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(env, A, B, ash, bsh); env is often B's points, thinned, moved and jittered, so that
    the choice runs close to env, now above it, now below (where a wrong bulk copy shows)."""
    # B at times as long as the top level's suffixes (hundreds of points), A short (a body)
    a = draw(frontiers(choice=0, max_n=6))
    b = draw(frontiers(choice=0, max_n=150, min_n=draw(st.sampled_from([1, 64]))))
    ash, bsh = draw(st.integers(-20, 20)), draw(st.integers(-20, 20))
    if draw(st.booleans()):
        return draw(frontiers(choice=-1, max_n=80)), a, b, ash, bsh
    sparse = draw(st.integers(0, 20))  # env keeps about one of B's points in this many
    keep = np.array(draw(st.lists(st.integers(0, sparse), min_size=len(b),
                                  max_size=len(b)))) == 0
    noise = np.array(draw(st.lists(st.integers(-3, 3), min_size=len(b), max_size=len(b))))
    moved = b.copy()
    moved[:, 0] += bsh + draw(st.sampled_from([0, 0, -1, 2]))
    moved[:, 1] += int(a[-1, 1]) + noise  # now above the choice, now below
    moved[:, 2] = -1
    rows = [p for p in moved[keep | (np.arange(len(b)) == 0)]]
    env = [rows[0]]
    for p in rows[1:]:
        if p[1] < env[-1][1]:
            env.append(p)
    return np.array(env), a, b, ash, bsh


@settings(max_examples=300, deadline=None)
@given(merges(), st.one_of(st.just(-100), st.integers(-20, 60)),
       st.one_of(st.just(0), st.integers(0, 30)), st.one_of(st.just(10**6), st.integers(0, 300)),
       st.one_of(st.just(10**6), st.integers(0, 400)))
def test_region_merge_equals_its_definition(
        case: tuple[np.ndarray, np.ndarray, np.ndarray, int, int], need: int, add: int,
        cap: int, cost_cap: int) -> None:
    """The merge of a region choice into a frontier (with its early exits and bulk copies)
    gives the pointwise least of the two, exactly; -1 (env unchanged) only where that is
    env."""
    env, a, b, ash, bsh = case
    pool = np.concatenate([a, b])
    out = np.empty((len(env) + len(pool) + 1, 3), dtype=np.int64)
    w = F._with_region(pool, 0, len(a), ash, len(a), len(b), bsh, need, add, cap, cost_cap,
                       7, env.copy(), len(env), out)
    got = [tuple(int(v) for v in p) for p in (env if w < 0 else out[:w])]
    want = least(env, a, ash, b, bsh, need, add, cap, cost_cap, 7)
    assert got == want
