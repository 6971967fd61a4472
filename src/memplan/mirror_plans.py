"""Mirror plans m(v) for Alg. 2: one mirror count per forward op (0 = keep, 1 = recompute).

Two fixed plans from the paper: drop the results of cheap ops (Sec. 4.2) and about sqrt(n)
segments (Sec. 4.3, Alg. 1). The search over a memory budget (Alg. 3) belongs to the planners;
``allocation.plan_memory`` accepts any per-op list, so a better plan drops in there.
"""

from __future__ import annotations

import bisect
import math

from memplan import graph as g
from memplan.errors import bad_arg
from memplan.training_graph import op_name

# Sec. 4.2: "drop the result of the batch normalization, activation function and pooling".
CHEAP_OPS = frozenset(
    {
        "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
        "cudnn_batch_norm", "relu", "max_pool2d_with_indices",
    }
)


def drop_bn_relu_plan(graph: g.Graph) -> list[int]:
    """Sec. 4.2: recompute batch-norm, relu and pooling; keep conv (and all other) outputs."""
    return [1 if op_name(op.target) in CHEAP_OPS else 0 for op in graph.ops]


def sqrt_plan(graph: g.Graph, segments: int | None = None) -> list[int]:
    """Sec. 4.3: ~sqrt(n) segments over ``graph.cut_points`` (n of them), balanced by the bytes of
    activations each segment makes. Keep the values live across a chosen cut, recompute the rest.
    """
    if segments is not None and (
        not isinstance(segments, int) or isinstance(segments, bool) or segments < 1
    ):
        raise bad_arg("segments", "an int >= 1 or None (sqrt of the cut count)", segments,
                      "Pass e.g. segments=8.")
    cuts = graph.cut_points
    if not cuts:
        return [0] * len(graph.ops)
    k = segments if segments is not None else max(1, round(math.sqrt(len(cuts))))
    made_bytes = 0
    prefix: list[int] = []  # activation bytes made up to and including each op
    for op in graph.ops:
        made_bytes += sum(graph.values[v].nbytes for v in op.outputs
                          if graph.values[v].kind == g.ACTIVATION)
        prefix.append(made_bytes)
    at_cut = [prefix[c.after] for c in cuts[:-1]]  # the last cut (the end) is always chosen
    chosen: list[int] = []
    for j in range(1, k):
        target = made_bytes * j / k
        pos = bisect.bisect_left(at_cut, target)
        near = [p for p in (pos - 1, pos) if 0 <= p < len(at_cut)]
        if not near:
            break
        best = min(near, key=lambda p: (abs(at_cut[p] - target), p))
        if not chosen or best > chosen[-1]:
            chosen.append(best)
    chosen.append(len(cuts) - 1)
    plan = [1] * len(graph.ops)
    for c in chosen:
        for vid in cuts[c].live:
            plan[graph.values[vid].producer] = 0
    return plan
