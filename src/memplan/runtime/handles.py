"""The handles autograd keeps instead of a recompute scope's tensors, and the scope's table of
them.

A handle is made per tensor autograd saves in a scope: thousands per step on a small-op model
(an LSTM step saves ~45). Each object that outlives the forward and is tracked by Python's
garbage collector counts towards its next collection, and the survivors are walked again by
the older generations' ones (a full collection walks the whole heap); so a save makes one
such object, the ``Handle``, and what the replay needs to know about it goes in its scope's
``HandleTable``: rows in flat columns of ints and shared objects, a unit's saves in
consecutive rows. A handle clears its row when autograd drops it, so the replay gives values
only to the handles still alive, and a value lives as long as its handle.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memplan.runtime.tape import Pos, Scope

Save = tuple[int, int, tuple[int, ...], torch.dtype]  # a unit's save: row, k, shape, dtype


class Handle:
    """What autograd keeps for a tensor of a recomputed scope: its row in the scope's table."""

    __slots__ = ("owner", "row")

    def __init__(self, owner: Scope, row: int) -> None:
        self.owner = owner
        self.row = row

    def __del__(self) -> None:  # autograd dropped it: the row is dead, its value freed
        table = self.owner.table
        table.alive[self.row] = 0
        table.values[self.row] = None


class HandleTable:
    """A scope's handles, a row each: alive (autograd still holds it) and its value, once
    replayed. A row is a tape value's (``positions``: row -> (entry, output index)) or one
    of a unit call's saved tensors, with the shape and dtype its forward saved (which the
    call's replay must give again): ``units`` holds (tape entry, first row, first index in
    ``dims``, first index in ``dtypes``) per unit call, whose k-th save is row first + k,
    its shape (ndim, sizes...) the k-th in ``dims`` from there."""

    __slots__ = ("alive", "dims", "dtypes", "positions", "units", "values")

    def __init__(self) -> None:
        self.alive = bytearray()
        self.values: list[torch.Tensor | None] = []
        self.positions: dict[int, Pos] = {}
        self.units: list[tuple[int, int, int, int]] = []
        self.dims = array("q")
        self.dtypes: list[torch.dtype] = []  # per unit save, in row order

    def add_value(self, pos: Pos) -> int:
        """A row for the tape value at ``pos``."""
        row = len(self.values)
        self.alive.append(1)
        self.values.append(None)
        self.positions[row] = pos
        return row

    def start_unit(self, entry: int) -> None:
        """Unit ``entry``'s call starts: its saves take the next rows."""
        self.units.append((entry, len(self.values), len(self.dims), len(self.dtypes)))

    def add_saved(self, t: torch.Tensor) -> int:
        """A row for the next tensor the current unit saves, ``t``."""
        self.alive.append(1)
        self.values.append(None)
        self.dtypes.append(t.dtype)
        shape = t.shape
        self.dims.append(len(shape))
        self.dims.extend(shape)
        return len(self.values) - 1

    def saves(self, unit: int, n_saved: int) -> Iterator[Save]:
        """(row, k, shape, dtype) of the live saves of ``units[unit]``, a call that saved
        ``n_saved`` tensors."""
        _, first, at, d = self.units[unit]
        for k in range(n_saved):
            ndim = self.dims[at]
            if self.alive[first + k]:
                yield first + k, k, tuple(self.dims[at + 1:at + 1 + ndim]), self.dtypes[d + k]
            at += 1 + ndim
