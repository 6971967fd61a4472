"""``memplan bench``: sweep a built-in model over a size, plain PyTorch beside memplan's plans
and (``--peers``) the checkpointing people use today, all measured with the same tracker in the
same run. Simulated (fake tensors, any size) or real (CPU or CUDA, with step times)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memplan import models
from memplan.analysis.peers import compile_budget, describe, peer_workload
from memplan.api import plan as make_plan
from memplan.core.budget import budget_from_text
from memplan.core.plan import Plan
from memplan.errors import BudgetTooSmall, MemplanError, bad_arg
from memplan.models import Workload
from memplan.runtime.apply import apply
from memplan.tracing.capture import capture
from memplan.tracing.device import check_device
from memplan.tracing.measure import measure
from memplan.tracing.timing import step_times

Row = dict[str, Any]
SIZE_KEYS = {"resnet": "depth", "lstm": "steps", "gpt": "layers"}
# Defaults: paper scale when simulated; small enough for a 2-core CPU when real.
SIM_DEFAULTS: dict[str, tuple[dict[str, Any], list[int]]] = {
    "resnet": ({"batch": 32}, [50, 101, 152, 200, 512, 1000]),
    "lstm": ({}, [64, 128, 256, 512]),
    "gpt": ({"batch": 8}, [6, 12, 24]),
}
REAL_DEFAULTS: dict[str, tuple[dict[str, Any], list[int]]] = {
    "resnet": ({"batch": 4, "image": 64, "classes": 100}, [26, 50, 101]),
    "lstm": ({"batch": 16, "hidden": 256, "input": 50, "classes": 500}, [32, 64, 128]),
    "gpt": ({"batch": 4, "d_model": 128, "heads": 4, "seq_len": 128, "vocab": 1000}, [4, 8, 16]),
}
QUICK_DEFAULTS: dict[str, tuple[dict[str, Any], list[int]]] = {  # seconds, for tests
    "resnet": ({"batch": 2, "image": 32, "classes": 10}, [14, 26]),
    "lstm": ({"batch": 2, "hidden": 32, "input": 8, "classes": 10}, [4, 8]),
    "gpt": ({"batch": 2, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 100}, [2, 4]),
}
PLAIN = "plain PyTorch"


@dataclass
class BenchConfig:
    model: str
    base: dict[str, Any]
    key: str
    sizes: list[int]
    real: bool = False
    device: str = "cpu"
    peers: bool = False
    compile_budgets: tuple[float, ...] = ()
    budget: str | None = None
    planners: tuple[str, ...] = ("sqrt", "optimal")
    repeat: int = 3
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "real" if self.real else "simulated"


def defaults(model: str, real: bool, quick: bool) -> tuple[dict[str, Any], list[int]]:
    """Fixed parameters and sizes of a model's default sweep."""
    table = QUICK_DEFAULTS if quick else REAL_DEFAULTS if real else SIM_DEFAULTS
    base, sizes = table[model]
    return dict(base), list(sizes)


def parse_sweep(model: str, sweep: str | None, default_sizes: list[int]) -> tuple[str, list[int]]:
    """``depth=50,101,152`` -> ('depth', [50, 101, 152]); the model's default when None."""
    default_key = SIZE_KEYS[model]
    if sweep is None:
        return default_key, default_sizes
    key, eq, values = sweep.partition("=")
    fix = f"Write e.g. --sweep {default_key}=" + ",".join(
        str(v) for v in SIM_DEFAULTS[model][1][:3]) + "."
    if not eq or not key.strip():
        raise bad_arg("--sweep", "KEY=INT,INT,...", sweep, fix)
    if key.strip() not in models.defaults(model):
        raise bad_arg("--sweep", f"a {model} parameter {sorted(models.defaults(model))}",
                      key.strip(), fix)
    try:
        sizes = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise bad_arg("--sweep", "integers after '='", values, fix) from None
    if not sizes or min(sizes) < 1:
        raise bad_arg("--sweep", "one or more integers >= 1", values, fix)
    return key.strip(), sizes


def check_bench_device(device: str, real: bool) -> None:
    """A device present here; simulated runs allocate nothing, so only real ones use a GPU."""
    dev = check_device(device, "--device")
    if dev.type != "cpu" and not real:
        raise bad_arg("--device", "cpu with --simulate (fake tensors allocate nothing)", device,
                      "Add --real to run on the GPU.")


def workload(cfg: BenchConfig, size: int) -> Workload:
    return models.get(cfg.model, **{**cfg.base, cfg.key: size})


def method_count(cfg: BenchConfig) -> int:
    return 1 + len(cfg.planners) + (2 if cfg.peers else 0) + len(cfg.compile_budgets)


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> list[Row]:
    """All rows of the sweep; ``progress(label)`` is called after each row."""
    tick = progress or (lambda label: None)
    rows: list[Row] = []
    for size in cfg.sizes:
        rows += size_rows(cfg, size, tick)
    return rows


def size_rows(cfg: BenchConfig, size: int, tick: Callable[[str], None]) -> list[Row]:
    w = workload(cfg, size)
    t0 = time.perf_counter()
    graph = capture(w)
    capture_s = time.perf_counter() - t0
    base = {"model": cfg.model, "size_key": cfg.key, "size": size, "spec": w.spec,
            "mode": cfg.mode, "device": cfg.device if cfg.real else "cpu (fake tensors)"}
    rows: list[Row] = []

    def add(method: str, detail: str, seconds: float, **values: Any) -> None:
        rows.append({**base, "method": method, "detail": detail, "seconds": round(seconds, 2),
                     **values})
        tick(f"{cfg.key}={size} {method}")

    # Real runs keep each eager variant's model to time them all round-robin at the end.
    timed: list[tuple[int, Any, tuple[Any, ...]]] = []

    def measure_variant(wl: Workload) -> dict[str, Any]:
        return measure_workload(wl, cfg, lambda m, x: timed.append((len(rows), m, x)))

    plain_peak = int(graph.peak_bytes)
    t0 = time.perf_counter()
    plain = measure_variant(w) if cfg.real else {"measured_peak_bytes": plain_peak}
    add(PLAIN, "no checkpointing", capture_s + time.perf_counter() - t0,
        predicted_peak_bytes=None, extra_flops=0, extra_pct=0.0, **plain)
    for method, detail, seconds, values in plan_rows(cfg, w, graph, measure_variant):
        add(method, detail, seconds, **values)
    if cfg.peers:
        for peer, label in (("checkpoint_sequential", "torch checkpoint_sequential"),
                            ("per-block", "torch per-block checkpoint")):
            t0 = time.perf_counter()
            values = measure_variant(peer_workload(w, peer))
            add(label, describe(w, peer), time.perf_counter() - t0, predicted_peak_bytes=None,
                extra_flops=None, extra_pct=None, **values)
    for budget in cfg.compile_budgets:
        t0 = time.perf_counter()
        values = compile_values(w, cfg, budget)
        add(f"torch.compile amb={budget:g}", "activation_memory_budget", time.perf_counter() - t0,
            predicted_peak_bytes=None, extra_flops=None, extra_pct=None, **values)
    if timed:
        times = step_times([(m, x) for _, m, x in timed], w.loss, cfg.repeat, cfg.device)
        for (i, _, _), seconds in zip(timed, times):
            rows[i]["step_time_s"] = seconds
        del timed[:]
        free_device(cfg.device)
    plain_time = rows[0].get("step_time_s")
    for r in rows:
        measured = r.get("measured_peak_bytes")
        ref = r.get("allocator_peak_bytes") or measured
        plain_ref = plain.get("allocator_peak_bytes") or plain.get("measured_peak_bytes")
        r["plain_over_peak"] = round(plain_ref / ref, 2) if ref and plain_ref else None
        t = r.get("step_time_s")
        r["time_vs_plain"] = round(t / plain_time, 3) if t and plain_time else None
    del graph
    gc.collect()
    return rows


def plan_rows(cfg: BenchConfig, w: Workload, graph: Any,
              measure_variant: Callable[[Workload], dict[str, Any]]
              ) -> Iterator[tuple[str, str, float, dict[str, Any]]]:
    """(method, detail, seconds, values) per planner: sqrt without a budget, the others at
    ``--budget`` or, without one, at the sqrt plan's peak."""
    at: object = budget_from_text(cfg.budget)
    for name in sorted(cfg.planners, key=lambda n: n != "sqrt"):
        t0 = time.perf_counter()
        budget = None if name == "sqrt" else at
        try:
            plan = make_plan(graph, planner=name, budget=budget)
        except BudgetTooSmall as err:
            yield (f"memplan {name}", f"budget {cfg.budget or at}", time.perf_counter() - t0,
                   {"predicted_peak_bytes": None, "extra_flops": None, "extra_pct": None,
                    "note": f"does not fit: least feasible peak {err.least_peak_bytes} B"})
            continue
        if name == "sqrt" and cfg.budget is None:
            at = plan.peak_bytes
        values: dict[str, Any] = {
            "predicted_peak_bytes": plan.peak_bytes, "extra_flops": plan.extra_flops,
            "extra_pct": round(100 * plan.extra_fraction, 2)}
        try:
            values.update(measure_variant(applied_workload(w, plan)))
        except MemplanError as err:
            values["note"] = f"apply failed: {err}"
        detail = (f"{plan.params}" if budget is None else
                  f"budget {plan.budget_bytes} B" + (" (sqrt's peak)" if cfg.budget is None
                                                     else ""))
        yield f"memplan {name}", detail, time.perf_counter() - t0, values


def applied_workload(w: Workload, plan: Plan) -> Workload:
    """``w`` with its model built under ``plan`` (``memplan.apply``)."""
    def build() -> Any:
        return apply(w._build_model(), plan)

    return Workload(w.name, w.params, build, w._build_inputs, w._loss)


def measure_workload(w: Workload, cfg: BenchConfig,
                     keep: Callable[[Any, tuple[Any, ...]], None] | None = None
                     ) -> dict[str, Any]:
    """Peak (tracker) of one step of ``w``; real runs add the CUDA allocator's peak and the
    device name, and either hand the model to ``keep`` (to be timed later, round-robin with
    the other variants) or time it here: the median step (CUDA events on CUDA)."""
    if not cfg.real:
        return {"measured_peak_bytes": measure(w, simulate=True).peak_bytes}
    model, inputs = on_device(w, cfg.device)
    cuda = cfg.device != "cpu"
    report = measure(model, *inputs, loss_fn=w.loss, simulate=False, device=cfg.device,
                             repeat=1)
    values: dict[str, Any] = {"measured_peak_bytes": report.peak_bytes}
    if cuda:
        values["allocator_peak_bytes"] = report.allocator_peak_bytes
        values["device_name"] = report.device_name
    if keep is not None:
        keep(model, inputs)
    else:
        values["step_time_s"] = step_times([(model, inputs)], w.loss, cfg.repeat,
                                           cfg.device)[0]
    del model, inputs
    free_device(cfg.device)
    return values


def on_device(w: Workload, device: str) -> tuple[Any, tuple[Any, ...]]:
    model = w.build_model().to(device)
    inputs = tuple(x.to(device) for x in w.build_inputs())
    return model, inputs


def free_device(device: str) -> None:
    gc.collect()
    if device != "cpu":
        torch.cuda.empty_cache()


def compile_values(w: Workload, cfg: BenchConfig, budget: float) -> dict[str, Any]:
    """torch.compile under ``activation_memory_budget``. The peak is taken outside the tracker
    (compiled kernels allocate past the dispatcher): the CUDA allocator's peak on CUDA; on CPU
    no peak is measurable, only the step time."""
    if not cfg.real:
        raise bad_arg("--compile", "a real run (--real)", "--simulate",
                      "torch.compile cannot run on fake tensors: add --real.")
    with compile_budget(budget):
        model, inputs = on_device(w, cfg.device)
        compiled: Any = torch.compile(model)
        cuda = cfg.device != "cpu"
        t0 = time.perf_counter()
        w.loss(compiled(*inputs)).backward()  # type: ignore[no-untyped-call]  # compiles
        values: dict[str, Any] = {"note": f"compile {time.perf_counter() - t0:.1f} s"}
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            w.loss(compiled(*inputs)).backward()  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            values["allocator_peak_bytes"] = torch.cuda.max_memory_allocated() - base
            values["device_name"] = torch.cuda.get_device_name()
        else:
            values["note"] += "; peak not measurable on CPU (use --device cuda)"
        # Timed here, inside the budget's context: leaving it resets dynamo's caches.
        values["step_time_s"] = step_times([(compiled, inputs)], w.loss, cfg.repeat,
                                           cfg.device)[0]
        del model, compiled, inputs
    free_device(cfg.device)
    return values


def default_out(cfg: BenchConfig) -> Path:
    return Path("out") / "bench" / f"{cfg.model}-{cfg.mode}-{cfg.device.replace(':', '')}"
