"""The chain model (what the optimal planner optimises) against the runtime's own semantics
(``evaluate``) for recompute regions: a region's tape keeps the resident values its ops read
(an LSTM's hidden state), and the values the user's code only holds past their last read die
in the forward (an LSTM's previous cell state), so no checkpoint keeps them."""

from __future__ import annotations

import pytest

from memplan.core import chain as C
from memplan.core import graph as g
from memplan.core import schedule as S
from memplan.core.evaluate import evaluate
from memplan.core.plan import make_plan
from tests.core.graphs import tiny


def _regions(chain: C.Chain, length: int, nested: bool) -> tuple[S.Item, ...]:
    """Top-level regions of ``length`` stages over all but the last stages (bodies plain, or
    a nested region over all but the body's last stage)."""
    items: list[S.Item] = []
    last = chain.n - 2  # the last stages stay kept (the loss runs outside the model)
    for a in range(0, last, length):
        b = min(a + length - 1, last - 1)
        if b < a:
            break
        body: tuple[S.Item, ...] = tuple(S.Keep(s) for s in range(a, b + 1))
        if nested and b > a:
            body = (S.Region(a, b - 1, tuple(S.Keep(s) for s in range(a, b))), S.Keep(b))
        items.append(S.Region(a, b, body))
    start = S.item_end(items[-1]) + 1 if items else 0
    return (*items, *(S.Keep(s) for s in range(start, chain.n)))


@pytest.mark.parametrize("name", ["resnet", "gpt"])
@pytest.mark.parametrize("length", [1, 2, 3])
@pytest.mark.parametrize("nested", [False, True])
def test_chain_model_is_never_below_the_evaluation(name: str, length: int, nested: bool) -> None:
    graph = tiny(name)
    chain = C.build_chain(graph)
    schedule = _regions(chain, length, nested)
    plan = make_plan(chain, schedule, "test", {}, None)
    assert plan.peak_bytes >= evaluate(graph, plan).peak_bytes


def test_lstm_regions_are_counted_as_their_tapes_keep() -> None:
    """One-stage regions over the first 1, 2, 3 stages of the LSTM: the model is within one
    hidden-state tensor of the evaluation whatever the count (it missed one state tensor per
    region when the hidden state was resident and the held cell state in each checkpoint)."""
    graph = tiny("lstm")
    chain = C.build_chain(graph)
    state = 2 * 32 * 4  # batch 2, hidden 32, float32 (tests.core.graphs.TINY["lstm"])
    for count in (1, 2, 3):
        items: list[S.Item] = [S.Region(s, s, (S.Keep(s),)) for s in range(count)]
        schedule = (*items, *(S.Keep(s) for s in range(count, chain.n)))
        plan = make_plan(chain, schedule, "test", {}, None)
        assert abs(plan.peak_bytes - evaluate(graph, plan).peak_bytes) <= state, count


def _read_across_two_cuts() -> g.Graph:
    """A hand-built step: r = relu(x) is read by stage 1 (a = r + w, b = sin(a)) and by stage
    2 (c = b + r, e = sin(c)), so it is read across two cuts; autograd never saves it, and it
    dies at op 3 in the plain run (a GNN layer's input read by ``(1 + eps) * x`` and by
    ``index_select``). Stage 1's backward holds a large gradient (g3)."""
    n = 6
    w, x, r, a, b, c, e, loss, g7, g6, g5, g4, gr, g3, gw = range(15)

    def value(i: int, nbytes: int, kind: str, producer: int, birth: int, death: int | None,
              death_unsaved: int | None = None) -> g.Value:
        return g.Value(i, nbytes, kind, producer, birth, death, (nbytes,), "float32",
                       death_unsaved)

    def op(i: int, target: str, module: str, ins: tuple[int, ...], outs: tuple[int, ...],
           saved: tuple[int, ...] = (), unpack: int = -1, release: int = -1) -> g.Op:
        return g.Op(i, f"aten.{target}", module, ins, outs, (), saved, 1, 1, -1, unpack,
                    release)

    def bop(j: int, target: str, grad_of: int, ins: tuple[int, ...],
            outs: tuple[int, ...]) -> g.Op:
        return g.Op(j, f"aten.{target}", "", ins, outs, (), (), 1, 0, grad_of)

    act, bwd = g.ACTIVATION, g.BACKWARD
    values = (
        value(w, 4, g.PARAMETER, -1, -1, None), value(x, 100, g.INPUT, -1, -1, None),
        value(r, 100, act, 0, 0, 3, 3), value(a, 1000, act, 1, 1, n + 4, 2),
        value(b, 1000, act, 2, 2, 3, 3), value(c, 1000, act, 3, 3, n + 2, 4),
        value(e, 1000, act, 4, 4, 5, 5), value(loss, 4, act, 5, 5, n, n),
        value(g7, 4, bwd, -1, n, n + 1), value(g6, 1000, bwd, -1, n + 1, n + 2),
        value(g5, 1000, bwd, -1, n + 2, n + 3), value(g4, 1000, bwd, -1, n + 3, n + 4),
        value(gr, 100, bwd, -1, n + 3, n + 5), value(g3, 3000, bwd, -1, n + 4, n + 5),
        value(gw, 4, g.GRADIENT, -1, n + 5, None),
    )
    ops = (
        op(0, "relu.default", "m0", (x,), (r,)),
        op(1, "add.Tensor", "m1", (r, w), (a,)),
        op(2, "sin.default", "m1", (a,), (b,), (a,), n + 3, n + 4),
        op(3, "add.Tensor", "m2", (b, r), (c,)),
        op(4, "sin.default", "m2", (c,), (e,), (c,), n + 1, n + 2),
        op(5, "sum.default", "m3", (e,), (loss,)),
    )
    bops = (
        bop(0, "ones_like.default", -1, (loss,), (g7,)), bop(1, "expand.default", 5, (g7,), (g6,)),
        bop(2, "mul.Tensor", 4, (g6, c), (g5,)), bop(3, "clone.default", 3, (g5,), (g4, gr)),
        bop(4, "mul.Tensor", 2, (g4, a), (g3,)), bop(5, "add.Tensor", 1, (g3, gr), (gw,)),
    )
    cuts = (g.CutPoint(0, (r,), 100, "m0", 1), g.CutPoint(2, (r, b), 1100, "m1", 1),
            g.CutPoint(4, (e,), 1000, "m2", 1), g.CutPoint(5, (loss,), 4, "<end>", 0))
    return g.Graph("read-across-two-cuts", values, ops, bops, cuts, (), (loss,))


@pytest.mark.parametrize("regions", [(1,), (1, 2)])
def test_a_never_saved_value_read_across_two_cuts_is_counted_where_a_tape_keeps_it(
        regions: tuple[int, ...]) -> None:
    """A region reading r from outside keeps it on its tape until the region's backward, where
    stage 1's large gradient makes the peak: the model counts it there (it counted r only when
    read across one chosen cut, and was 100 bytes below the evaluation). Plain stays exact."""
    graph = _read_across_two_cuts()
    chain = C.build_chain(graph)
    plain = make_plan(chain, S.plain_schedule(chain), "test", {}, None)
    assert plain.peak_bytes == evaluate(graph, plain).peak_bytes == 5204
    schedule = tuple(S.Region(s, s, (S.Keep(s),)) if s in regions else S.Keep(s)
                     for s in range(chain.n))
    plan = make_plan(chain, schedule, "test", {}, None)
    assert plan.peak_bytes >= evaluate(graph, plan).peak_bytes == 5304
