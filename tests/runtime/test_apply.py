"""memplan.apply against plain PyTorch: bit-equal gradients, BatchNorm state and RNG; forward
executions per op equal to the plan's mirror counts; measured peak equal to the prediction."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
from memplan.core import schedule as S
from memplan.core.evaluate import replay_counts
from memplan.core.graph import Graph
from memplan.models import Workload
from memplan.runtime.apply import applied_state
from tests.small import small

PLANNERS = ["sqrt", "chen", "drop-cheap", "recursive", "optimal"]
MODELS = ["resnet", "lstm", "gpt"]


@functools.cache
def _graph(name: str) -> Graph:
    return memplan.capture(small(name, dropout=0.1))


@functools.cache
def _plan(name: str, planner: str) -> memplan.Plan:
    return memplan.plan(_graph(name), planner=planner)


def _step(w: Workload, model: nn.Module, seed: int = 1) -> dict[str, Any]:
    x = w.build_inputs()
    torch.manual_seed(seed)
    loss = w.loss(model(*x))
    loss.backward()  # type: ignore[no-untyped-call]
    return {
        "loss": loss.detach(),
        "grads": [p.grad for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "rng": torch.get_rng_state(),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["loss"], b["loss"])
    assert len(a["grads"]) == len(b["grads"])
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("planner", PLANNERS)
def test_gradients_bn_state_and_rng_equal_plain(name: str, planner: str) -> None:
    w = small(name, dropout=0.1)
    plain = _step(w, w.build_model())
    model = memplan.apply(w.build_model(), _plan(name, planner))
    planned = _step(w, model)
    _assert_same(plain, planned)
    # Buffers: BatchNorm running stats and num_batches_tracked updated exactly once.
    if name == "resnet":
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
        assert int(bn.num_batches_tracked) == 1


class _Count(TorchDispatchMode):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


# Ops that only forward computation runs (their backward formulas use other ops): each
# execution beyond the first forward is a recomputation.
FORWARD_ONLY = ("aten.convolution.default", "aten.native_batch_norm.default",
                "aten.relu.default", "aten.addmm.default", "aten.sigmoid.default",
                "aten.tanh.default", "aten.native_layer_norm.default", "aten.gelu.default",
                "aten.native_dropout.default")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("planner", PLANNERS)
def test_forward_executions_equal_mirror_counts(name: str, planner: str) -> None:
    graph, plan = _graph(name), _plan(name, planner)
    n_model = plan.forward.ops if plan.forward else 0
    replays = replay_counts(graph, plan)  # mirrored ops, up to each replay's early stop
    want: Counter[str] = Counter()
    for stage in plan.stages:
        cheap = set(stage.recompute_ops)
        for j in range(stage.first_op, min(stage.last_op, n_model - 1) + 1):
            target = graph.ops[j].target
            if target in FORWARD_ONLY:
                extra = (j in cheap) if stage.mode == "drop-cheap" else stage.mirror
                assert replays.get(j, 0) <= extra  # never more than the plan mirrors
                want[target] += 1 + replays.get(j, 0)
    w = small(name, dropout=0.1)
    model = memplan.apply(w.build_model(), plan)
    x = w.build_inputs()
    with _Count() as counter:
        w.loss(model(*x)).backward()  # type: ignore[no-untyped-call]
    got = Counter({t: counter.calls[t] for t in want})
    assert got == want
    assert sum(want.values()) > 0


def _measured(w: Workload, model: nn.Module, simulate: bool) -> int:
    return memplan.measure(model, *w.build_inputs(), loss_fn=w.loss, simulate=simulate).peak_bytes


@pytest.mark.parametrize("name,planner", [(n, p) for p in PLANNERS for n in MODELS])
def test_measured_peak_matches_prediction(name: str, planner: str) -> None:
    w = small(name, dropout=0.1)
    plan = _plan(name, planner)
    model = memplan.apply(w.build_model(), plan)
    for simulate in (False, True):
        measured = _measured(w, model, simulate)
        assert measured <= plan.peak_bytes * 1.02, (simulate, measured)  # fits, always
        assert abs(measured - plan.peak_bytes) <= 0.02 * plan.peak_bytes, (simulate, measured)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("planner", PLANNERS)
def test_simulated_peak_of_applied_model_equals_real(name: str, planner: str) -> None:
    """The applied model's step on fake tensors allocates exactly what the real one does
    (issue 14.6: BatchNorm statistics were copied only under fake tensors)."""
    w = small(name, dropout=0.1)
    model = memplan.apply(w.build_model(), _plan(name, planner))
    assert _measured(w, model, simulate=True) == _measured(w, model, simulate=False)


def test_optimal_under_budget_fits_and_saves() -> None:
    w = small("gpt", dropout=0.1)
    plain = _measured(w, w.build_model(), simulate=False)
    least = memplan.plan(_graph("gpt"), planner="optimal").peak_bytes
    budget = (least + plain) // 2
    model = memplan.apply(w.build_model(), budget=budget, inputs=w.build_inputs(), loss_fn=w.loss)
    state = applied_state(model)
    assert state is not None and state.plan.budget_bytes == budget
    measured = _measured(w, model, simulate=False)
    assert measured <= budget < plain


def test_plan_for_another_model_is_refused_and_model_untouched() -> None:
    plan = _plan("gpt", "sqrt")
    other = small("gpt", layers=3, dropout=0.1).build_model()
    with pytest.raises(memplan.MemplanError, match="another model"):
        memplan.apply(other, plan)
    assert "forward" not in other.__dict__ and applied_state(other) is None


def test_unapply_restores_the_model() -> None:
    w = small("resnet", dropout=0.1)
    model = w.build_model()
    memplan.apply(model, _plan("resnet", "sqrt"))
    with pytest.raises(memplan.MemplanError, match="already"):
        memplan.apply(model, _plan("resnet", "sqrt"))
    memplan.unapply(model)
    assert "forward" not in model.__dict__ and applied_state(model) is None
    with pytest.raises(memplan.MemplanError, match="not running"):
        memplan.unapply(model)


def test_eval_and_no_grad_run_plainly() -> None:
    w = small("resnet", dropout=0.1)
    model = memplan.apply(w.build_model(), _plan("resnet", "recursive"))
    x = w.build_inputs()
    with torch.no_grad():
        model(*x)
    model.eval()
    model(*x)
    assert applied_state(model).last is None  # type: ignore[union-attr]


def test_bad_arguments_are_named() -> None:
    model = small("resnet").build_model()
    with pytest.raises(memplan.MemplanError, match="budget"):
        memplan.apply(model)
    with pytest.raises(memplan.MemplanError, match="plan JSON"):
        memplan.apply(model, "/nonexistent/plan.json")
    with pytest.raises(memplan.MemplanError, match="budget"):
        memplan.apply(model, _plan("resnet", "sqrt"), budget="1GiB")


def test_plan_json_round_trip_applies(tmp_path: Any) -> None:
    path = tmp_path / "plan.json"
    path.write_text(_plan("lstm", "optimal").to_json())
    w = small("lstm", dropout=0.1)
    _assert_same(_step(w, w.build_model()), _step(w, memplan.apply(w.build_model(), str(path))))


# --- what users' models do ---------------------------------------------------------------------


class Tower(nn.Module):
    """Several inputs (one without a tensor), keyword arguments, a dict output with a
    non-tensor, frozen layers, a long skip connection and dropout."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1))
            for _ in range(depth))
        self.head = nn.Linear(width, 4)
        for p in list(self.inp.parameters()) + list(self.blocks[0].parameters()):
            p.requires_grad_(False)  # adapter-style fine-tuning

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        h = self.inp(x) + y
        skip = h
        for block in self.blocks:
            h = h + block(h)
        return {"logits": self.head(h + skip) * scale, "aux": h.square().mean(), "n": 3}


def _tower_loss(out: dict[str, Any]) -> torch.Tensor:
    return out["logits"].square().mean() + 0.1 * out["aux"]


def _tower_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(4, 8, generator=g), torch.randn(4, 16, generator=g)


def _tower_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> list[Any]:
    torch.manual_seed(5)
    out = model(x, y=y, **kw)
    assert out["n"] == 3
    _tower_loss(out).backward()  # type: ignore[no-untyped-call]
    return [p.grad for p in model.parameters()] + [torch.get_rng_state()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("planner", ["sqrt", "recursive", "optimal", "drop-cheap"])
def test_user_model_with_kwargs_dict_outputs_and_frozen_layers(planner: str) -> None:
    x, y = _tower_inputs()
    torch.manual_seed(0)
    ref = Tower()
    torch.manual_seed(0)
    model = Tower()
    plan = memplan.plan(model, x, y, loss_fn=_tower_loss, planner=planner)
    memplan.apply(model, plan)
    assert _equal(_tower_step(ref, x, y, scale=0.5), _tower_step(model, x, y, scale=0.5))
    assert model.inp.weight.grad is None


@pytest.mark.parametrize("planner", ["recursive", "sqrt"])
def test_autocast_bf16_equals_plain_autocast(planner: str) -> None:
    w = small("gpt", dropout=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = memplan.capture(w)
    plan = memplan.plan(graph, planner=planner)

    def step(model: nn.Module) -> dict[str, Any]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(w, model)

    _assert_same(step(w.build_model()), step(memplan.apply(w.build_model(), plan)))


@pytest.mark.parametrize("planner", ["recursive", "sqrt", "drop-cheap"])
def test_double_backward_equals_plain(planner: str) -> None:
    x, y = _tower_inputs()

    def grad_penalty(model: nn.Module) -> list[Any]:
        torch.manual_seed(5)
        loss = _tower_loss(model(x, y))
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        penalty.backward()  # type: ignore[union-attr]
        return [p.grad for p in params]

    torch.manual_seed(0)
    ref = Tower()
    torch.manual_seed(0)
    model = Tower()
    memplan.apply(model, memplan.plan(model, x, y, loss_fn=_tower_loss, planner=planner))
    assert _equal(grad_penalty(ref), grad_penalty(model))


def test_many_steps_do_not_grow_memory() -> None:
    x, y = _tower_inputs()
    torch.manual_seed(0)
    model = Tower()
    memplan.apply(model, memplan.plan(model, x, y, loss_fn=_tower_loss, planner="recursive"))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def live_tensors() -> int:
        import gc

        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, nn.Parameter))

    peaks = []
    for step in range(1000):
        opt.zero_grad()
        _tower_loss(model(x, y)).backward()  # type: ignore[no-untyped-call]
        opt.step()
        if step in (10, 999):
            peaks.append((live_tensors(), memplan.measure(model, x, y, loss_fn=_tower_loss,
                                                          simulate=False).peak_bytes))
    assert peaks[0] == peaks[1]


class _Scan(nn.Module):
    """A linear recurrence written a time step at a time into a zeros_like output (HF
    RecurrentGemma's RG-LRU): its storage is made once and written in place 8 times."""

    def forward(self, h: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        state = torch.zeros(h.shape[0], h.shape[2])
        for t in range(h.shape[1]):
            state = a[:, t] * state + h[:, t]
            out[:, t] = state
        return out


class _ScanNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x, self.y, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.scan = _Scan()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.y(z))
        return self.o(self.scan(self.x(z), torch.sigmoid(y)) * y)


def test_a_replay_runs_the_writes_of_what_it_gives_back() -> None:
    """A region over the scan and the op that saves its output: the replay stopped after the
    op that made the output's storage, before the 8 writes into it (the runtime's stop read
    makers only; ``core.scopes`` models makers and writers), and gave back zeros: y's
    gradients differed. Every region of one or two stages now gives plain gradients, and a
    step peaks where the plan's evaluation says, to the byte, on real and fake tensors."""
    def regions(n: int) -> Iterator[tuple[S.Item, ...]]:
        for first in range(n - 1):
            for last in range(first, min(first + 2, n - 1)):
                region = S.Region(first, last, tuple(S.Keep(s) for s in range(first, last + 1)))
                yield (*(S.Keep(s) for s in range(first)), region,
                       *(S.Keep(s) for s in range(last + 1, n)))

    checked, modules = _exact_under(_ScanNet(), regions)
    assert checked >= 8 and modules.count("scan") >= 1


def _exact_under(model: nn.Module, schedules: Callable[[int], Iterator[tuple[S.Item, ...]]]
                 ) -> tuple[int, tuple[str, ...]]:
    """Each schedule over the stages of ``model``'s chain (a stage per cut point) applied to
    a copy: plain gradients, and the step's peak the plan's evaluation to the byte, on real
    and fake tensors. The schedules checked, and the stages' modules."""
    from memplan.core import chain as C
    from memplan.core.evaluate import evaluate
    from memplan.core.plan import make_plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    graph = memplan.capture(model, x, loss_fn=_square)
    chain = C.build_chain(graph, list(range(len(graph.cut_points))))
    reference = _plain_step(model, x)
    checked = 0
    for schedule in schedules(chain.n):
        plan = make_plan(chain, schedule, "test", {}, None)
        plan = dataclasses.replace(plan, forward=graph.forward,
                                   peak_bytes=evaluate(graph, plan).peak_bytes)
        applied = memplan.apply(copy.deepcopy(model), plan)
        got = _plain_step(applied, x)
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True)), schedule
        for simulate in (False, True):
            peak = memplan.measure(applied, x, loss_fn=_square, simulate=simulate,
                                   repeat=1).peak_bytes
            assert peak == plan.peak_bytes, (schedule, simulate)
        checked += 1
    return checked, chain.modules


def _square(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _plain_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _square(model(x)).backward()  # type: ignore[no-untyped-call]
    return [p.grad for p in model.parameters() if p.grad is not None]


class _ScaledProjection(nn.Module):
    """HF Gemma3n's per-layer projection: a matmul's output scaled in place (through the
    ``_unsafe_view`` a 3-d matmul returns, which bumps no version counter), then normed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.weight)
        h *= 0.5
        return torch.tanh(h) * h.square().mean(-1, keepdim=True).rsqrt()


class _ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = _ScaledProjection(), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(x))


def test_drop_cheap_recomputes_a_matmul_whose_output_is_written_in_place() -> None:
    """A drop-cheap stage kept the matmul's output for its replay, which the next op then
    scaled in place: the replay scaled it again, and the gradients differed (HF Gemma3n:
    max |diff| 0.095). Such a matmul is recomputed now, in the plan's evaluation as in the
    runtime: every stage drop-cheap on its own gives plain gradients, and the step peaks
    where the evaluation says, to the byte, on real and fake tensors."""
    def drop_cheap(n: int) -> Iterator[tuple[S.Item, ...]]:
        for stage in range(n - 1):
            yield tuple(S.DropCheap(s) if s == stage else S.Keep(s) for s in range(n))

    checked, modules = _exact_under(_ScaledNet(), drop_cheap)
    assert checked >= 2 and modules[0] == "a"


class _DataLoop(nn.Module):
    """Runs its layer once more when its input sums above 0: ops that follow the data, as a
    mixture of experts' loop over the experts its tokens chose (HF Dbrx)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(1 + int(x.sum().item() > 0)):
            x = torch.tanh(self.fc(x))
        return x


def test_apply_follows_the_example_batch_where_ops_follow_the_data() -> None:
    """Without ``inputs=``, apply checks the plan on its input shapes, taking what the
    data-dependent ops returned on the example batch from the plan (``forward.answers``): a
    forward whose ops follow the data runs the plan's ops. A plan file without them (an older
    one) is checked on zeros, where that forward runs others: the error says to pass the
    example inputs, and with them the plan applies."""
    from memplan.errors import PlanMismatch

    model, x = _DataLoop(), torch.ones(4, 8)
    plan = memplan.plan(model, x, loss_fn=_square, planner="sqrt")
    assert plan.forward is not None and plan.forward.answers
    applied = memplan.apply(copy.deepcopy(model), json.loads(plan.to_json()))
    assert all(torch.equal(a, b) for a, b in zip(_plain_step(model, x), _plain_step(applied, x),
                                                 strict=True))
    older = json.loads(plan.to_json())
    del older["forward"]["answers"]
    with pytest.raises(PlanMismatch, match=r"memplan\.apply\(model, plan, inputs=\(\.\.\.\)\)"):
        memplan.apply(copy.deepcopy(model), older)
    applied = memplan.apply(copy.deepcopy(model), older, inputs=(x,))
    assert all(torch.equal(a, b) for a, b in zip(_plain_step(model, x), _plain_step(applied, x),
                                                 strict=True))
