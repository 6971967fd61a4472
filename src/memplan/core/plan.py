"""``Plan``: which stages are kept, recomputed (and how deeply nested), or drop-cheap; plain
data, JSON with a schema version. ``memplan.apply`` runs it; ``explain()`` tells a person why."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.budget import format_bytes
from memplan.core.graph import ForwardSpec
from memplan.core.plan_schema import (
    KIND,
    MAX_FILE_BYTES,
    SCHEMA_VERSION,
    check_plan,
    printable,
    stage_modes,
)
from memplan.errors import PlanInvalid, bad_arg


@dataclass(frozen=True)
class Stage:
    """Forward ops ``first_op`` .. ``last_op`` (inclusive); ``mirror``: how many times the
    stage's activations are recomputed (the paper's m(v), Alg. 2)."""

    index: int
    first_op: int
    last_op: int
    module: str  # module path at the cut that ends the stage
    mirror: int
    mode: str  # "keep" | "drop-cheap" | "recompute"
    saved_bytes: int  # what a plain run keeps for backward
    fwd_flops: int
    recompute_ops: tuple[int, ...] = ()  # drop-cheap: ops whose outputs are recomputed
    boundary: str = "call"  # how the runtime finds its end (graph.CutPoint.kind)
    # While a replay runs the stage's ops, the least the evaluated step stays below the plan's
    # peak: what a replay may keep beyond the op tape's there (``runtime.units``); 0: unknown.
    replay_headroom_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    planner: str
    params: dict[str, Any]
    graph_fingerprint: str
    budget_bytes: int | None
    stages: tuple[Stage, ...]
    schedule: tuple[S.Item, ...]  # nested: Keep / DropCheap / Region(start, end, body)
    peak_bytes: int  # predicted peak of the whole step
    plain_peak_bytes: int
    extra_flops: int  # recomputation FLOPs
    step_flops: int  # FLOPs of the plain forward + backward step
    base_bytes: int  # parameters, buffers, inputs
    predicted_time_s: float | None = None
    notes: tuple[str, ...] = field(default=())
    # The model's forward the plan was made for: ``memplan.apply`` checks a model against it.
    forward: ForwardSpec | None = None

    @property
    def extra_fraction(self) -> float:
        """Recomputation as a fraction of the plain step's FLOPs."""
        return self.extra_flops / self.step_flops if self.step_flops else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "planner", "params", "graph_fingerprint", "budget_bytes", "peak_bytes",
            "plain_peak_bytes", "extra_flops", "step_flops", "base_bytes", "predicted_time_s")}
        d["stages"] = [vars(s) | {"recompute_ops": list(s.recompute_ops)} for s in self.stages]
        d["schedule"] = [S.to_dict(it) for it in self.schedule]
        d["notes"] = list(self.notes)
        d["forward"] = None if self.forward is None else self.forward.to_dict()
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """A plan from its dict (``to_dict``), checked field by field first
        (``memplan.core.plan_schema``): raises PlanInvalid, and only that, when malformed."""
        check_plan(data)
        stages = tuple(Stage(**{**s, "recompute_ops": tuple(s["recompute_ops"])})
                       for s in data["stages"])
        return cls(
            planner=data["planner"], params=dict(data["params"]),
            graph_fingerprint=data["graph_fingerprint"], budget_bytes=data["budget_bytes"],
            stages=stages, schedule=tuple(S.from_dict(d) for d in data["schedule"]),
            peak_bytes=data["peak_bytes"], plain_peak_bytes=data["plain_peak_bytes"],
            extra_flops=data["extra_flops"], step_flops=data["step_flops"],
            base_bytes=data["base_bytes"], predicted_time_s=data["predicted_time_s"],
            notes=tuple(data["notes"]),
            forward=None if data.get("forward") is None else ForwardSpec.from_dict(data["forward"]),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """A plan from its JSON text (``to_json``); PlanInvalid when malformed."""
        if not isinstance(text, (str, bytes)):
            raise PlanInvalid(f"a plan's JSON is text, got {type(text).__name__}; write plans "
                              "with plan.to_json().")
        if len(text) > MAX_FILE_BYTES:
            raise PlanInvalid(f"the plan's JSON is {len(text):,} characters, more than the "
                              f"{MAX_FILE_BYTES:,} a plan may have; write plans with "
                              "plan.to_json().")
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raise PlanInvalid(f"the plan is not JSON ({err.msg} at line {err.lineno}); "
                              "write plans with plan.to_json().") from None
        except (ValueError, RecursionError, UnicodeDecodeError) as err:
            # duplicate keys, integers of over 4300 digits, nesting deeper than Python's stack
            raise PlanInvalid(f"the plan is not valid plan JSON ({type(err).__name__}: "
                              f"{str(err)[:200]}); write plans with plan.to_json().") from None
        return cls.from_dict(data)

    def explain(self) -> str:
        """What is kept, what is recomputed and why, for a person."""
        fwd = sum(s.fwd_flops for s in self.stages)
        lines = [
            f"Plan by {self.planner!r} {self.params} for graph {printable(self.graph_fingerprint)}",
            f"  peak {format_bytes(self.peak_bytes)} (plain {format_bytes(self.plain_peak_bytes)}, "
            f"{self.plain_peak_bytes / max(self.peak_bytes, 1):.1f}x less)"
            + (f", budget {format_bytes(self.budget_bytes)}" if self.budget_bytes else ""),
            (f"  recomputation {self.extra_flops:.3g} FLOPs = {self.extra_fraction:.1%} of the "
             f"plain step = {self.extra_flops / max(fwd, 1):.2f} extra forward passes"),
            f"  always resident: parameters, buffers, inputs {format_bytes(self.base_bytes)}",
        ]
        if self.predicted_time_s is not None:
            lines.append(f"  predicted step time {self.predicted_time_s:.3f} s")
        lines += _explain_items(self.schedule, self.stages, 1)
        lines += [f"  note: {printable(n)}" for n in self.notes]
        return "\n".join(lines)


def _span(stages: tuple[Stage, ...], a: int, b: int) -> str:
    ma, mb = printable(stages[a].module), printable(stages[b].module)
    return f"stage {a} ({ma})" if a == b else f"stages {a}..{b} ({ma} .. {mb})"


def _explain_items(items: tuple[S.Item, ...], stages: tuple[Stage, ...], depth: int) -> list[str]:
    pad = "  " * depth
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            saved = sum(stages[s].saved_bytes for s in run)
            out.append(f"{pad}keep {_span(stages, run[0], run[-1])}: run plainly, keeping "
                       f"{format_bytes(saved)} for backward (memory allows it, no recomputation)")
            run.clear()

    for it in items:
        if isinstance(it, S.Keep):
            run.append(it.stage)
            continue
        flush()
        if isinstance(it, S.DropCheap):
            st = stages[it.stage]
            out.append(f"{pad}drop-cheap {_span(stages, it.stage, it.stage)}: keep conv/matmul "
                       f"outputs, recompute {len(st.recompute_ops)} cheap ops (norms, "
                       "activations, pointwise) in backward: Sec. 4.2")
        else:
            saved = sum(stages[s].saved_bytes for s in range(it.start, it.end + 1))
            out.append(f"{pad}recompute {_span(stages, it.start, it.end)}: keep only its input, "
                       f"drop {format_bytes(saved)} and re-run it in backward (Alg. 1"
                       + (", nested: Sec. 4.4)" if depth > 1 else ")"))
            out += _explain_items(it.body, stages, depth + 1)
    flush()
    return out


def make_plan(chain: C.Chain, schedule: tuple[S.Item, ...], planner: str,
              params: dict[str, Any], budget_bytes: int | None,
              notes: tuple[str, ...] = (), stage_time_s: list[float] | None = None) -> Plan:
    """Evaluate a schedule on the chain model and wrap it as a Plan."""
    peak, flops = S.simulate(chain, schedule)
    plain_peak, plain_flops = S.simulate(chain, S.plain_schedule(chain))
    mirror, mode = stage_modes(chain.n, schedule)
    stages = tuple(
        Stage(s, int(chain.first[s]), int(chain.last[s]), chain.modules[s], mirror[s], mode[s],
              int(chain.xbar[s]), int(chain.f[s]),
              chain.cheap_ops[s] if mode[s] == "drop-cheap" and chain.cheap_ops else (),
              chain.kinds[s] if chain.kinds else "call")
        for s in range(chain.n)
    )
    time_s = None
    if stage_time_s is not None:
        time_s = _predicted_time(chain, schedule, stage_time_s)
    return Plan(planner, params, chain.fingerprint, budget_bytes, stages, schedule, peak,
                plain_peak, flops - plain_flops, chain.step_flops, chain.base_bytes, time_s,
                notes)


def _predicted_time(chain: C.Chain, schedule: tuple[S.Item, ...], stage_time_s: list[float]
                    ) -> float:
    """Plain step time scaled by measured forward time per stage for each recomputation."""
    ratio = [t / max(int(f), 1) for t, f in zip(stage_time_s, chain.f)]
    extra = 0.0

    def walk(items: tuple[S.Item, ...]) -> None:
        nonlocal extra
        for it in items:
            if isinstance(it, S.Region):
                extra += sum(stage_time_s[it.start : it.end + 1])
                walk(it.body)
            elif isinstance(it, S.DropCheap):
                extra += float(chain.fcheap[it.stage]) * ratio[it.stage]
    walk(schedule)
    return 3.0 * sum(stage_time_s) + extra  # backward ~ 2x forward (Sec. 4.3)


def load_plan(path: str | os.PathLike[str], arg: str = "plan") -> Plan:
    """A plan from its JSON file (``memplan plan -o``, ``plan.to_json()``); ``arg`` names the
    argument that gave the path in errors. Reads at most MAX_FILE_BYTES, from regular files
    only (a device or a pipe could be endless)."""
    fix = "Make one with memplan.plan(...).to_json() or: memplan plan MODEL -o plan.json"
    shown = printable(str(path))
    try:
        p = Path(path)
        exists, is_dir, is_file = p.exists(), p.is_dir(), p.is_file()
    except (OSError, TypeError, ValueError) as err:  # a name too long, a NUL byte, not a path
        raise bad_arg(arg, "the path of a plan JSON file", shown, f"{err}. {fix}") from None
    if not exists:
        raise bad_arg(arg, "the path of an existing plan JSON file", shown, f"No such file. {fix}")
    if is_dir:
        raise bad_arg(arg, "a plan file, not a directory", shown, fix)
    if not is_file:
        raise bad_arg(arg, "a regular plan file (not a device, pipe or socket)", shown, fix)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise bad_arg(arg, "a readable plan file", shown, f"{err.strerror}. {fix}") from None
    if len(data) > MAX_FILE_BYTES:
        raise PlanInvalid(f"{arg} {shown}: larger than {MAX_FILE_BYTES:,} bytes, the most a "
                          f"plan file may have; is it a plan? {fix}.")
    try:
        return Plan.from_json(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PlanInvalid(f"{arg} {shown}: not UTF-8 text, so not a plan file. {fix}.") from None
    except PlanInvalid as err:
        raise PlanInvalid(f"{arg} {shown}: {err}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique (json.loads would keep the last of repeated keys)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out
