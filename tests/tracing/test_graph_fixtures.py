"""The stored graphs the torch-free core tests use (tests/core/data) equal fresh captures: a
capture change shows up here, and `python -m tests.core.graphs` writes them again."""

from __future__ import annotations

import pytest

from tests.core import graphs


@pytest.mark.parametrize("name", graphs.NAMES)
def test_stored_graph_equals_a_fresh_capture(name: str) -> None:
    assert graphs.tiny(name).to_json() == graphs.capture(name).to_json()
