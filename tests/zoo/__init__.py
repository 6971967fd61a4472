"""The zoo (issue 11): models that nobody here wrote, built the way their users build them.

Each entry is a tiny random-init config (nothing downloaded), dropout on, with a builder
``build(seed) -> (model, inputs, loss_fn)`` that is deterministic from the seed (``inputs``: a
tuple, or a dict of keyword inputs passed as ``kwargs=``, as ``model(**batch)`` takes them). A library's
import lives inside its builders, so a missing library skips only its own entries.
``tests/zoo/check.py`` runs one entry plain and planned; ``benchmarks/zoo.py`` runs them all.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Built = tuple[Any, tuple[Any, ...] | dict[str, Any], Callable[[Any], Any]]


@dataclass(frozen=True)
class Entry:
    name: str
    library: str  # the import name of the library the model comes from ("torch" for plain)
    build: Callable[[int], Built]
    slow: bool = False  # left out of the default test run (tests/test_zoo.py)


def split(example: tuple[Any, ...] | dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A built entry's inputs as (positional, keyword)."""
    return ((), dict(example)) if isinstance(example, dict) else (tuple(example), {})


def installed(library: str) -> bool:
    return importlib.util.find_spec(library) is not None


def _collect() -> dict[str, Entry]:
    from tests.zoo import monai_zoo, pyg_zoo, torch_zoo, transformers_zoo, xtransformers_zoo

    out: dict[str, Entry] = {}
    for module in (transformers_zoo, xtransformers_zoo, monai_zoo, pyg_zoo, torch_zoo):
        for entry in module.ENTRIES:
            if entry.name in out:
                raise ValueError(f"zoo: two entries named {entry.name!r}")
            out[entry.name] = entry
    return out


ZOO: dict[str, Entry] = _collect()
