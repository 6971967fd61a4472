"""``fake_copy``'s direct id tables (``_DirectIds``) leave ``from_tensor``'s describer and memos
as its public accessors (``_Ids``) leave them: the same ids for the same tensors and storages,
the same memo entries, the same copies found again by ``from_tensor``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.tracing import fake as fake_module
from memplan.tracing.fake import _DirectIds, _Ids, fake_state
from tests.tracing.test_capture_speed import ParamAliases


def _state(direct: bool, monkeypatch: Any) -> tuple[Any, ...]:
    """fake_state of a model meeting its tensors several ways, then what the describer and
    the memos hold for each of its tensors and storages."""
    monkeypatch.setattr(fake_module, "_direct_tables", lambda describer: direct)
    torch.manual_seed(0)
    model = ParamAliases()
    model.extra = torch.nn.Parameter(torch.randn(4, 8)[1:])  # a view: torch's way
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    meta = fake.fake_tensor_converter.meta_converter
    assert type(_Ids.of(meta.describer)) is (_DirectIds if direct else _Ids)
    params, buffers = fake_state(fake, model)
    copies = {**params, **buffers}
    real = dict(model.named_parameters()) | dict(model.named_buffers())
    describer = meta.describer
    ids = {name: (describer.lookup_tensor.get(t), describer.lookup_storage.get(t.untyped_storage()))
           for name, t in real.items()}
    found = {name: fake.from_tensor(t) is copies[name] for name, t in real.items()}
    tensor_memo = sorted(meta.tensor_memo.keys())
    storage_memo = sorted(meta.storage_memo.keys())
    shapes = {name: (tuple(t.shape), t.stride(), t.requires_grad, type(t).__name__,
                     isinstance(t, torch.nn.Parameter)) for name, t in copies.items()}
    return (ids, found, tensor_memo, storage_memo, shapes, describer.next_tensor_id,
            describer.next_storage_id)


def test_direct_ids_leave_the_describer_as_its_accessors_do(monkeypatch: Any) -> None:
    direct = _state(True, monkeypatch)
    public = _state(False, monkeypatch)
    assert direct == public
    ids, found = direct[0], direct[1]
    assert all(tid is not None and sid is not None for tid, sid in ids.values())
    assert all(found.values())


@pytest.mark.parametrize("attr", ["lookup_tensor", "next_storage_id"])
def test_other_id_tables_take_the_public_accessors(attr: str) -> None:
    describer = FakeTensorMode().fake_tensor_converter.meta_converter.describer
    assert type(_Ids.of(describer)) is _DirectIds
    setattr(describer, attr, {} if attr == "lookup_tensor" else None)
    assert type(_Ids.of(describer)) is _Ids
