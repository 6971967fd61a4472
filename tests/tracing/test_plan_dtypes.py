"""The dtypes a plan file may name are the ones the fake forward maps to torch dtypes: a fixed
list, never ``getattr(torch, <string from the file>)``."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import memplan
from memplan.core.plan_schema import AUTOCAST_DTYPES, DTYPE_NAMES
from memplan.tracing.fake import DTYPES


def test_plan_dtype_names_are_the_fake_forward_dtypes() -> None:
    assert sorted(DTYPE_NAMES) == sorted(DTYPES)
    assert set(AUTOCAST_DTYPES) <= set(DTYPES)
    assert all(DTYPES[name].is_floating_point for name in AUTOCAST_DTYPES)
    assert all(isinstance(d, torch.dtype) for d in DTYPES.values())


def test_no_getattr_of_torch_with_a_computed_name() -> None:
    src = Path(memplan.__file__).parent
    found = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                    and node.args and ast.unparse(node.args[0]).startswith("torch") \
                    and not isinstance(node.args[1], ast.Constant):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
