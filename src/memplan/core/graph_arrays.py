"""A Graph's fields as numpy arrays, read once per Graph object: what ``chain.build_chain``
and ``floor`` read instead of the Python objects (values, ops, cut points)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.liveness import ValueArrays, pairs
from memplan.core.ops import is_expensive
from memplan.core.resident import resident_values

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class GraphArrays:
    """A Graph's fields as numpy arrays (one pass over its Python objects), its live-bytes
    timeline and fingerprint: what ``build_chain`` reads, computed once per Graph object."""

    fingerprint: str
    n_ops: int
    nbytes: I64  # per value
    birth: I64
    death: I64  # NO_DEATH when alive after the step
    death_unsaved: I64  # the same had nothing been saved (Value.death_unsaved)
    producer: I64
    activation: npt.NDArray[np.bool_]
    last_fwd_use: I64  # last forward op reading or writing the value, -1 if none
    fwd_flops: I64  # per forward op
    bwd_flops: I64
    expensive: npt.NDArray[np.bool_]
    has_outputs: npt.NDArray[np.bool_]
    out_op: I64  # (op, value) pairs of the forward ops' outputs
    out_vid: I64
    grad_of: I64  # per backward op
    timeline: I64  # live bytes per event (Graph.live_bytes_timeline)
    died: I64  # bytes freed at each event (length n_events + 1)
    born0: int  # bytes born at event 0
    base_bytes: int
    step_flops: int
    cut_after: I64
    cut_bytes: I64  # a cut's live bytes as the chain counts them (``resident``)
    cut_min_producer: I64  # earliest producer among a cut's live values (n_ops if none)
    cut_of: I64  # (cut, value) pairs of those live sets
    cut_live: I64
    held_of: I64  # (cut, value) pairs of them only held there: past their last read
    held_vid: I64
    res_of: I64  # (cut, value) pairs of resident values read across a cut, dead by the backward
    res_vid: I64
    resident: npt.NDArray[np.bool_]  # per value: resident, no stage's bytes (``resident``)
    resident_end: I64  # a resident value's last forward op (NO_DEATH: into the backward)


NO_DEATH = np.iinfo(np.int64).max
# (id of the Graph, what was derived) -> (the Graph, weakly; the derived arrays). Clearing it
# drops everything derived from every Graph (benchmarks do, to time cold runs).
_ARRAYS: dict[tuple[int, str], tuple[weakref.ref[g.Graph], Any]] = {}
T = TypeVar("T")


def derived(graph: g.Graph, name: str, build: Callable[[g.Graph], T]) -> T:
    """``build(graph)``, cached under ``name`` while the Graph object lives (Graphs are
    immutable): what several callers derive from one Graph is derived once."""
    key = (id(graph), name)
    hit = _ARRAYS.get(key)
    if hit is not None and hit[0]() is graph:
        out: T = hit[1]
        return out
    made = build(graph)
    _ARRAYS[key] = (weakref.ref(graph, lambda _r: _ARRAYS.pop(key, None)), made)
    return made


def known(graph: g.Graph, name: str) -> Any:
    """What ``derived`` holds under ``name`` for ``graph``, None if nothing yet."""
    hit = _ARRAYS.get((id(graph), name))
    return hit[1] if hit is not None and hit[0]() is graph else None


def graph_arrays(graph: g.Graph) -> GraphArrays:
    """The arrays of ``graph``, cached while the Graph object lives (Graphs are immutable)."""
    return derived(graph, "graph", _extract)


def ints(objs: Sequence[Any], attr: str) -> I64:
    return np.fromiter(map(attrgetter(attr), objs), np.int64, len(objs))


def _optional(objs: Sequence[Any], attr: str, none: int) -> I64:
    """An int-or-None field as int64, ``none`` for None (via NaN: one C-level pass)."""
    as_float = np.array(list(map(attrgetter(attr), objs)), dtype=np.float64)
    missing = np.isnan(as_float)
    out = np.where(missing, 0.0, as_float).astype(np.int64)
    out[missing] = none
    return out


def flat(objs: Sequence[Any], attr: str) -> tuple[I64, I64]:
    """(owner index, item) pairs of the tuples ``obj.attr`` of every object."""
    return pairs(list(map(attrgetter(attr), objs)))




def held_expensive(ops: Sequence[g.Op], producer: I64) -> npt.NDArray[np.bool_]:
    """Per op, whether a drop-cheap stage keeps its outputs rather than recomputing them
    (Sec. 4.2): an expensive op (``ops.is_expensive``) none of whose outputs a later op
    writes in place. A kept output so written would hold the written value where the replay
    needs the one it had (HF Gemma3n: ``proj = linear(x); proj *= scale``, through an
    ``_unsafe_view`` that bumps no version counter); ``runtime.probe`` finds the same ops."""
    by_target = {t: is_expensive(t) for t in dict.fromkeys(map(attrgetter("target"), ops))}
    out = np.fromiter(map(by_target.__getitem__, map(attrgetter("target"), ops)), np.bool_,
                      len(ops))
    _, written = flat(ops, "mutated")
    makers = producer[written]
    out[makers[makers >= 0]] = False
    return out


def _extract(graph: g.Graph) -> GraphArrays:
    values, ops, bops, cuts = graph.values, graph.ops, graph.backward_ops, graph.cut_points
    n_ops, n_events = len(ops), len(ops) + len(bops)
    nbytes, birth, producer = ints(values, "nbytes"), ints(values, "birth"), ints(values, "producer")
    death = _optional(values, "death", NO_DEATH)
    death_unsaved_raw = _optional(values, "death_unsaved", -1)
    death_unsaved = np.minimum(death, np.where(death_unsaved_raw < 0, NO_DEATH,
                                               death_unsaved_raw))
    activation = np.fromiter(map(g.ACTIVATION.__eq__, map(attrgetter("kind"), values)),
                             np.bool_, len(values))
    last_fwd_use = np.full(len(values), -1, dtype=np.int64)
    in_op, in_vid = flat(ops, "inputs")
    np.maximum.at(last_fwd_use, in_vid, in_op)
    op_m, vid_m = flat(ops, "mutated")
    np.maximum.at(last_fwd_use, vid_m, op_m)
    va = ValueArrays(n_ops, activation, producer, np.where(death_unsaved_raw < 0, n_ops,
                                                            death_unsaved_raw),
                     in_op, in_vid, last_fwd_use)
    expensive = held_expensive(ops, producer)
    out_op, out_vid = flat(ops, "outputs")
    has_outputs = np.bincount(out_op, minlength=n_ops) > 0
    # Graph.live_bytes_timeline, vectorised: bytes live at each event after its outputs exist.
    pre = birth < 0
    born = np.zeros(n_events + 1, dtype=np.int64)
    np.add.at(born, birth[~pre], nbytes[~pre])
    died = np.zeros(n_events + 1, dtype=np.int64)
    dead = death != NO_DEATH
    np.add.at(died, death[dead], nbytes[dead])
    cum_died = np.concatenate(([0], np.cumsum(died[: n_events - 1]))) if n_events else died[:0]
    timeline = int(nbytes[pre].sum()) + np.cumsum(born[:n_events]) - cum_died
    fwd_flops, bwd_flops = ints(ops, "fwd_flops"), ints(ops, "bwd_flops")
    read_i, read = flat(cuts, "live")
    resident, never_dies, cut_i, live, held_i, held = resident_values(graph, va, death, read_i,
                                                                      read)
    resident_end = np.where(never_dies, NO_DEATH, death)
    # Clean cuts (``clean_cuts``) by what restarting the forward there reads: values only
    # held across a cut (``liveness.held_past_cuts``) count in its bytes, not in its live set.
    keep = ~resident[read]
    dying = resident[read] & (resident_end[read] != NO_DEATH)
    min_prod = np.full(len(cuts), n_ops, dtype=np.int64)
    np.minimum.at(min_prod, read_i[keep], producer[read[keep]])
    cut_bytes = np.zeros(len(cuts), dtype=np.int64)
    np.add.at(cut_bytes, cut_i, nbytes[live])
    return GraphArrays(
        fingerprint=graph.fingerprint, n_ops=n_ops, nbytes=nbytes, birth=birth, death=death,
        death_unsaved=death_unsaved,
        producer=producer, activation=activation, last_fwd_use=last_fwd_use,
        fwd_flops=fwd_flops, bwd_flops=bwd_flops, expensive=expensive, has_outputs=has_outputs,
        out_op=out_op, out_vid=out_vid, grad_of=ints(bops, "grad_of"), timeline=timeline,
        died=died, born0=int(born[0]), base_bytes=int(nbytes[pre].sum()),
        step_flops=int(fwd_flops.sum()) + int(ints(bops, "fwd_flops").sum()),
        cut_after=ints(cuts, "after"), cut_bytes=cut_bytes, cut_min_producer=min_prod,
        cut_of=cut_i, cut_live=live, held_of=held_i, held_vid=held, res_of=read_i[dying],
        res_vid=read[dying], resident=resident, resident_end=resident_end,
    )
