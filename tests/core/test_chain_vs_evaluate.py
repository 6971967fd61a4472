"""The chain model (what the optimal planner optimises) against the runtime's own semantics
(``evaluate``) for recompute regions: a region's tape keeps the resident values its ops read
(an LSTM's hidden state), and the values the user's code only holds past their last read die
in the forward (an LSTM's previous cell state), so no checkpoint keeps them."""

from __future__ import annotations

import pytest

from memplan.core import chain as C
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
