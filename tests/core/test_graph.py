"""The Graph's record makers: capture builds its ops and values with ``make_op`` and
``make_value`` (faster than a frozen dataclass's ``__init__``); they must make exactly what
the classes' own constructors make."""

from __future__ import annotations

import dataclasses

from memplan.core import graph as g


def test_make_op_equals_the_constructor() -> None:
    args = (3, "aten.mm.default", "cells.0", (1, 2), (4,), (), (1,), 10, 20, -1, 7, 9)
    made, built = g.make_op(*args), g.Op(*args)
    assert made == built and hash(made) == hash(built)
    assert vars(made) == vars(built)
    assert [f.name for f in dataclasses.fields(g.Op)] == list(vars(made))


def test_make_value_equals_the_constructor() -> None:
    args = (5, 4096, g.ACTIVATION, 3, 4, None, (32, 32), "float32", 12)
    made, built = g.make_value(*args), g.Value(*args)
    assert made == built and hash(made) == hash(built)
    assert vars(made) == vars(built)
    assert [f.name for f in dataclasses.fields(g.Value)] == list(vars(made))
