"""The one schema of a plan file: every field, its type and range, and how the fields agree.

Plan files are untrusted input (issue 12): ``Plan.from_dict`` runs every dict through
``check_plan`` before building anything, so a malformed plan raises PlanInvalid naming the
field, never another exception, and a plan that loads can be explained and applied. What the
schema asks beyond types and ranges: stages tile the forward (indices 0.., contiguous ops);
the schedule tiles the stages (``schedule.validate``); each stage's mode and mirror depth are
what the schedule makes them (``stage_modes``); drop-cheap ops lie inside their stage.
Strings from a file are data: ``printable`` escapes them where they are shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

from memplan.core import schedule as S
from memplan.core.chain import Chain
from memplan.errors import PlanInvalid

SCHEMA_VERSION = 1
KIND = "memplan.Plan"
MAX_FILE_BYTES = 64 * 2**20  # a 1000-layer ResNet's plan is 0.1 MB (341 stages)
MAX_DEPTH = 64  # recompute regions nested in each other (planners reach ~log2(stages))
MAX_INT = 2**63 - 1  # bytes, FLOPs, op indices: the chain's int64
MAX_TEXT_CHARS = 4096  # a planner name, a module path, a note
MAX_DIMS = 64  # an example input's dimensions
MAX_SPEC_DEPTH = 8  # example inputs nested in lists, tuples and dicts (deeper: by type only)
MAX_ANSWER_LEAVES = 4096  # data-dependent outputs a plan records (more: none recorded)
ANSWER_TREES = ("one", "tuple", "list")  # how a recorded output's leaves are grouped
MODES = ("keep", "drop-cheap", "recompute")
ITEM_KINDS = MODES  # the schedule's items: Keep, DropCheap, Region
BOUNDARIES = ("call", "leaf", "op")  # how the runtime finds a stage's end (CutPoint.kind)
# Example-input and autocast dtypes a plan may name (memplan.tracing.fake.DTYPES maps them).
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
               "int64", "int32", "int16", "int8", "uint8", "bool")
AUTOCAST_DTYPES = ("float64", "float32", "float16", "bfloat16")
AUTOCAST_DEVICES = ("cpu", "cuda")

_TOP = ("schema_version", "kind", "planner", "params", "graph_fingerprint", "budget_bytes",
        "stages", "schedule", "peak_bytes", "plain_peak_bytes", "extra_flops", "step_flops",
        "base_bytes", "predicted_time_s", "notes")
_STAGE = ("index", "first_op", "last_op", "module", "mirror", "mode", "saved_bytes",
          "fwd_flops", "recompute_ops")
_FORWARD = ("ops", "fingerprint", "inputs", "autocast")
_FIX = "Make the plan again with memplan.plan(...) or: memplan plan MODEL -o plan.json"


def check_plan(data: object) -> None:
    """Raise PlanInvalid unless ``data`` is a plan dict this memplan reads (``Plan.to_dict``)."""
    if not isinstance(data, dict):
        raise PlanInvalid(f"a plan is a JSON object, got {_show(data)}. {_FIX}.")
    version = data.get("schema_version")
    if data.get("kind") != KIND or type(version) is not int or version != SCHEMA_VERSION:
        raise PlanInvalid(
            f"not a memplan plan of schema_version {SCHEMA_VERSION} (got kind="
            f"{_show(data.get('kind'))}, schema_version={_show(version)}). {_FIX}.")
    _keys(data, "plan", _TOP, ("forward",))
    _text(data["planner"], "planner", empty=False)
    _params(data["params"])
    _text(data["graph_fingerprint"], "graph_fingerprint")
    if data["budget_bytes"] is not None:
        _int(data["budget_bytes"], "budget_bytes", lo=1)
    for name in ("peak_bytes", "plain_peak_bytes", "extra_flops", "step_flops", "base_bytes"):
        _int(data[name], name)
    if data["predicted_time_s"] is not None:
        _seconds(data["predicted_time_s"], "predicted_time_s")
    for i, note in enumerate(_list(data["notes"], "notes")):
        _text(note, f"notes[{i}]")
    n_ops = _stages(data["stages"])
    n = len(data["stages"])
    schedule = _items(data["schedule"], "schedule", n, 0)
    try:
        S.validate(cast(Chain, _StageCount(n)), schedule)  # reads only the stage count
    except PlanInvalid as err:
        raise PlanInvalid(f"not a valid memplan plan: schedule: {err}. {_FIX}.") from None
    mirror, mode = stage_modes(n, schedule)
    for i, st in enumerate(data["stages"]):
        if (st["mode"], st["mirror"]) != (mode[i], mirror[i]):
            raise _bad(f"stages[{i}] mode and mirror", f"what the schedule makes stage {i} "
                       f"({mode[i]!r}, mirror {mirror[i]})", (st["mode"], st["mirror"]))
    if data.get("forward") is not None:
        _forward(data["forward"], n_ops)


def stage_modes(n: int, schedule: tuple[S.Item, ...]) -> tuple[list[int], list[str]]:
    """Each stage's mirror depth (how many times it is recomputed, the paper's m(v)) and
    mode, as a schedule over ``n`` stages makes them."""
    mirror = [0] * n
    mode = ["keep"] * n

    def walk(items: tuple[S.Item, ...], depth: int) -> None:
        for it in items:
            if isinstance(it, S.Region):
                for s in range(it.start, it.end + 1):
                    mirror[s], mode[s] = max(mirror[s], depth + 1), "recompute"
                walk(it.body, depth + 1)
            elif isinstance(it, S.DropCheap):
                mirror[it.stage], mode[it.stage] = max(mirror[it.stage], 1), "drop-cheap"

    walk(schedule, 0)
    return mirror, mode


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\u202e``,
    ``\\n``): strings from a plan file or a model are shown, never obeyed by the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


@dataclass(frozen=True)
class _StageCount:
    n: int


def _stages(value: object) -> int:
    """Stages 0.. in order, tiling forward ops 0..; returns the ops they cover."""
    stages = _list(value, "stages")
    if not stages:
        raise _bad("stages", "a non-empty list", stages)
    next_op = 0
    for i, raw in enumerate(stages):
        where = f"stages[{i}]"
        st = _keys(raw, where, _STAGE, ("boundary", "replay_headroom_bytes"))
        _int(st["index"], f"{where}.index", lo=i, hi=i)
        _int(st["first_op"], f"{where}.first_op", lo=next_op, hi=next_op)
        last = _int(st["last_op"], f"{where}.last_op", lo=next_op)
        _text(st["module"], f"{where}.module")
        _int(st["mirror"], f"{where}.mirror", hi=MAX_DEPTH)
        if st["mode"] not in MODES:
            raise _bad(f"{where}.mode", f"one of {list(MODES)}", st["mode"])
        _int(st["saved_bytes"], f"{where}.saved_bytes")
        _int(st["fwd_flops"], f"{where}.fwd_flops")
        _int(st.get("replay_headroom_bytes", 0), f"{where}.replay_headroom_bytes")
        if st.get("boundary", "call") not in BOUNDARIES:
            raise _bad(f"{where}.boundary", f"one of {list(BOUNDARIES)}", st["boundary"])
        ops = _list(st["recompute_ops"], f"{where}.recompute_ops")
        if ops and st["mode"] != "drop-cheap":
            raise _bad(f"{where}.recompute_ops", "empty unless the stage is drop-cheap", ops)
        lo = next_op
        for k, op in enumerate(ops):
            lo = _int(op, f"{where}.recompute_ops[{k}]", lo=lo, hi=last) + 1  # increasing
        next_op = last + 1
    return next_op


def _items(value: object, where: str, n: int, depth: int) -> tuple[S.Item, ...]:
    """The schedule's items, typed; nesting bounded before it recurses."""
    out: list[S.Item] = []
    for i, raw in enumerate(_list(value, where)):
        at = f"{where}[{i}]"
        kind = raw.get("kind") if isinstance(raw, dict) else None
        if kind not in ITEM_KINDS:
            raise _bad(f"{at}.kind", f"one of {list(ITEM_KINDS)}", kind)
        if kind == "recompute":
            if depth >= MAX_DEPTH:
                raise _bad(at, f"recompute regions nested at most {MAX_DEPTH} deep", "deeper")
            d = _keys(raw, at, ("kind", "start", "end", "body"))
            start = _int(d["start"], f"{at}.start", hi=n - 1)
            end = _int(d["end"], f"{at}.end", lo=start, hi=n - 1)
            out.append(S.Region(start, end, _items(d["body"], f"{at}.body", n, depth + 1)))
        else:
            d = _keys(raw, at, ("kind", "stage"))
            stage = _int(d["stage"], f"{at}.stage", hi=n - 1)
            out.append(S.Keep(stage) if kind == "keep" else S.DropCheap(stage))
    return tuple(out)


def _forward(value: object, n_ops: int) -> None:
    fwd = _keys(value, "forward", _FORWARD, ("assumptions", "kwargs", "answers", "trace_path"))
    if not isinstance(fwd.get("trace_path", False), bool):
        raise _bad("forward.trace_path", "true or false", fwd["trace_path"])
    _int(fwd["ops"], "forward.ops", hi=n_ops)
    _text(fwd["fingerprint"], "forward.fingerprint")
    for i, spec in enumerate(_list(fwd["inputs"], "forward.inputs")):
        _input_spec(spec, f"forward.inputs[{i}]")
    for name, spec in _keys(fwd.get("kwargs", {}), "forward.kwargs", (), None).items():
        _text(name, "forward.kwargs key", empty=False)
        _input_spec(spec, f"forward.kwargs.{printable(name)}")
    for i, note in enumerate(_list(fwd.get("assumptions", []), "forward.assumptions")):
        _text(note, f"forward.assumptions[{i}]")
    _answers(fwd.get("answers", {}))
    autocast = _keys(fwd["autocast"], "forward.autocast", (), AUTOCAST_DEVICES)
    for device, dtype in autocast.items():
        if dtype not in AUTOCAST_DTYPES:
            raise _bad(f"forward.autocast.{device}", f"one of {list(AUTOCAST_DTYPES)}", dtype)


def _answers(value: object) -> None:
    """What data-dependent ops returned (``tracing.datadep``): per op, in order, the shapes
    of its tensor inputs and its output's leaves, a tensor's geometry or a number."""
    leaves = 0
    for op, records in _keys(value, "forward.answers", (), None).items():
        at = f"forward.answers.{printable(_text(op, 'forward.answers key', empty=False))}"
        for i, raw in enumerate(_list(records, at)):
            rec = _keys(raw, f"{at}[{i}]", ("in", "tree", "out"))
            for j, shape in enumerate(_list(rec["in"], f"{at}[{i}].in")):
                _shape(shape, f"{at}[{i}].in[{j}]")
            out = _list(rec["out"], f"{at}[{i}].out")
            if rec["tree"] not in ANSWER_TREES or (rec["tree"] == "one" and len(out) != 1):
                raise _bad(f"{at}[{i}].tree", f"one of {list(ANSWER_TREES)} ('one': one "
                           "output)", rec["tree"])
            leaves += len(out)
            if leaves > MAX_ANSWER_LEAVES:
                raise _bad("forward.answers", f"at most {MAX_ANSWER_LEAVES} outputs",
                           "more")
            for j, leaf in enumerate(out):
                _answer_leaf(leaf, f"{at}[{i}].out[{j}]")


def _answer_leaf(value: object, where: str) -> None:
    if isinstance(value, dict) and "value" in value:
        number = _keys(value, where, ("value",))["value"]
        if isinstance(number, str) or number is None:
            raise _bad(f"{where}.value", "a boolean or a finite number", number)
        _scalar(number, f"{where}.value")
        return
    leaf = _keys(value, where, ("shape", "stride", "dtype", "device"))
    shape = _shape(leaf["shape"], f"{where}.shape")
    stride = _list(leaf["stride"], f"{where}.stride")
    if len(stride) != len(shape):
        raise _bad(f"{where}.stride", f"{len(shape)} integers (one per dimension)", stride)
    for k, step in enumerate(stride):
        _int(step, f"{where}.stride[{k}]")
    if leaf["dtype"] not in DTYPE_NAMES:
        raise _bad(f"{where}.dtype", f"one of {list(DTYPE_NAMES)}", leaf["dtype"])
    _text(leaf["device"], f"{where}.device", empty=False)


def _input_spec(value: object, where: str, depth: int = 0) -> None:
    """{shape, dtype, requires_grad} of a tensor, {value} of a plain one, {list | tuple: [..]}
    or {dict: {name: ..}} of those, or {type}."""
    keys = set(value) if isinstance(value, dict) else set()
    if "shape" in keys:
        _tensor_spec(value, where)
    elif "value" in keys:
        _scalar(_keys(value, where, ("value",))["value"], f"{where}.value", finite=False)
    elif keys & {"list", "tuple", "dict"}:
        kind = next(k for k in ("list", "tuple", "dict") if k in keys)
        if depth >= MAX_SPEC_DEPTH:
            raise _bad(where, f"inputs nested at most {MAX_SPEC_DEPTH} deep", "deeper")
        inner = _keys(value, where, (kind,))[kind]
        if kind == "dict":
            for name, v in _keys(inner, f"{where}.dict", (), None).items():
                _text(name, f"{where}.dict key")
                _input_spec(v, f"{where}.dict.{printable(name)}", depth + 1)
        else:
            for i, v in enumerate(_list(inner, f"{where}.{kind}")):
                _input_spec(v, f"{where}.{kind}[{i}]", depth + 1)
    else:
        _text(_keys(value, where, ("type",))["type"], f"{where}.type")


def _tensor_spec(value: object, where: str) -> None:
    spec = _keys(value, where, ("shape", "dtype", "requires_grad"))
    _shape(spec["shape"], f"{where}.shape")
    if spec["dtype"] not in DTYPE_NAMES:
        raise _bad(f"{where}.dtype", f"one of {list(DTYPE_NAMES)}", spec["dtype"])
    if not isinstance(spec["requires_grad"], bool):
        raise _bad(f"{where}.requires_grad", "true or false", spec["requires_grad"])


def _shape(value: object, where: str) -> list[int]:
    shape = _list(value, where)
    if len(shape) > MAX_DIMS:
        raise _bad(where, f"at most {MAX_DIMS} dimensions", shape)
    numel = 1
    for k, size in enumerate(shape):
        numel *= _int(size, f"{where}[{k}]")
    if numel > MAX_INT:
        raise _bad(where, f"at most {MAX_INT} elements", numel)
    return shape


def _params(value: object) -> None:
    """The planner's parameters: names to JSON scalars or flat lists of them."""
    params = _keys(value, "params", (), None)
    for name, v in params.items():
        _text(name, "params key")
        if isinstance(v, list):
            for i, x in enumerate(v):
                _scalar(x, f"params.{printable(name)}[{i}]")
        else:
            _scalar(v, f"params.{printable(name)}")


# --- the checks every field uses -------------------------------------------------------------

def _keys(value: object, where: str, required: tuple[str, ...],
          optional: tuple[str, ...] | None = ()) -> dict[str, Any]:
    """``value`` as a dict with the ``required`` keys and only those and ``optional`` (None:
    any string keys)."""
    if not isinstance(value, dict):
        raise _bad(where, "a JSON object", value)
    missing = [k for k in required if k not in value]
    if missing:
        raise _bad(where, f"an object with the field(s) {missing}", f"none of {missing}")
    if optional is not None:
        extra = [k for k in value if k not in required and k not in optional]
        if extra:
            raise _bad(where, f"only the fields {list(required) + list(optional)}",
                       f"also {[_show(k) for k in extra[:5]]}")
    elif not all(isinstance(k, str) for k in value):
        raise _bad(where, "an object with string keys", value)
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(where, "a JSON list", value)
    return value


def _int(value: object, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        accepted = f"the integer {lo}" if lo == hi else f"an integer in [{lo}, {hi}]"
        raise _bad(where, accepted, value)
    return value


def _seconds(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (math.isfinite(value) and 0 <= value <= MAX_INT):
        raise _bad(where, "a finite number of seconds >= 0", value)


def _scalar(value: object, where: str, finite: bool = True) -> None:
    """A JSON scalar: null, a boolean, a string, a 64-bit integer or a (finite) float."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        _text(value, where)
    elif isinstance(value, int):
        _int(value, where, lo=-MAX_INT - 1)
    elif not isinstance(value, float) or (finite and not math.isfinite(value)):
        raise _bad(where, "null, a boolean, a string, an integer or a finite number", value)


def _text(value: object, where: str, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS or (not empty and not value):
        raise _bad(where, f"a{'' if empty else ' non-empty'} string of at most "
                   f"{MAX_TEXT_CHARS} characters", value)
    return value


def _bad(where: str, accepted: str, got: object) -> PlanInvalid:
    return PlanInvalid(f"not a valid memplan plan: {where}: expected {accepted}, got "
                       f"{_show(got)}. {_FIX}.")


def _show(value: object) -> str:
    """A short, escaped picture of a value from the file (never its whole size)."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    if isinstance(value, (str, int, float, bool, tuple)) or value is None:
        text = repr(value)  # escapes control characters
        return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"
    return type(value).__name__
