"""What the evaluator (``memplan.core.evaluate``) reads of a Graph, as numpy arrays derived
once per Graph object (``graph_arrays.derived``): the same for every plan evaluated on it, so
each evaluation is array arithmetic over the plan's scopes instead of a walk of the Python
objects. Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from memplan.core import graph as g
from memplan.core.graph_arrays import (
    NO_DEATH,
    GraphArrays,
    derived,
    flat,
    held_expensive,
    ints,
    known,
)

I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
KIND = {k: i for i, k in enumerate(g.KINDS)}  # value kind -> its code in ``EvalArrays.kind``
COPY, KEEP, NEITHER = 0, 1, 2  # what a scope's tape does with an outside input (``tape_use``)


@dataclass(frozen=True)
class Csr:
    """Items grouped by row (an op, a value): row r's items are ``item[ptr[r]:ptr[r + 1]]``."""

    ptr: I64
    item: I64

    def rows(self, rows: I64) -> tuple[I64, I64]:
        """(index into ``rows``, item) for every item of the given rows, row by row."""
        counts = self.ptr[rows + 1] - self.ptr[rows]
        owner = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
        starts = np.repeat(self.ptr[rows] - np.cumsum(counts) + counts, counts)
        return owner, self.item[starts + np.arange(len(owner), dtype=np.int64)]


def csr(row: I64, item: I64, n_rows: int) -> Csr:
    """``(row, item)`` pairs grouped by row, pair order kept within a row."""
    order = np.argsort(row, kind="stable")
    ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=n_rows), out=ptr[1:])
    return Csr(ptr, item[order])


@dataclass(frozen=True)
class EvalArrays:
    """Per value, per forward op, and the pairs between them that the evaluator reads."""

    n_ops: int
    n_events: int
    n_model: int  # ops of the model's forward (the rest of ``graph.ops`` are the loss)
    kind: npt.NDArray[np.int8]  # KIND code per value
    nbytes: I64
    birth: I64
    death: I64  # NO_DEATH: alive after the step
    death_unsaved: I64  # earlier of Value.death_unsaved and death (NO_DEATH: neither)
    producer: I64
    first_seen: I64  # an external tensor from before the step: its first read (``_first_seen``)
    last_write: I64  # last forward op writing it (``written``), -1 if none
    release: I64  # per forward op: the event after which its saves are released
    unpack: I64  # per forward op: Op.unpack_event
    expensive: Mask  # per forward op: drop-cheap keeps its outputs
    inputs: Csr  # per forward op
    input_op: I64  # the op of each item of ``inputs``
    tape_use: npt.NDArray[np.int8]  # per item of ``inputs``: COPY, KEEP or NEITHER
    stale: Csr  # per forward op: inputs read after a later op wrote them (``replay_intervals``)
    outputs: Csr  # per forward op
    makers: Csr  # per value: forward ops listing it in Op.outputs
    written: Csr  # per forward op: values it writes, as the runtime sees them
    writers: Csr  # per value: forward ops listing it in Op.mutated
    saved_op: I64  # (op, value) pairs of what autograd saves, in op order
    saved_vid: I64
    savers: Csr  # per value: ops saving it


def eval_arrays(graph: g.Graph) -> EvalArrays:
    """The evaluator's arrays of ``graph``, derived once per Graph object."""
    return derived(graph, "evaluate", _extract)


def _extract(graph: g.Graph) -> EvalArrays:
    values, ops = graph.values, graph.ops
    n_ops, n_values = len(ops), len(values)
    n_events = n_ops + len(graph.backward_ops)
    kind = np.fromiter(map(KIND.__getitem__, map(attrgetter("kind"), values)), np.int8, n_values)
    nbytes, birth, death, producer, expensive, out_op, out_vid = _shared(graph)
    targets = list(map(attrgetter("target"), ops))
    bn_target = {t: "batch_norm" in t for t in dict.fromkeys(targets)}
    in_op, in_vid = flat(ops, "inputs")
    m_op, m_vid = flat(ops, "mutated")
    mutated = np.isin(in_op * n_values + in_vid, m_op * n_values + m_vid)
    # What an op writes as the runtime sees it: what it mutates, and the buffers batch norm
    # reads (its running statistics, written without saying so in its schema).
    bn = np.fromiter(map(bn_target.__getitem__, targets), np.bool_, n_ops)
    bn_buffer = bn[in_op] & (kind[in_vid] == KIND[g.BUFFER]) & ~mutated
    w_op = np.concatenate([m_op, in_op[bn_buffer]])
    w_vid = np.concatenate([m_vid, in_vid[bn_buffer]])
    last_write = np.full(n_values, -1, dtype=np.int64)
    np.maximum.at(last_write, w_vid, w_op)
    tape_use, stale = _input_uses(kind, in_op, in_vid, mutated, mutated | bn_buffer, bn,
                                  last_write)
    release = ints(ops, "release_event")
    s_op, s_vid = flat(ops, "saved")
    return EvalArrays(
        n_ops=n_ops, n_events=n_events,
        n_model=graph.forward.ops if graph.forward is not None else n_ops,
        kind=kind, nbytes=nbytes, birth=birth, death=death,
        death_unsaved=np.minimum(death, _optional(values, "death_unsaved")),
        producer=producer, first_seen=_first_seen(graph, kind, birth, in_op, in_vid),
        last_write=last_write, release=np.where(release >= 0, release, n_events - 1),
        unpack=ints(ops, "unpack_event"), expensive=expensive,
        inputs=csr(in_op, in_vid, n_ops), input_op=in_op, tape_use=tape_use,
        stale=csr(in_op[stale], in_vid[stale], n_ops), outputs=csr(out_op, out_vid, n_ops),
        makers=csr(out_vid, out_op, n_values),
        written=csr(w_op, w_vid, n_ops), writers=csr(m_vid, m_op, n_values),
        saved_op=s_op, saved_vid=s_vid, savers=csr(s_vid, s_op, n_values))


def _shared(graph: g.Graph) -> tuple[I64, I64, I64, I64, Mask, I64, I64]:
    """(nbytes, birth, death, producer per value; expensive per op; (op, value) pairs of the
    ops' outputs): ``graph_arrays``' own when the chain has read them already."""
    ga: GraphArrays | None = known(graph, "graph")
    if ga is not None:
        return ga.nbytes, ga.birth, ga.death, ga.producer, ga.expensive, ga.out_op, ga.out_vid
    values, ops = graph.values, graph.ops
    out_op, out_vid = flat(ops, "outputs")
    producer = ints(values, "producer")
    return (ints(values, "nbytes"), ints(values, "birth"), _optional(values, "death"),
            producer, held_expensive(ops, producer), out_op, out_vid)


def _first_seen(graph: g.Graph, kind: npt.NDArray[np.int8], birth: I64, in_op: I64,
                in_vid: I64) -> I64:
    """The first event reading each external tensor from before the step (-1: none, or
    another value): memplan's tracker sees it then. The backward's reads are gathered only
    when the forward does not read one of them."""
    want = (kind == KIND[g.EXTERNAL]) & (birth < 0)
    first = _first(in_op, in_vid, len(kind), want)
    if (want & (first < 0)).any() and graph.backward_ops:
        b_op, b_vid = flat(graph.backward_ops, "inputs")
        later = _first(b_op + len(graph.ops), b_vid, len(kind), want)
        first = np.where(first < 0, later, first)
    return first


def _first(event: I64, vid: I64, n_values: int, want: Mask) -> I64:
    """The least ``event`` of each wanted value among the (event, value) pairs, -1 if none."""
    none = np.iinfo(np.int64).max
    seen = np.full(n_values, none, dtype=np.int64)
    np.minimum.at(seen, vid, event)
    return np.where(want & (seen != none), seen, -1)


def _optional(objs: tuple[g.Value, ...], attr: str) -> I64:
    """An int-or-None field as int64, NO_DEATH for None."""
    get = attrgetter(attr)
    return np.fromiter((NO_DEATH if x is None else x for x in map(get, objs)), np.int64,
                       len(objs))


def _input_uses(kind: npt.NDArray[np.int8], in_op: I64, in_vid: I64, mutated: Mask,
                written: Mask, bn: Mask, last_write: I64) -> tuple[npt.NDArray[np.int8], Mask]:
    """Per forward input pair (op, value), what a tape does with it when the value is from
    outside the op's top scope (``scopes.tape_reads``): COPY a value the op writes (unless a
    parameter or buffer, bar one it mutates that batch norm did not write), else KEEP an
    activation, backward value, external tensor or input; and whether a replay of the op
    reads it at a version changed since (unwritten by the op, not a parameter or buffer,
    written by a later op)."""
    k = kind[in_vid]
    param_or_buffer = (k == KIND[g.PARAMETER]) | (k == KIND[g.BUFFER])
    copy = written & (~param_or_buffer | (mutated & ~bn[in_op]))
    keepable = np.isin(k, [KIND[g.ACTIVATION], KIND[g.BACKWARD], KIND[g.EXTERNAL],
                           KIND[g.INPUT]])
    use = np.where(copy, COPY, np.where(keepable, KEEP, NEITHER)).astype(np.int8)
    stale = ~written & ~param_or_buffer & (last_write[in_vid] > in_op)
    return use, stale
