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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from memplan.runtime.tape import Pos, Scope


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
    of a unit call's saved tensors: ``units`` holds (tape entry, first row) per unit call,
    whose k-th save is row first + k (the shapes and dtypes its forward saved, which its
    replay must give again, are the unit entry's: ``tape.UnitEntry.saved``)."""

    __slots__ = ("alive", "positions", "units", "values")

    def __init__(self) -> None:
        self.alive = bytearray()
        self.values: list[torch.Tensor | None] = []
        self.positions: dict[int, Pos] = {}
        self.units: list[tuple[int, int]] = []

    def add_value(self, pos: Pos) -> int:
        """A row for the tape value at ``pos``."""
        row = len(self.values)
        self.alive.append(1)
        self.values.append(None)
        self.positions[row] = pos
        return row

    def start_unit(self, entry: int) -> None:
        """Unit ``entry``'s call starts: its saves take the next rows."""
        self.units.append((entry, len(self.values)))

    def add_saved(self) -> int:
        """A row for the next tensor the current unit saves."""
        self.alive.append(1)
        self.values.append(None)
        return len(self.values) - 1

    def any_alive(self, first: int, n: int) -> bool:
        """Whether a row of ``first .. first + n - 1`` is alive."""
        return self.alive.find(1, first, first + n) >= 0

    def give(self, first: int, saved: list[torch.Tensor]) -> None:
        """The k-th of ``saved`` to row first + k, where it is alive."""
        alive, values = self.alive, self.values
        for k, value in enumerate(saved):
            if alive[first + k]:
                values[first + k] = value
