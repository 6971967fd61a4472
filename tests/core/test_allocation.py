"""Static allocation (paper Fig. 2) over training graphs and Alg. 2 mirror graphs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.ops import is_expensive
from memplan.core.planners.sqrt import plan_sqrt
from memplan.core.static.allocation import Allocation, allocate, feature_map_bytes, plan_memory
from memplan.core.static.mirror_plans import drop_cheap_mirror, mirror_counts, sqrt_mirror
from memplan.core.static.training_graph import Step, TrainingGraph, training_graph
from memplan.errors import ConfigError
from tests.core.graphs import tiny

STRATEGIES = ("none", "inplace", "sharing")


# --- an independent checker of an allocation ----------------------------------------------------


def check(a: Allocation) -> None:
    """Every read follows its write; values sharing a buffer never overlap in time, except an
    in-place hand-over at the old value's last read; peak and totals recomputed from scratch."""
    tg = a.tg
    birth: dict[int, int] = {}
    last: dict[int, int] = {}
    for s, step in enumerate(tg.steps):
        for x in step.inputs:
            assert x in birth, f"step {s} reads node {x} before it is made"
            last[x] = s
        for o in step.outputs:
            assert o not in birth, f"node {o} made twice"
            birth[o] = last[o] = s
    for n in tg.keep:
        last[n] = len(tg.steps)
    groups = a.buffers()
    for b, nodes in enumerate(groups):
        assert nodes, f"buffer {b} holds nothing"
        assert a.buffer_bytes[b] == max(tg.nbytes[n] for n in nodes)
        for p, q in itertools.pairwise(nodes):
            assert birth[p] <= birth[q]
            if last[p] < birth[q]:
                assert a.inplace_from[q] == -1
                continue
            # In place: q overwrites p at p's last read, same size, in a pointwise step.
            step = tg.steps[birth[q]]
            assert a.inplace_from[q] == p and last[p] == birth[q], "live values share a buffer"
            assert step.inplace_ok and p in step.inputs and tg.nbytes[p] == tg.nbytes[q]
        if a.strategy == "none":
            assert len(nodes) == 1
        if a.strategy != "sharing":
            assert all(a.inplace_from[q] >= 0 for q in nodes[1:])
    assert sum(len(n) for n in groups) == sum(1 for n in tg.nbytes if n > 0)
    assert a.total_bytes == sum(a.buffer_bytes)
    live = [0] * max(1, len(tg.steps))
    for n, s in birth.items():
        for t in range(s, min(last[n], len(tg.steps) - 1) + 1):
            live[t] += tg.nbytes[n]
        if a.inplace_from[n] >= 0:
            live[s] -= tg.nbytes[n]
    assert a.peak_bytes == max(live)


def allocate_all(tg: TrainingGraph) -> dict[str, Allocation]:
    out = {s: allocate(tg, s) for s in STRATEGIES}
    for a in out.values():
        check(a)
    assert out["sharing"].total_bytes <= out["inplace"].total_bytes <= out["none"].total_bytes
    assert out["none"].total_bytes == sum(tg.nbytes)
    return out


# --- Fig. 2 of the paper, by hand ---------------------------------------------------------------


def test_fig2_example() -> None:
    # B = sigmoid(A), C = sigmoid(B), F = pool(B), E = pool(C), G = E * F; A is the input.
    B, C, F, E, G = range(5)
    steps = (
        Step("forward", 0, 0, (), (B,), True),
        Step("forward", 1, 0, (B,), (C,), True),  # B still needed by F: no in-place
        Step("forward", 2, 0, (B,), (F,), False),  # releases B's tag
        Step("forward", 3, 0, (C,), (E,), False),  # reuses B's tag
        Step("forward", 4, 0, (E, F), (G,), True),  # in place on E
    )
    tg = TrainingGraph((4,) * 5, tuple(range(5)), (0,) * 5, steps, (G,), ())
    a = allocate_all(tg)
    assert [x.total_bytes for x in a.values()] == [20, 16, 12]
    assert a["sharing"].buffers() == [[B, E, G], [C], [F]]  # the paper's final plan
    assert a["inplace"].buffers() == [[B], [C], [F], [E, G]]
    assert [x.peak_bytes for x in a.values()] == [12, 12, 12]  # B, C, F live at step 3


# --- a hand-built captured-style graph ----------------------------------------------------------


def make_graph(
    sizes: dict[int, tuple[int, str, int]],
    fwd: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    bwd: list[tuple[str, int, tuple[int, ...], tuple[int, ...]]],
    outputs: tuple[int, ...],
) -> g.Graph:
    """sizes: value id -> (nbytes, kind, producer); fwd: (op, inputs, outputs);
    bwd: (op, grad_of, inputs, outputs)."""
    values = tuple(
        g.Value(i, n, k, p, -1, None, (n,), "float32") for i, (n, k, p) in sorted(sizes.items())
    )
    ops = tuple(
        g.Op(i, f"aten.{t}.default", f"m{i}", ins, outs, (), (), 1, 1)
        for i, (t, ins, outs) in enumerate(fwd)
    )
    bops = tuple(
        g.Op(j, f"aten.{t}.default", "", ins, outs, (), (), 1, 0, grad_of)
        for j, (t, grad_of, ins, outs) in enumerate(bwd)
    )
    return g.Graph("hand", values, ops, bops, (), (), outputs)


A, B_, C_, D, GC, GB, GA, X, W = range(9)
CHAIN = make_graph(
    {
        A: (10, g.ACTIVATION, 0), B_: (10, g.ACTIVATION, 1), C_: (20, g.ACTIVATION, 2),
        D: (1, g.ACTIVATION, 3), GC: (20, g.BACKWARD, -1), GB: (10, g.BACKWARD, -1),
        GA: (10, g.BACKWARD, -1), X: (100, g.INPUT, -1), W: (7, g.GRADIENT, -1),
    },
    [("convolution", (X,), (A,)), ("relu", (A,), (B_,)), ("convolution", (B_,), (C_,)),
     ("loss", (C_,), (D,))],
    [("loss_backward", 3, (D, C_), (GC,)), ("convolution_backward", 2, (GC, B_), (GB,)),
     ("threshold_backward", 1, (GB, B_), (GA,)), ("convolution_backward", 0, (GA, X), (W,))],
    (D,),
)


def test_chain_by_hand() -> None:
    tg = training_graph(CHAIN)
    assert [tg.value[n] for n in range(len(tg.nbytes))] == [A, B_, C_, D, GC, GB, GA]  # no X, W
    a = allocate_all(tg)
    # none: every feature map; inplace: relu over A, threshold_backward over GB.
    assert [x.total_bytes for x in a.values()] == [81, 61, 51]
    assert a["sharing"].peak_bytes == 51  # B, C, D, GC live at the loss backward
    assert a["sharing"].inplace_from[GA] == GB and a["sharing"].inplace_from[B_] == A


def test_chain_mirror_by_hand() -> None:
    tg = training_graph(CHAIN, [0, 1, 0, 0])  # drop relu's output, recompute it (Alg. 2)
    order = [(s.kind, s.op, s.level) for s in tg.steps]
    assert order == [
        ("forward", 0, 0), ("forward", 1, 0), ("forward", 2, 0), ("forward", 3, 0),
        ("backward", 0, 0), ("mirror", 1, 1), ("backward", 1, 0), ("backward", 2, 0),
        ("backward", 3, 0),
    ]
    b2 = tg.steps[5].outputs[0]
    assert tg.value[b2] == B_ and tg.level[b2] == 1
    assert tg.steps[6].inputs == (GC, b2) and tg.steps[7].inputs == (GB, b2)
    a = allocate_all(tg)
    assert [x.total_bytes for x in a.values()] == [91, 71, 60]
    assert a["sharing"].inplace_from[b2] == A  # the mirror overwrites A, its last reader


def test_recursive_mirror_levels() -> None:
    tg = training_graph(CHAIN, [2, 2, 1, 0])
    mirrors = [(s.op, s.level) for s in tg.steps if s.kind == "mirror"]
    # Alg. 2: copy 2 of op 1 reads copy 2 of op 0; copy 1 of op 2 reads copy 1 of op 1
    # (needed by the loss backward), and backward reads the last copies.
    assert mirrors == [(0, 1), (1, 1), (2, 1), (0, 2), (1, 2)]
    allocate_all(tg)


# --- Hypothesis: random DAGs --------------------------------------------------------------------

SIZES = st.sampled_from([0, 1, 2, 4, 4, 8, 64])


@st.composite
def schedules(draw: Any) -> TrainingGraph:
    nbytes: list[int] = []
    steps = []
    for s in range(draw(st.integers(1, 25))):
        ins = draw(st.lists(st.integers(0, len(nbytes) - 1), max_size=3, unique=True)) if nbytes else []
        outs = []
        for _ in range(draw(st.integers(0, 2))):
            nbytes.append(draw(SIZES))
            outs.append(len(nbytes) - 1)
        steps.append(Step("forward", s, 0, tuple(ins), tuple(outs), draw(st.booleans())))
    keep = draw(st.lists(st.integers(0, len(nbytes) - 1), max_size=2, unique=True)) if nbytes else []
    n = len(nbytes)
    return TrainingGraph(tuple(nbytes), tuple(range(n)), (0,) * n, tuple(steps), tuple(keep), ())


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_random_schedules(tg: TrainingGraph) -> None:
    allocate_all(tg)


@st.composite
def graphs_and_plans(draw: Any) -> tuple[g.Graph, list[int]]:
    """A random forward DAG, a backward op per forward op (reverse order) reading a random
    subset of forward values and the previous gradient, and a random mirror plan."""
    sizes: dict[int, tuple[int, str, int]] = {0: (8, g.INPUT, -1)}
    fwd = []
    acts: list[int] = []
    n_ops = draw(st.integers(1, 12))
    for i in range(n_ops):
        ins = tuple(draw(st.lists(st.sampled_from([0] + acts), min_size=1, max_size=3, unique=True)))
        outs = []
        for _ in range(draw(st.integers(1, 2))):
            vid = len(sizes)
            sizes[vid] = (draw(SIZES), g.ACTIVATION, i)
            outs.append(vid)
        acts += outs
        fwd.append((draw(st.sampled_from(["relu", "add", "convolution", "mm"])), ins, tuple(outs)))
    bwd = []
    grad: tuple[int, ...] = ()
    for i in reversed(range(n_ops)):
        saved = tuple(draw(st.lists(st.sampled_from(acts), max_size=3, unique=True)))
        vid = len(sizes)
        sizes[vid] = (draw(SIZES), g.BACKWARD, -1)
        bwd.append((draw(st.sampled_from(["threshold_backward", "mm"])), i, grad + saved, (vid,)))
        grad = (vid,)
    plan = draw(st.lists(st.integers(0, 2), min_size=n_ops, max_size=n_ops))
    return make_graph(sizes, fwd, bwd, (acts[-1],)), plan


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_and_plans())
def test_random_mirror_graphs(case: tuple[g.Graph, list[int]]) -> None:
    graph, plan = case
    tg = training_graph(graph, plan)
    allocate_all(tg)
    seen: set[tuple[int, int]] = set()
    for s, step in enumerate(tg.steps):
        if step.kind == "mirror":
            assert 1 <= step.level <= plan[step.op] and (step.op, step.level) not in seen
            seen.add((step.op, step.level))
            for n in step.inputs:  # copy k of v reads a[u] as of round k: copy min(m(u), k)
                prod = graph.values[tg.value[n]].producer
                assert tg.level[n] == (min(plan[prod], step.level) if prod >= 0 else 0)
        if step.kind == "backward":
            for n in step.inputs:  # backward reads the last copy a[v] of each forward value
                prod = graph.values[tg.value[n]].producer
                assert tg.level[n] == (plan[prod] if prod >= 0 else 0)
            # Alg. 2: the mirrors just before a backward step are all its ancestors.
            need = set(step.inputs)
            t = s - 1
            while t >= 0 and tg.steps[t].kind == "mirror":
                assert need.intersection(tg.steps[t].outputs), "mirror computed too early"
                need.update(tg.steps[t].inputs)
                t -= 1
    plain = training_graph(graph, [0] * len(graph.ops))
    assert plain == training_graph(graph) and plain.n_recomputed == 0


# --- captured models ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet() -> g.Graph:
    return tiny("resnet")


@pytest.fixture(scope="module")
def lstm() -> g.Graph:
    return tiny("lstm")


def test_minimum_dependencies(resnet: g.Graph) -> None:
    """Each backward step reads just the feature maps its aten op read (what autograd saved,
    Sec. 3): bn outputs are not saved (relu saves its own output), so they die in the forward."""
    tg = training_graph(resnet)
    n_fwd = len(resnet.ops)
    fm = (g.ACTIVATION, g.BACKWARD)
    for step, bop in zip(tg.steps[n_fwd:], resnet.backward_ops):
        want = [v for v in dict.fromkeys(bop.inputs + bop.mutated) if resnet.values[v].kind in fm]
        assert [tg.value[n] for n in step.inputs] == want
    last = {tg.value[n]: s for s, step in enumerate(tg.steps) for n in step.inputs}
    bn_out = [op.outputs[0] for op in resnet.ops if "native_batch_norm" in op.target]
    assert bn_out and all(last[v] < n_fwd for v in bn_out)
    conv_out = [op.outputs[0] for op in resnet.ops if "convolution" in op.target]
    assert conv_out and all(last[v] >= n_fwd for v in conv_out)  # bn backward reads them


@pytest.mark.parametrize("model", ["resnet", "lstm"])
def test_captured_plans(model: str, request: pytest.FixtureRequest) -> None:
    graph: g.Graph = request.getfixturevalue(model)
    fm_bytes = sum(v.nbytes for v in graph.values if v.kind in (g.ACTIVATION, g.BACKWARD))
    plans: list[Any] = [None, drop_cheap_mirror(graph), sqrt_mirror(graph)]
    totals = {}
    for i, plan in enumerate(plans):
        out = allocate_all(training_graph(graph, plan))
        totals[i] = out["sharing"].total_bytes
        if plan is None:
            assert out["none"].total_bytes == fm_bytes
    assert totals[2] < totals[0]  # the sqrt plan saves even on a tiny model
    assert feature_map_bytes(graph, "sharing", "sqrt") == totals[2]
    assert feature_map_bytes(graph) == totals[0]


def test_sqrt_mirror_is_the_sqrt_planners_plan(resnet: g.Graph) -> None:
    plan = plan_sqrt(resnet)
    mirror = sqrt_mirror(resnet)
    assert mirror == mirror_counts(resnet, plan)
    kept = [i for i, m in enumerate(mirror) if m == 0]
    assert 0 < len(kept) < len(mirror)
    assert mirror[resnet.values[resnet.outputs[-1]].producer] == 0  # the loss: never recomputed
    ends = {it.end for it in plan.schedule if isinstance(it, S.Region)}
    handed_on = {resnet.values[v].producer for c in resnet.cut_points for v in c.live
                 if c.after in {plan.stages[e].last_op for e in ends}}
    for stage in plan.stages:  # regions: every op once, but for the checkpoints they hand on
        for i in range(stage.first_op, stage.last_op + 1):
            recomputed = stage.mode == "recompute" and i not in handed_on
            assert mirror[i] == int(recomputed)
    cheap = drop_cheap_mirror(resnet)
    assert all(m == (not is_expensive(op.target) and bool(op.outputs))
               for m, op in zip(cheap, resnet.ops))


def test_describe_names_buffers(resnet: g.Graph) -> None:
    alloc = plan_memory(resnet, "sharing", "sqrt")
    text = alloc.describe(resnet, limit=100)
    n = len(alloc.buffer_bytes)
    assert n < 100 and text.startswith(f"sharing: {n} buffers") and text.count("\n  buffer ") == n
    assert "v106 (convolution net.stem.0)" in text and "'" in text  # ' marks a mirror copy


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="strategy: expected one of"):
        feature_map_bytes(CHAIN, "greedy")
    with pytest.raises(ConfigError, match="plan: expected a list of 4 ints.*got 'a list of 3'"):
        feature_map_bytes(CHAIN, plan=[0, 0, 0])
    with pytest.raises(ConfigError, match="mirror counts that are ints >= 0, got -1"):
        feature_map_bytes(CHAIN, plan=[0, -1, 0, 0])
    with pytest.raises(ConfigError, match="plan: expected None, one of"):
        feature_map_bytes(CHAIN, plan="fastest")
    with pytest.raises(ConfigError, match="plan: expected None, one of \\['drop-cheap'"):
        feature_map_bytes(CHAIN, plan="drop-bn-relu")
