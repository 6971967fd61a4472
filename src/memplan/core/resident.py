"""Resident values: activations the chain counts like parameters (from their creation), not as
any stage's bytes, and the cut live sets it uses (Sec. 4.3's chain assumption relaxed for the
models people train: shared tables, skips, caches and lists of hidden states)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.jit import jit
from memplan.core.liveness import ValueArrays, held_spans, shared_mask, skip_mask

I64 = npt.NDArray[np.int64]


def resident_values(graph: g.Graph, va: ValueArrays, death: I64, cut_i: I64, live: I64
                    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_], I64, I64, I64, I64]:
    """Which values are resident rather than a stage's bytes, which of them live into the
    backward (the others until their death in the forward), the cut live sets the chain uses
    as (cut index, value) pairs (from the Graph's, ``cut_i``/``live``), and of those the pairs
    of values only held there (past their last read). ``va``: the Graph's values as arrays.

    Resident: shared values (``liveness.shared_values``), skips (``liveness.skip_values``: a
    U-Net's encoder outputs), values the user's code holds past their last read across two or
    more call cuts (``liveness.held_past_cuts``: a KV cache, a list of hidden states; or op
    cuts, held to the forward's end: a loop's initial state in a local variable), and
    values live across two or more cuts that autograd never saves (the user's code alone
    decides when they die). They are counted like parameters from their creation (until they
    die in the forward, for those never saved) and never decide where a boundary may go: no
    plan shortens their lives by much (a region could drop a saved one it makes: counting it
    is conservative). A region's tape lengthens the lives of those dying in the forward: the
    checkpoints of the chosen cuts they are read across count them (``checkpoints``). Other
    values held past their last read are live across the cuts they are held across (a region
    ending there keeps them)."""
    cuts = graph.cut_points
    n_ops, nv = va.n_ops, len(va.producer)
    cut_after = np.array([c.after for c in cuts], dtype=np.int64)
    held_v, first, last = held_spans(va, cut_after)
    shared = shared_mask(va, graph.module_calls)
    resident = shared | skip_mask(va, graph.module_calls)
    dies = np.where(va.death_unsaved[held_v] == 0, n_ops, va.death_unsaved[held_v])
    resident[held_v[_held_long(np.array([c.depth for c in cuts], dtype=np.int64),
                               np.array([c.kind == g.CALL for c in cuts], dtype=np.bool_),
                               np.array([c.kind == g.OP for c in cuts], dtype=np.bool_),
                               cut_after, first, last, dies, n_ops - 1)]] = True
    saved_or_shared = death >= n_ops
    saved_or_shared[shared] = True
    short = ~resident[held_v]
    held_v, first, last = held_v[short], first[short], last[short]
    held_i = np.zeros(0, dtype=np.int64)
    if len(held_v):
        lens = last - first + 1
        held_i = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens
                                                                         - first, lens)
        held_v = np.repeat(held_v, lens)
        cut_i, live = np.concatenate((cut_i, held_i)), np.concatenate((live, held_v))
        only = ~np.isin(held_i * nv + held_v, cut_i[: len(cut_i) - len(held_i)] * nv
                        + live[: len(live) - len(held_v)])  # (a returned value is both)
        held_i, held_v = held_i[only], held_v[only]
    pairs = np.unique(cut_i * nv + live)  # once each (outputs are both)
    cut_i, live = pairs // nv, pairs % nv
    crossings = np.bincount(live, minlength=nv)
    resident |= (crossings >= 2) & (death < n_ops)
    keep, keep_held = ~resident[live], ~resident[held_v]
    return resident, saved_or_shared, cut_i[keep], live[keep], held_i[keep_held], held_v[keep_held]


@jit
def _held_long(depth: I64, call: npt.NDArray[np.bool_], op: npt.NDArray[np.bool_],
               after: I64, first: I64, last: I64, death: I64, last_op: int
               ) -> npt.NDArray[np.bool_]:
    """Per held span: held across two or more call cuts at the outermost depth among those it
    crosses (and the call end it dies at): a KV cache or a list of hidden states across
    layers. Not an LSTM's state, held by its caller until the next step returns: across that
    step's cell ends, up to one step end. Op cuts (the model's own code, depth 0) count for a
    value held to the forward's last op: a loop over nn.LSTMCell in the forward holds its
    initial state in a local variable across every step's cut (counted in each checkpoint, it
    cost the paper's LSTM written so 44.8 % extra at 0.5 GB, not 42.2 %); not for one held
    to the end of a loop's iteration, across that iteration's op cuts."""
    out = np.zeros(len(first), np.bool_)
    for v in range(len(first)):
        a, b = first[v], last[v]
        outer, count = -1, 0
        for c in range(a, b + 1):
            counted = call[c] or (op[c] and death[v] >= last_op)
            if counted and (count == 0 or depth[c] < outer):
                outer, count = depth[c], 0
            if counted and depth[c] == outer:
                count += 1
        if count == 0:
            continue
        ends_call = b + 1 < len(after) and after[b + 1] == death[v] and call[b + 1]
        if ends_call and depth[b + 1] < outer:
            count = 0  # the outer depth is the call end's, which no crossed cut has
        out[v] = count >= 2
    return out
