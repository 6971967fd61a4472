"""memplan inside the stacks users train with: torch.compile (eager and inductor backends),
the recipe scripts of docs/recipes.md, and the guards for orders that cannot work."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import memplan
from memplan.runtime.apply import applied_state
from tests.small import small

ROOT = Path(__file__).resolve().parents[2]


def _step(model: Any, x: tuple[Any, ...], loss_fn: Any, seed: int = 1) -> list[Any]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = loss_fn(model(*x))
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()] + [torch.get_rng_state()]


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_applied_model_keeps_the_plan(backend: str) -> None:
    """torch.compile(memplan.apply(model, plan)): gradients bit-equal to the eager applied
    model and to plain eager; the same ops recorded for recomputation (the compiler did not
    re-partition or drop the plan); the measured peak equal to the eager applied model's and
    within the budget."""
    w = small("gpt", dropout=0.1)
    x = w.build_inputs()
    graph = memplan.capture(w)
    least = memplan.plan(graph)
    plan = memplan.plan(graph, budget=(least.peak_bytes + least.plain_peak_bytes) // 2)
    assert any(s.mode != "keep" for s in plan.stages)
    plain = w.build_model()
    eager = memplan.apply(w.build_model(), plan)
    inner = memplan.apply(w.build_model(), plan)
    compiled = torch.compile(inner, backend=backend)

    ref = _step(plain, x, w.loss)
    assert _equal(_step(compiled, x, w.loss), ref)
    assert _equal(_step(eager, x, w.loss), ref)
    got_state, eager_state = applied_state(inner), applied_state(eager)
    assert got_state is not None and got_state.last is not None and got_state.last.finished
    assert eager_state is not None and eager_state.last is not None
    assert got_state.last.recorded_ops == eager_state.last.recorded_ops > 0

    peak = memplan.measure(compiled, *x, loss_fn=w.loss, simulate=False).peak_bytes
    assert peak == memplan.measure(eager, *x, loss_fn=w.loss, simulate=False).peak_bytes
    assert plan.budget_bytes is not None and peak <= plan.budget_bytes

    # Inference is compiled as usual and runs the model's own forward, not the plan.
    got_state.last = None
    compiled.eval()
    with torch.no_grad():
        compiled(*x)
    assert got_state.last is None


def test_applying_to_a_compiled_model_is_refused() -> None:
    w = small("gpt")
    plan = memplan.plan(memplan.capture(w), planner="sqrt")
    compiled = torch.compile(w.build_model(), backend="eager")
    with pytest.raises(memplan.MemplanError, match="torch.compile wrapper"):
        memplan.apply(compiled, plan)


def test_planned_forward_keeps_the_model_signature() -> None:
    """HF Trainer drops dataset columns the forward does not name: keep the signature."""
    import inspect

    w = small("gpt")
    model = w.build_model()
    before = inspect.signature(model.forward)
    memplan.apply(model, memplan.plan(memplan.capture(w), planner="sqrt"))
    assert inspect.signature(model.forward) == before


# --- FSDP: the guard and per-unit application, in one process (world size 1) -------------------


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class _Net(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        out: torch.Tensor = self.head(h)
        return out


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.fixture
def one_rank() -> Any:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.fsdp import fully_shard

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield fully_shard
    finally:
        dist.destroy_process_group()


def test_plan_around_fsdp_units_is_refused(one_rank: Any) -> None:
    fully_shard = one_rank
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 8)
    memplan.apply(model, memplan.plan(model, x, loss_fn=_loss, planner="sqrt"))
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    with pytest.raises(memplan.MemplanError, match="per FSDP unit"):
        model(x)


def test_per_unit_plans_under_fsdp_equal_plain(one_rank: Any) -> None:
    from memplan import distributed as md

    fully_shard = one_rank
    torch.manual_seed(0)
    model = _Net()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8)
    units = [f"blocks.{i}" for i in range(4)]
    plans = md.plan_units(model, units, x, loss_fn=_loss, planner="sqrt")
    assert set(plans.plans) == set(units)
    assert all(any(s.mode != "keep" for s in p.stages) for p in plans.plans.values())
    md.apply_units(model, plans)
    for u in units:
        fully_shard(model.get_submodule(u))
    fully_shard(model)
    for step in range(2):
        ref = _step(plain, (x,), _loss, seed=step)
        got = _step(model, (x,), _loss, seed=step)
        assert torch.equal(ref[0], got[0])
        full = [g.full_tensor() for g in got[1:-1]]
        assert all(torch.equal(a, b) for a, b in zip(ref[1:-1], full))
        assert torch.equal(ref[-1], got[-1])
    st = applied_state(model.blocks[0])
    assert st is not None and st.last is not None and st.last.recorded_ops > 0


# --- the recipe scripts ------------------------------------------------------------------------


def run_example(args: list[str], tmp_path: Path, timeout_s: int = 240) -> dict[str, Any]:
    """Run one script of examples/ and return the JSON it wrote."""
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([*args, "--json", str(out)], check=False, cwd=ROOT, env=env,
                          timeout=timeout_s, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_recipe_plain_loop(tmp_path: Path) -> None:
    r = run_example([sys.executable, "examples/plain_loop.py", "--layers", "2", "--steps",
                     "2"], tmp_path)
    assert r["losses_equal"] and r["weights_equal"]
    assert r["peak_bytes"] <= r["budget_bytes"] < r["plain_peak_bytes"]


def test_recipe_compile(tmp_path: Path) -> None:
    r = run_example([sys.executable, "examples/compile.py", "--backend", "eager", "--layers",
                     "2"], tmp_path)
    assert r["vs_plain"]["equal"] and r["vs_eager_applied"]["equal"]
    assert r["recorded_ops"] == r["eager_recorded_ops"] > 0
    assert r["peak_bytes"] == r["eager_applied_peak_bytes"] <= r["budget_bytes"]
