"""Plan files are untrusted input (issue 12, item 6): a fuzz test of mutated valid plans, and
the cases that broke before (huge files, deep nesting, negative stages, terminal escapes)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.core import chain as C
from memplan.core import schedule as S
from memplan.core.plan import Plan, load_plan
from memplan.core.plan_schema import (
    DTYPE_NAMES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MODES,
    printable,
)
from memplan.core.planners import PLANNERS
from memplan.errors import ConfigError, MemplanError, PlanInvalid
from tests.core.graphs import tiny

EXAMPLES = int(os.environ.get("MEMPLAN_FUZZ_EXAMPLES", "400"))


@functools.cache
def valid_plans() -> tuple[dict[str, Any], ...]:
    """Plans of every planner on stored graphs, bound to their forward (as memplan.plan
    makes them): drop-cheap stages, nested regions, time predictions, input specs (positional
    and keyword), assumptions."""
    out = []
    for name, planner in (("resnet", "recursive"), ("resnet", "drop-cheap"),
                          ("lstm", "optimal"), ("gpt", "sqrt"), ("unet", "chen")):
        graph = tiny(name)
        plan = PLANNERS[planner](C.build_chain(graph), None)
        forward = graph.forward
        if planner == "sqrt":  # data-dependent ops' assumptions; inputs by keyword
            mask = {"shape": [2, 8], "dtype": "int64", "requires_grad": False}
            answers = {"aten.nonzero.default[torch.bool]": [
                {"in": [[2, 8]], "tree": "one",
                 "out": [{"shape": [5, 2], "stride": [2, 1], "dtype": "int64", "device": "cpu"}]}],
                "aten._local_scalar_dense.default[torch.bool]": [
                    {"in": [[]], "tree": "one", "out": [{"value": True}]}]}
            forward = dataclasses.replace(forward, assumptions=("sizes of the example batch",),
                                          kwargs={"attention_mask": mask,
                                                  "extra": {"dict": {"scale": {"value": 0.5}}}},
                                          answers=answers)
        plan = dataclasses.replace(plan, forward=forward, predicted_time_s=0.25)
        out.append(json.loads(plan.to_json()))
    return tuple(out)


def invariants(plan: Plan) -> None:
    """What every plan that loads must satisfy, written apart from the schema: an oracle for
    "never a silently accepted invalid plan"."""
    n = len(plan.stages)
    assert n >= 1
    ints = [plan.peak_bytes, plan.plain_peak_bytes, plan.extra_flops, plan.step_flops,
            plan.base_bytes] + [v for s in plan.stages for v in (
                s.index, s.first_op, s.last_op, s.mirror, s.saved_bytes, s.fwd_flops,
                s.replay_headroom_bytes)]
    assert all(type(v) is int and 0 <= v < 2**63 for v in ints)
    assert plan.budget_bytes is None or (type(plan.budget_bytes) is int
                                         and 0 < plan.budget_bytes < 2**63)
    assert plan.predicted_time_s is None or math.isfinite(plan.predicted_time_s) \
        and plan.predicted_time_s >= 0
    assert [s.index for s in plan.stages] == list(range(n))
    assert plan.stages[0].first_op == 0
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.last_op + 1 == b.first_op
    for s in plan.stages:
        assert s.first_op <= s.last_op and s.mode in MODES
        assert all(s.first_op <= op <= s.last_op for op in s.recompute_ops)
        assert not s.recompute_ops or s.mode == "drop-cheap"
        assert isinstance(s.module, str)
    assert plan.forward is None or all(isinstance(a, str) for a in plan.forward.assumptions)
    assert plan.forward is None or all(isinstance(k, str) and k and isinstance(v, dict)
                                       for k, v in plan.forward.kwargs.items())
    for records in (plan.forward.answers if plan.forward else {}).values():
        for rec in records:
            assert rec["tree"] in ("one", "tuple", "list") and isinstance(rec["out"], list)
            assert rec["tree"] != "one" or len(rec["out"]) == 1
            for leaf in rec["out"]:
                assert ("value" in leaf and not isinstance(leaf["value"], str)) or (
                    len(leaf["shape"]) == len(leaf["stride"]) and leaf["dtype"] in DTYPE_NAMES)

    class Stages:  # what schedule.validate reads of a chain
        pass

    chain = Stages()
    chain.n = n  # type: ignore[attr-defined]
    S.validate(chain, plan.schedule)  # type: ignore[arg-type]

    def walk(items: tuple[S.Item, ...], depth: int) -> None:
        for it in items:
            if isinstance(it, S.Region):
                assert all(plan.stages[k].mode == "recompute" for k in range(it.start, it.end + 1))
                assert plan.stages[it.start].mirror >= depth + 1
                walk(it.body, depth + 1)
            elif isinstance(it, S.DropCheap):
                assert plan.stages[it.stage].mode == "drop-cheap"
            else:
                assert depth > 0 or plan.stages[it.stage].mode == "keep"

    walk(plan.schedule, 0)
    if plan.forward is not None:
        assert 0 <= plan.forward.ops <= plan.stages[-1].last_op + 1
        for spec in plan.forward.inputs:
            assert "shape" not in spec or (spec["dtype"] in DTYPE_NAMES and all(
                type(d) is int and d >= 0 for d in spec["shape"]))
    assert isinstance(plan.explain(), str)
    assert Plan.from_json(plan.to_json()) == plan  # what loads, saves and loads again


# --- mutations -------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.sampled_from([0, -1, 1, 2**63 - 1, 2**63, -2**63, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["\x1b[2J", "[red]x[/red]", "[/bold]", "\u202e",
                                           "keep", "recompute", "drop-cheap", "x" * 5000]),
)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON tree (keys and list indices), down to 40 levels."""
    out = [prefix]
    if len(prefix) >= 40:
        return out
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths(v, prefix + (i,))
    return out


def retype(value: Any) -> Any:
    """The same content as another JSON type."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        as_float = float(value) if abs(value) < 10**300 else str(value)  # no OverflowError
        return [as_float, str(value), value != 0][value % 3]
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else str(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return {str(i): v for i, v in enumerate(value)}
    if isinstance(value, dict):
        return list(value.values())
    return 0


def nest(value: Any, depth: int, kind: str) -> Any:
    for _ in range(depth):
        value = [value] if kind == "list" else {"kind": "recompute", "start": 0, "end": 0,
                                                 "body": [value]}
    return value


@st.composite
def mutated(draw: st.DrawFn, bases: tuple[dict[str, Any], ...] = ()) -> str:
    """One of the valid plans ``bases`` (default: ``valid_plans()``) with 1-3 mutations at
    random places, as JSON text (sometimes cut or changed as text too)."""
    data = copy.deepcopy(draw(st.sampled_from(bases or valid_plans())))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(paths(data)))
        parent: Any = data
        for key in where[:-1]:
            parent = parent[key]
        value = parent[where[-1]] if where else data
        op = draw(st.sampled_from(["drop", "replace", "retype", "number", "nest", "extra",
                                   "shuffle", "huge-string"]))
        if op == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            new: Any = draw(st.sampled_from([
                -value, value + 1, value - 1, value * 10**20, -1, 2**63, float("nan"),
                float("inf"), -float("inf"), 1e400,
                value + 0.5 if abs(value) < 10**300 else value]))
        elif op == "retype":
            new = retype(value)
        elif op == "nest":
            new = nest(value, draw(st.sampled_from([2, MAX_DEPTH, 5000])),
                       draw(st.sampled_from(["list", "region"])))
        elif op == "extra" and isinstance(value, dict):
            new = {**value, draw(st.text(max_size=8)): draw(JSON_SCALARS)}
        elif op == "shuffle" and isinstance(value, list):
            new = draw(st.permutations(value))
        elif op == "huge-string":
            new = draw(st.sampled_from(["\x1b[2J" * 2000, "y" * 200_000, "[/red]"]))
        elif op == "drop" and where:
            del parent[where[-1]]
            continue
        else:
            new = draw(JSON_VALUES)
        if where:
            parent[where[-1]] = new
        else:
            data = new
    try:
        text = json.dumps(data)
    except (RecursionError, ValueError):  # nested deeper than json.dumps goes
        text = "[" * 100_000 + "]" * 100_000
    cut = draw(st.sampled_from(["none"] * 6 + ["truncate", "byte"]))
    if cut == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif cut == "byte":
        i = draw(st.integers(0, len(text)))
        text = text[:i] + draw(st.sampled_from(["{", "]", '"', "\x00", "NaN", "1e999", ","])) \
            + text[i:]
    return text


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated())
def test_fuzz_mutated_plans_raise_plan_invalid_or_load_valid(text: str) -> None:
    try:
        plan = Plan.from_json(text)
    except MemplanError as err:
        assert isinstance(err, PlanInvalid), type(err)
        assert str(err) and "\n" not in str(err)
        return
    invariants(plan)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(JSON_VALUES)
def test_fuzz_random_json_is_refused(value: Any) -> None:
    text = json.dumps(value)
    with pytest.raises(PlanInvalid):
        Plan.from_json(text)
    with pytest.raises(PlanInvalid):
        Plan.from_dict(value)


def test_valid_plans_load_unchanged() -> None:
    for data in valid_plans():
        plan = Plan.from_dict(data)
        invariants(plan)
        assert plan.to_dict() == data


# --- the inputs that broke before, one by one ------------------------------------------------

def _plan() -> dict[str, Any]:
    return copy.deepcopy(valid_plans()[0])


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["stages"][-1].update(index=-1), "stages[LAST].index"),
    (lambda d: d["schedule"][-1].update(stage=-1), "stage"),
    (lambda d: d["schedule"].append({"kind": "recompute", "start": -2, "end": -1, "body": []}),
     "start"),
    (lambda d: d.update(peak_bytes=-5), "peak_bytes"),
    (lambda d: d.update(peak_bytes=float("nan")), "peak_bytes"),
    (lambda d: d.update(step_flops=float("inf")), "step_flops"),
    (lambda d: d.update(base_bytes=True), "base_bytes"),
    (lambda d: d.update(extra_flops=10**400), "digits"),
    (lambda d: d.update(budget_bytes=0), "budget_bytes"),
    (lambda d: d.update(predicted_time_s=float("nan")), "predicted_time_s"),
    (lambda d: d.update(schema_version="1"), "schema_version"),
    (lambda d: d.update(schema_version=True), "schema_version"),
    (lambda d: d["stages"][0].update(mode="sometimes"), "mode"),
    (lambda d: d["stages"][0].update(mirror=9), "mirror"),
    (lambda d: d["stages"][1].update(first_op=0), "first_op"),
    (lambda d: d["stages"][0].update(last_op=10**6), "first_op"),
    (lambda d: d["stages"][0].update(saved_bytes="12"), "saved_bytes"),
    (lambda d: d["schedule"].pop(), "schedule"),
    (lambda d: d["schedule"][0].update(kind="teleport"), "kind"),
    (lambda d: d["forward"]["inputs"][0].update(dtype="__import__('os')"), "dtype"),
    (lambda d: d["forward"]["inputs"][0].update(dtype="Tensor"), "dtype"),
    (lambda d: d["forward"]["inputs"][0].update(shape=[-1, 3]), "shape"),
    (lambda d: d["forward"]["inputs"][0].update(shape=[2**40] * 3), "elements"),
    (lambda d: d["forward"].update(autocast={"cpu": "int8"}), "autocast"),
    (lambda d: d["forward"].update(autocast={"tpu": "float16"}), "autocast"),
    (lambda d: d["forward"].update(ops=10**9), "forward.ops"),
    (lambda d: d.update(params={"k": {"deep": [1]}}), "params"),
    (lambda d: d.update(surprise=1), "surprise"),
    (lambda d: d.pop("stages"), "stages"),
    (lambda d: d.update(stages=[]), "non-empty"),
    (lambda d: d.update(notes=["x" * 10_000]), "notes[0]"),
])
def test_each_malformed_field_is_named(mutate: Any, needle: str) -> None:
    data = _plan()
    needle = needle.replace("LAST", str(len(data["stages"]) - 1))  # the last stage's index
    mutate(data)
    with pytest.raises(PlanInvalid, match="not a (valid )?memplan plan") as info:
        Plan.from_dict(data)
    assert needle in str(info.value)
    with pytest.raises(PlanInvalid):
        Plan.from_json(json.dumps(data))


def test_deep_nesting_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(PlanInvalid, match="not valid plan JSON"):
        Plan.from_json("[" * 200_000 + "]" * 200_000)
    data = _plan()
    data["schedule"][0] = nest({"kind": "keep", "stage": 0}, MAX_DEPTH + 1, "region")
    with pytest.raises(PlanInvalid, match=f"nested at most {MAX_DEPTH} deep"):
        Plan.from_dict(data)
    looped: dict[str, Any] = {"kind": "recompute", "start": 0, "end": 0, "body": []}
    looped["body"].append(looped)  # a cycle, from Python
    data["schedule"][0] = looped
    with pytest.raises(PlanInvalid):
        Plan.from_dict(data)


def test_duplicate_keys_are_refused() -> None:
    text = json.dumps(_plan())
    with pytest.raises(PlanInvalid, match="appears twice"):
        Plan.from_json(text[:-1] + ', "peak_bytes": 1}')


def test_big_files_are_refused_before_reading(tmp_path: Path) -> None:
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(10 * MAX_FILE_BYTES)  # sparse: costs no disk
    with pytest.raises(PlanInvalid, match="larger than"):
        load_plan(huge)
    with pytest.raises(ConfigError, match="regular plan file"):
        load_plan("/dev/zero")  # endless: `memplan explain /dev/zero` read 7.7 GB
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="regular plan file"):
        load_plan(fifo)  # would block forever
    (tmp_path / "latin1.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(PlanInvalid, match="UTF-8"):
        load_plan(tmp_path / "latin1.json")
    with pytest.raises(ConfigError):
        load_plan("x" * 5000)  # a name too long for the file system


def test_strings_from_a_plan_are_printed_escaped() -> None:
    data = _plan()
    data["stages"][0]["module"] = "\x1b[2Jstem[/red]"
    data["notes"] = ["\x1b]0;pwned\x07 \u202etxt"]
    data["planner"] = "\x1b[31mevil"
    text = Plan.from_dict(data).explain()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "\\x1b[2Jstem[/red]" in text and "\\u202etxt" in text
    assert printable("conv1.weight") == "conv1.weight"
    assert printable("a\nb\tc") == "a\\nb\\tc"
