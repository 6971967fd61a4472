"""Units: module calls a region replays by calling the module again (memplan.runtime.units). Chosen
only where the replay keeps no more than the op tape would; a call that re-runs differently,
or whose parameters changed since, is an error, never a silent difference."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import memplan
from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.evaluate import evaluate, with_evaluation
from memplan.core.plan import make_plan
from memplan.models.lstm import LSTM
from memplan.runtime import units as U
from memplan.runtime.apply import applied_state


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.extra:  # Python state the forward depends on
            h = torch.tanh(h)
        out: torch.Tensor = x + self.fc2(h)
        return out


class Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _same(out: torch.Tensor) -> torch.Tensor:
    return out


def _applied(planner: str = "sqrt") -> tuple[Net, torch.Tensor]:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = Net()
    memplan.apply(model, memplan.plan(model, x, loss_fn=_loss, planner=planner))
    return model, x


def test_blocks_of_a_region_replay_as_units_with_plain_gradients() -> None:
    model, x = _applied()
    torch.manual_seed(0)
    ref = Net()
    _loss(ref(x)).backward()  # type: ignore[no-untyped-call]
    _loss(model(x)).backward()  # type: ignore[no-untyped-call]
    state = applied_state(model)
    assert state is not None and state.last is not None and state.last.units_run > 0
    assert all(torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
               for p, q in zip(model.parameters(), ref.parameters()))


def test_a_call_that_reruns_differently_is_an_error() -> None:
    model, x = _applied()
    assert "blocks.0" in applied_state(model).layout.units  # type: ignore[union-attr]
    loss = _loss(model(x))
    for b in model.blocks:
        b.extra = True  # changed between the forward and its recomputation
    with pytest.raises(memplan.MemplanError, match="recomputing the call of module 'blocks"):
        loss.backward()  # type: ignore[no-untyped-call]


def test_a_parameter_changed_before_backward_is_named() -> None:
    model, x = _applied()
    loss = _loss(model(x))
    with torch.no_grad():
        model.blocks[0].fc1.bias.add_(1.0)  # plain autograd saves no bias: it would not see it
    with pytest.raises(memplan.MemplanError, match="'blocks.0.fc1.bias'.*changed in place"):
        loss.backward()  # type: ignore[no-untyped-call]


class Narrow(nn.Module):
    """A block whose tanh saves an output ``keep`` columns wide: a call re-run with another
    ``keep`` saves as many tensors, one of another shape."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.keep = 2 * d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x)[:, :self.keep])
        out: torch.Tensor = x * h.sum(1, keepdim=True)
        return out


def test_a_call_that_saves_another_shape_is_an_error() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    blocks = [Narrow(16) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(16, 2))
    memplan.apply(model, memplan.plan(model, x, loss_fn=_loss, planner="sqrt"))
    state = applied_state(model)
    assert state is not None and state.layout.units
    loss = _loss(model(x))
    for b in blocks:
        b.keep = 8
    with pytest.raises(memplan.MemplanError, match=r"saved a \[8, 8\] float32 tensor for "
                       r"backward where its forward saved a \[8, 32\] float32 one"):
        loss.backward()  # type: ignore[no-untyped-call]


class PosBlock(nn.Module):
    """A block given positions it never reads (x-transformers passes ``pos=pos`` to every
    attention block, for ALiBi only)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(x)))
        return out


class PosNet(nn.Module):
    """Positions made by the forward before the first block (an int64 arange) and handed to
    each block, then a head of ``width`` outputs."""

    def __init__(self, positions: int, width: int, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.positions = positions
        self.blocks = nn.ModuleList(PosBlock(d) for _ in range(n))
        self.head = nn.Linear(d, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(self.positions, device=x.device)
        for b in self.blocks:
            x = b(x, pos=pos)
        out: torch.Tensor = self.head(x)
        return out


def _pos_region(model: PosNet, first: int, last: int) -> tuple[memplan.Plan, int]:
    """``model`` applied under one region over stages first..last (stage k ends with
    blocks.k; the positions are made in stage 0); the plan and the step's measured peak."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    graph = memplan.capture(model, x, loss_fn=_loss)
    chain = C.build_chain(graph)
    assert chain.modules[:4] == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    region = S.Region(first, last, tuple(S.Keep(s) for s in range(first, last + 1)))
    schedule = (*(S.Keep(s) for s in range(first)), region,
                *(S.Keep(s) for s in range(last + 1, chain.n)))
    plan = make_plan(chain, schedule, "test", {}, None)
    plan = dataclasses.replace(with_evaluation(plan, evaluate(graph, plan)),
                               forward=graph.forward)
    memplan.apply(model, plan)
    measured = memplan.measure(model, x, loss_fn=_loss, simulate=False, repeat=1)
    return plan, measured.peak_bytes


def test_a_call_given_a_tensor_its_region_does_not_read_stays_on_the_tape() -> None:
    """A region over blocks 1 and 2, after the positions (256 x 8 B) were made: a unit's
    tape would keep them (an argument from outside the region, held for the replay) into
    backward, where the op tape, whose ops never read them, lets them die with the forward:
    2,048 B over the plan's peak, which a wide head puts in the loss (xt-decoder-rotary's
    512 B). Those calls stay on the op tape, and the step's peak is the plan's to the byte."""
    torch.manual_seed(0)
    model = PosNet(positions=256, width=512)
    plan, measured = _pos_region(model, 1, 2)
    assert measured == plan.peak_bytes
    assert applied_state(model).layout.units == {}  # type: ignore[union-attr]


def test_a_call_given_a_tensor_its_ops_do_not_read_holds_it_in_replay() -> None:
    """A region over blocks 0-2 that makes the positions (4096 x 8 B) itself: its replay
    keeps them until the last unit given them has run, where the op tape frees them after
    the op that made them (5,120 B over the plan's peak when each call was a unit). Calls
    are units only where that keeps the replay's peak: here none."""
    torch.manual_seed(0)
    model = PosNet(positions=4096, width=2)
    plan, measured = _pos_region(model, 0, 2)
    assert measured == plan.peak_bytes
    assert applied_state(model).layout.units == {}  # type: ignore[union-attr]


# --- the choice, on made-up lifetimes -----------------------------------------------------------


def test_a_call_holding_a_dead_value_goes_to_the_tape() -> None:
    """Ops 0..5, two calls: call A (ops 0-2) makes a 100-byte value read last by op 0 and
    freed by Python at A's end; call B (ops 3-5) likewise. Values saved for backward pile up
    (10 bytes per op), so the region peaks at its end, inside B. Both dead values go over the
    op tape's replay, A's below the region's peak: the step may peak there all the same,
    while another scope's replay is alive (HF MegatronBert, 24,448 B over its plan). Only
    B's inner call, which holds nothing past the tape, stays a unit."""
    saves = [(i + 1, 2 + i, False) for i in range(6)]  # each op's output, after it ran
    values = U.Values(made=[0, 3] + list(range(6)), freed=[3, 6] + [-1] * 6,
                      nbytes=[100, 100] + [10] * 6,
                      reads=[[r] for r in [0, 3] + list(range(6))], saves=saves)
    a, b = U.Call("a", 1, 0, 3, True), U.Call("b", 1, 3, 6, True)
    b_inner = U.Call("b.inner", 1, 4, 6, True)
    units = U.choose([(0, 5)], [a, b, b_inner], values)
    assert units == {"b.inner": frozenset({1})}
    # The same calls freeing their values right after the last read: all outermost.
    lean = U.Values(values.made, [1, 4] + [-1] * 6, values.nbytes, values.reads, saves)
    assert U.choose([(0, 5)], [a, b, b_inner], lean) == {"a": frozenset({1}),
                                                         "b": frozenset({1})}
    # An unsafe call (it writes a tensor from outside it) is never a unit.
    unsafe = U.Call("a", 1, 0, 3, False)
    assert "a" not in U.choose([(0, 5)], [unsafe, b], lean)


def test_a_replay_stops_at_the_last_save() -> None:
    """Ops 0..5 in one call: ops 0-3 make 10-byte values op 4 saves as inputs (before it runs,
    op count 4); ops 4 and 5 make 1000-byte values nothing saves. The op tape stops after op
    3, and so does the call, at its last save: the 1000 bytes are never made again, and the
    call fits. Saved by an op after the call (after it ended), its output is needed: the
    call and the tape replay whole."""
    saves = [(4, v, False) for v in range(4)]
    values = U.Values(made=list(range(6)), freed=[-1] * 4 + [6, -1],
                      nbytes=[10] * 4 + [1000, 1000], reads=[[4]] * 4 + [[5], [6]], saves=saves)
    call = U.Call("block", 1, 0, 6, True)
    assert U._tape_end(0, 6, values) == 4
    assert U._replay_end(0, 6, [call], values) == (4, [U.Call("block", 1, 0, 4, True)])
    assert U.choose([(0, 6)], [call], values) == {"block": frozenset({1})}
    # Op 6 (outside the call, inside the region) saves the call's output (value 5).
    out_saved = U.Values(values.made, values.freed, values.nbytes, values.reads,
                         [*saves, (6, 5, True)])
    assert U._tape_end(0, 6, out_saved) == 6
    assert U._replay_end(0, 6, [call], out_saved) == (6, [call])


# --- the room the plan leaves below its peak ----------------------------------------------------


def test_cells_holding_their_gates_are_units_within_the_plans_room() -> None:
    """memplan's LSTM cells hold their gates (``chunk`` views) to the call's end, one op past
    the op tape's last read: over the op tape there, so no cell is a unit when the plan says
    nothing of the room its step leaves below its peak (``replay_headroom_bytes`` 0). With
    the room ``memplan.plan`` evaluates, cells are units, and the step peaks at the plan's
    prediction to the byte with gradients equal to the plain step's."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(8, 4, 8, generator=gen), torch.randint(0, 10, (8, 4), generator=gen)
    torch.manual_seed(0)
    model = LSTM(input_size=8, hidden=32, layers=2, num_classes=10)
    plain = copy.deepcopy(model)
    plain(x, target).backward()
    plan = memplan.plan(model, x, target, loss_fn=_same, planner="sqrt")
    assert any(st.replay_headroom_bytes > 0 for st in plan.stages)
    strict = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, replay_headroom_bytes=0) for st in plan.stages))
    for p, cells in ((strict, 0), (plan, None)):
        m = memplan.apply(copy.deepcopy(model), p)
        units = applied_state(m).layout.units  # type: ignore[union-attr]
        found = sum(len(units.get(f"cells.{i}", ())) for i in range(2))
        assert found == cells if cells is not None else found > 0
        measured = memplan.measure(m, x, target, loss_fn=_same, simulate=False, repeat=1)
        assert measured.peak_bytes == p.peak_bytes
        m(x, target).backward()
        for a, b in zip(plain.parameters(), m.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]


def test_a_call_over_the_tape_is_a_unit_within_its_room() -> None:
    """The made-up call A of ``test_a_call_holding_a_dead_value_goes_to_the_tape`` holds a
    100-byte value two ops past the tape's last read: a unit where the step has 100 bytes of
    room at those ops, not where it has 99."""
    saves = [(i + 1, 2 + i, False) for i in range(6)]
    values = U.Values(made=[0, 3] + list(range(6)), freed=[3, 6] + [-1] * 6,
                      nbytes=[100, 100] + [10] * 6,
                      reads=[[r] for r in [0, 3] + list(range(6))], saves=saves)
    a, b = U.Call("a", 1, 0, 3, True), U.Call("b", 1, 3, 6, True)
    assert U.choose([(0, 5)], [a, b], values, [100] * 6) == {"a": frozenset({1}),
                                                             "b": frozenset({1})}
    assert U.choose([(0, 5)], [a, b], values, [99] * 6) == {}
    assert U.choose([(0, 5)], [a, b], values, [100] * 3 + [0] * 3) == {"a": frozenset({1})}


def test_the_op_tape_frees_what_only_ops_after_the_region_read() -> None:
    """Ops 0..5: op 0 makes a 100-byte mask that op 1 (in call A, ops 1-3, given the mask)
    reads, and op 8, after the region, reads again (HF MegatronBert's attention mask, read by
    every layer). The op tape's replay frees it after op 1: op 8 reads the forward's own
    mask. Unit A holds it to its end, 100 bytes over the tape at ops 2 and 3: a unit only
    where the plan leaves that room there. (Counting the mask alive to the region's end for
    the tape too hid that excess: 24,448 B over MegatronBert's plan.)"""
    values = U.Values(made=list(range(6)), freed=[9] + [-1] * 5, nbytes=[100] + [10] * 5,
                      reads=[[1, 8]] + [[i] for i in range(1, 6)],
                      saves=[(i + 1, i, False) for i in range(1, 6)])
    a = U.Call("a", 1, 1, 4, True, args=(0,))
    assert U.choose([(0, 5)], [a], values, [0] * 6) == {}
    assert U.choose([(0, 5)], [a], values, [100] * 6) == {"a": frozenset({1})}
