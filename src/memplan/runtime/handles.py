"""The handles autograd keeps instead of a recompute scope's tensors, and the scope's table of
them.

A handle is made per tensor autograd saves in a scope: thousands per step on a small-op model
(an LSTM step saves ~45). Each object that outlives the forward and is tracked by Python's
garbage collector counts towards its next collection, and the survivors are walked again by
the older generations' ones; so a save makes one such object, the ``Handle``, and what the
replay needs to know about it goes in its scope's ``HandleTable``, columns of ints and
shared objects (no object per save). A handle clears its row when autograd drops it, so
replay gives values only to the handles still alive, and a value lives as long as its
handle.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memplan.runtime.tape import Scope


class Handle:
    """What autograd keeps for a tensor of a recomputed scope: its row in the scope's table."""

    __slots__ = ("owner", "row")

    def __init__(self, owner: Scope, row: int) -> None:
        self.owner = owner
        self.row = row

    def __del__(self) -> None:
        self.owner.table.release(self.row)


class HandleTable:
    """A scope's handles, a row each: the tape position (entry, output index), or for a
    unit's saved tensor (entry, k-th save) with the shape and dtype its forward saved (which
    the call's replay must give again); whether autograd still holds it; its value, once
    replayed."""

    __slots__ = ("alive", "dims", "dims_at", "dtypes", "entry", "item", "values")

    def __init__(self) -> None:
        self.entry = array("q")
        self.item = array("q")
        self.alive = bytearray()
        self.values: list[torch.Tensor | None] = []
        self.dtypes: list[torch.dtype | None] = []  # None: a tape value, not a unit's save
        self.dims_at = array("q")  # where the row's shape starts in ``dims`` (ndim, sizes)
        self.dims = array("q")

    def add(self, entry: int, item: int) -> int:
        """A row for the tape value at (entry, item)."""
        self.entry.append(entry)
        self.item.append(item)
        self.alive.append(1)
        self.values.append(None)
        self.dtypes.append(None)
        self.dims_at.append(-1)
        return len(self.values) - 1

    def add_saved(self, entry: int, k: int, t: torch.Tensor) -> int:
        """A row for the k-th tensor unit ``entry`` saves, ``t``."""
        row = self.add(entry, k)
        self.dtypes[row] = t.dtype
        self.dims_at[row] = len(self.dims)
        self.dims.append(t.dim())
        self.dims.extend(t.shape)
        return row

    def release(self, row: int) -> None:
        self.alive[row] = 0
        self.values[row] = None

    def live(self) -> list[int]:
        return [r for r, a in enumerate(self.alive) if a]

    def saved(self, row: int) -> bool:
        """Whether the row is a unit's saved tensor (else a tape value)."""
        return self.dtypes[row] is not None

    def meta(self, row: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype the unit's forward saved (rows of ``add_saved``)."""
        at = self.dims_at[row]
        dtype = self.dtypes[row]
        assert at >= 0 and dtype is not None
        return tuple(self.dims[at + 1:at + 1 + self.dims[at]]), dtype
