"""An applied model as users hold it (issue 12): no leak when a forward is not fully
backpropagated, copies and pickles that run on their own weights, tensors changed in place
after a recomputed scope read them, inputs other than the plan's, Python state of the
forward."""

from __future__ import annotations

import copy
import functools
import gc
import io
import json
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan
from memplan.core.plan_schema import MAX_SPEC_DEPTH
from memplan.errors import PlanInvalid
from memplan.runtime.apply import applied_state
from memplan.runtime.tape import Scope
from memplan.tracing.tracer import StepTracer

# --- a user model: residual blocks (one stage each), dropout, an auxiliary output -------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self, d: int = 32, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        for b in self.blocks:
            x = b(x)
        return {"logits": self.head(x), "aux": x.sigmoid().mean()}


def loss_fn(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["logits"].square().mean()  # the auxiliary output is ignored


def _inputs(batch: int = 16) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 32, generator=torch.Generator().manual_seed(1)),)


@functools.cache
def _plan(planner: str, budget: int | None = None) -> memplan.Plan:
    return memplan.plan(Net(), *_inputs(), loss_fn=loss_fn, planner=planner, budget=budget)


def _net(planner: str | None, budget: int | None = None) -> Net:
    torch.manual_seed(0)
    model = Net()
    if planner is not None:
        memplan.apply(model, _plan(planner, budget))
    return model


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def _step(model: nn.Module, x: tuple[Any, ...], seed: int = 3) -> list[torch.Tensor | None]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss_fn(model(*x)).backward()  # type: ignore[no-untyped-call]
    return _grads(model)


# --- 1. nothing of a forward outlives its graph ------------------------------------------------


def _skip_some(model: nn.Module, x: tuple[Any, ...], step: int) -> None:
    loss = loss_fn(model(*x))
    if step % 3:  # a NaN guard skipping backward on some steps
        loss.backward()  # type: ignore[no-untyped-call]


def _retain(model: nn.Module, x: tuple[Any, ...], step: int) -> None:
    loss_fn(model(*x)).backward(retain_graph=True)  # type: ignore[no-untyped-call]


def _aux_ignored(model: nn.Module, x: tuple[Any, ...], step: int) -> None:
    out = model(*x)
    out["logits"].square().mean().backward()
    assert out["aux"].requires_grad  # its part of the graph is never backpropagated


def _no_backward(model: nn.Module, x: tuple[Any, ...], step: int) -> None:
    model(*x)


PATTERNS: dict[str, Callable[[nn.Module, tuple[Any, ...], int], None]] = {
    "skip-backward": _skip_some, "retain-graph": _retain, "aux-output": _aux_ignored,
    "no-backward": _no_backward}
STEPS, WARM = 200, 10


class LiveBytes(TorchDispatchMode):  # type: ignore[misc]
    """Bytes of the storages ops made that are still alive (StepTracer's count, lean)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._see(a, 0)  # from before: a parameter, an input (not counted)
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self._see(o, 1)
        return out

    def _see(self, t: torch.Tensor, count: int) -> None:
        storage = t.untyped_storage()
        if storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            nbytes = storage.nbytes() * count
            self.live += nbytes
            weakref.finalize(storage, self._free, storage._cdata, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def _live_bytes(model: nn.Module, pattern: str) -> list[int]:
    """Live storage bytes after each of STEPS steps, outputs dropped. The cyclic collector is
    off: what a step made must die by reference counting, as in plain PyTorch."""
    x = _inputs()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    lives = []
    gc.collect()
    gc.disable()
    try:
        with LiveBytes() as tracker:
            for step in range(STEPS):
                opt.zero_grad()
                PATTERNS[pattern](model, x, step)
                opt.step()
                lives.append(tracker.live)
    finally:
        gc.enable()
    return lives


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_forwards_not_fully_backpropagated_do_not_leak(pattern: str) -> None:
    plain = _live_bytes(_net(None), pattern)
    assert all(plain[i] == plain[i - 3] for i in range(WARM + 3, STEPS))  # flat (period 3)
    for planner in ("optimal", "recursive", "drop-cheap"):
        model = _net(planner)
        plan = applied_state(model).plan  # type: ignore[union-attr]
        assert any(s.mode != "keep" for s in plan.stages)
        lives = _live_bytes(model, pattern)
        assert lives[WARM:] == plain[WARM:], planner
        del model
        gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Scope]


def test_kept_and_recomputed_stages_free_everything_without_backward() -> None:
    """The optimal plan at a middle budget keeps some stages and recomputes others: after a
    forward without backward and ``del out`` every storage it made is freed."""
    least = memplan.plan(Net(), *_inputs(), loss_fn=loss_fn, planner="optimal")
    budget = (least.peak_bytes + least.plain_peak_bytes) // 2
    model = _net("optimal", budget=budget)
    modes = {s.mode for s in applied_state(model).plan.stages}  # type: ignore[union-attr]
    assert "keep" in modes and modes - {"keep"}
    x = _inputs()
    tracer = StepTracer()
    with tracer:
        out = model(*x)
        made = tracer.live_bytes
        del out
        gc.collect()
        after = tracer.live_bytes
    tracer.close()
    assert made > after
    assert after == sum(v.nbytes for v in tracer.values if v.birth < 0 and v.death is None)


# --- 2. copies, pickles, state_dict ------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_of_an_applied_model_runs_on_its_own_weights(how: str) -> None:
    model = _net("recursive")
    x = _inputs()
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert applied_state(twin) is not None and applied_state(twin) is not applied_state(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ref = _net(None)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    before = [p.detach().clone() for p in model.parameters()]
    assert _equal(_step(twin, x), _step(ref, x))  # the copy's weights, the copy's grads
    assert all(p.grad is None for p in model.parameters())  # nothing written to the original
    assert _equal([p.detach() for p in model.parameters()], before)
    assert applied_state(twin).last is not None  # type: ignore[union-attr]
    assert applied_state(model).last is None  # type: ignore[union-attr]
    assert _equal(_step(model, x), _step(_net(None), x))
    # state_dict keys are those of a plain model; unapply works on the copy.
    assert list(twin.state_dict()) == list(_net(None).state_dict())
    memplan.unapply(twin)
    assert "forward" not in twin.__dict__ and applied_state(twin) is None
    assert _equal(_step(twin, x), _step(ref, x))


def test_ema_snapshot_by_deepcopy_follows_its_own_weights() -> None:
    model = _net("optimal")
    ema = copy.deepcopy(model)
    x = _inputs()
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    out = ema(*x)["logits"]
    assert torch.equal(out, torch.zeros_like(out))


# --- 3. tensors changed in place after a recomputed scope read them ---------------------------


class Centered(nn.Module):
    """Running-mean centering: the buffer is updated under no_grad after it was used."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("center", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x - self.center))
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * x.mean(0))
        return x + y


class Normalised(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Centered(d) for _ in range(depth))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def _mean_sq(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("planner", ["sqrt", "recursive", "drop-cheap", "optimal"])
def test_buffer_updated_after_use_gives_plain_gradients(planner: str) -> None:
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(2)),)
    torch.manual_seed(0)
    ref = Normalised()
    torch.manual_seed(0)
    model = Normalised()
    plan = memplan.plan(model, *x, loss_fn=_mean_sq, planner=planner)
    assert any(s.mode != "keep" for s in plan.stages)
    memplan.apply(model, plan)
    for _ in range(3):
        for m in (ref, model):
            for p in m.parameters():
                p.grad = None
            _mean_sq(m(*x)).backward()  # type: ignore[no-untyped-call]
        assert _equal(_grads(model), _grads(ref))
        assert _equal(list(model.buffers()), list(ref.buffers()))


class Masked(nn.Module):
    """A non-grad input read by the first blocks and changed in place by the last one."""

    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for i, fc in enumerate(self.fcs):
            x = x + fc(x + mask)  # autograd saves fc's input, not the mask
            if i == len(self.fcs) - 2:
                mask.mul_(0.5)  # a later block changes the input in place
        return x


def _masked(planner: str) -> tuple[Masked, Masked, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    x, mask = torch.randn(8, 16, generator=g), (torch.rand(8, 16, generator=g) > 0.3).float()
    torch.manual_seed(0)
    ref = Masked()
    torch.manual_seed(0)
    model = Masked()
    memplan.apply(model, memplan.plan(model, x, mask.clone(), loss_fn=_mean_sq,
                                      planner=planner))
    return ref, model, (x, mask)


def test_input_changed_in_place_inside_a_recomputed_scope_is_read_as_it_was() -> None:
    """sqrt recomputes every block: the write is recorded, the value before it is kept."""
    ref, model, (x, mask) = _masked("sqrt")
    modes = [s.mode for s in applied_state(model).plan.stages]  # type: ignore[union-attr]
    assert modes[:4] == ["recompute"] * 4
    _mean_sq(ref(x, mask.clone())).backward()  # type: ignore[no-untyped-call]
    _mean_sq(model(x, mask.clone())).backward()  # type: ignore[no-untyped-call]
    assert _equal(_grads(model), _grads(ref))


def test_input_changed_in_place_by_a_kept_stage_is_named() -> None:
    """optimal recomputes the first block only; a kept block changes the mask after it: the
    replay cannot have the old value and says which tensor and how to fix it."""
    _, model, (x, mask) = _masked("optimal")
    modes = [s.mode for s in applied_state(model).plan.stages]  # type: ignore[union-attr]
    assert modes[:3] == ["recompute", "keep", "keep"]
    loss = _mean_sq(model(x, mask.clone()))
    with pytest.raises(memplan.MemplanError, match=r"input 1 of the model's forward.*changed "
                       r"in place afterwards.*Clone it"):
        loss.backward()  # type: ignore[no-untyped-call]


# --- 4. inputs other than the plan's -----------------------------------------------------------


def test_other_batch_warns_with_the_new_peak_once() -> None:
    model = _net("optimal")
    plan = applied_state(model).plan  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, _inputs())  # the plan's inputs: silent
    with pytest.warns(UserWarning, match=r"made for inputs \[16, 32\] float32.*\[64, 32\]") as rec:
        _step(model, _inputs(64))
    message = str(rec[0].message)
    assert "predicted peak" in message and "memplan.plan(" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, _inputs(64))  # once per input shape
    assert plan.peak_bytes > 0


def test_other_batch_at_apply_time_warns() -> None:
    model = Net()
    plan = memplan.plan(model, *_inputs(), loss_fn=loss_fn, planner="sqrt")
    with pytest.warns(UserWarning, match=r"\[64, 32\]"):
        memplan.apply(model, plan, inputs=_inputs(64))


def test_plan_of_another_model_with_other_inputs_is_a_plan_mismatch() -> None:
    plan = memplan.plan(Net(), *_inputs(), loss_fn=loss_fn, planner="sqrt")
    other = Normalised()  # its first layer takes 16 features, the plan's input has 32
    with pytest.raises(memplan.MemplanError, match="another model or other inputs"):
        memplan.apply(other, plan)
    assert "forward" not in other.__dict__ and applied_state(other) is None


class WithOptions(Net):
    """A forward whose trailing arguments default to containers (x-transformers' wrappers
    take ``embed_ids: dict = {}``), as ``inspect.signature(...).bind`` fills them in."""

    def forward(self, x: torch.Tensor, extra: dict[str, Any] | None = None,
                scales: tuple[Any, ...] = ()) -> dict[str, torch.Tensor]:
        for s in scales:
            x = x * (s if isinstance(s, float) else 1.0)
        if extra and "shift" in extra:
            x = x + extra["shift"][0]
        return super().forward(x)


def test_plan_file_with_container_inputs_applies_without_inputs() -> None:
    shift = torch.randn(1, 32)
    inputs = (*_inputs(), {"shift": [shift, None], "names": {}}, (1.0, 2))
    plan = memplan.plan(WithOptions(), *inputs, loss_fn=loss_fn, planner="sqrt")
    loaded = memplan.Plan.from_json(plan.to_json())
    torch.manual_seed(0)
    model = memplan.apply(WithOptions(), loaded)  # checked against inputs rebuilt from specs
    torch.manual_seed(0)
    plain = WithOptions()
    assert all(torch.equal(a, b) for a, b in zip(_step(model, inputs), _step(plain, inputs)))


def test_input_specs_nest_to_a_bound() -> None:
    deep: Any = 1.0
    for _ in range(12):
        deep = [deep]
    plan = memplan.plan(WithOptions(), *_inputs(), None, (deep,), loss_fn=loss_fn,
                        planner="sqrt")
    spec = json.dumps(json.loads(plan.to_json())["forward"]["inputs"][2])
    assert spec.count('{"list"') == MAX_SPEC_DEPTH - 1 and '"type": "list"' in spec
    memplan.Plan.from_json(plan.to_json())  # its own file loads
    raw = json.loads(plan.to_json())
    nested: Any = {"value": 1}
    for _ in range(MAX_SPEC_DEPTH + 1):
        nested = {"list": [nested]}
    raw["forward"]["inputs"][2] = nested
    with pytest.raises(PlanInvalid, match="nested at most"):
        memplan.Plan.from_json(json.dumps(raw))


# --- 5. Python state a forward mutates ---------------------------------------------------------


class Counting(Net):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.last_input_shape: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        self.last_input_shape = tuple(x.shape)
        return super().forward(x)


def test_plan_and_apply_leave_python_state_as_it_was() -> None:
    model = Counting()
    plan = memplan.plan(model, *_inputs(), loss_fn=loss_fn, planner="sqrt")
    memplan.measure(model, *_inputs(), loss_fn=loss_fn)
    memplan.apply(model, plan)
    assert model.calls == 0 and model.last_input_shape is None
    _step(model, _inputs())
    assert model.calls == 1
