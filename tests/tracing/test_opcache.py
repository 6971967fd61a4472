"""``FakeOpCache``'s meta-kernel first calls (``_META_FIRST``) make what FakeTensorMode's own
dispatch makes (its Python decompositions), output for output, first call and cached calls,
over the layouts and dtypes models feed them; batch norm in training from its closed form
(``closed_forms``) where that holds, from the meta kernel elsewhere (a size-1 dimension,
a gradient laid out unlike the input)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.tracing import closed_forms
from memplan.tracing.opcache import _META_FIRST, FakeOpCache

A = torch.ops.aten
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t,
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last)
    if t.dim() == 4 else t,
    # Dense in another order (a batch-last view; column-major for 2-d).
    "transposed": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1),
    "sliced": lambda t: t[::2],  # not dense at all
}
SHAPES = [(6, 4, 5, 3), (6, 4, 7), (6, 4), (6, 4, 1, 3)]


def _meta(out: Any) -> list[Any]:
    outs = out if isinstance(out, tuple) else (out,)
    return [None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device,
                                     t.storage_offset(), t.untyped_storage().nbytes(),
                                     t.requires_grad, type(t)) for t in outs]


def _calls(shape: tuple[int, ...], layout: str, dtype: torch.dtype
           ) -> list[tuple[Any, tuple[Any, ...]]]:
    lay = LAYOUTS[layout]
    c = shape[1]

    def x() -> torch.Tensor:
        return lay(torch.empty(shape, dtype=dtype))

    w, b = torch.empty(c), torch.empty(c)
    mean, var = torch.empty(c), torch.empty(c)
    inp = x()
    _, save_mean, save_invstd = A.native_batch_norm.default(inp, w, b, mean, var, True,
                                                             0.1, 1e-5)
    return [
        (A.native_batch_norm.default, (inp, w, b, mean, var, True, 0.1, 1e-5)),
        (A.native_batch_norm.default, (inp, None, None, None, None, True, 0.1, 1e-5)),
        (A.native_batch_norm.default, (inp, w, b, mean, var, False, 0.1, 1e-5)),
        (A.native_batch_norm_backward.default, (x(), inp, w, mean, var, save_mean,
                                                save_invstd, True, 1e-5, [True, True, True])),
        (A.native_batch_norm_backward.default, (x(), inp, w, mean, var, save_mean,
                                                save_invstd, True, 1e-5, [True, False, False])),
        (A.native_batch_norm_backward.default, (x().contiguous(), inp, None, None, None,
                                                save_mean, save_invstd, True, 1e-5,
                                                [True, True, False])),
        (A.threshold_backward.default, (x(), inp, 0.0)),
        (A.threshold_backward.default, (x().contiguous(), inp, 0)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES)
def test_meta_first_calls_equal_the_fake_modes(shape: tuple[int, ...], layout: str,
                                               dtype: torch.dtype) -> None:
    fake = FakeTensorMode()
    cache = FakeOpCache(fake)
    with fake:
        calls = _calls(shape, layout, dtype)
    seen = set()
    for func, args in calls:
        assert func in _META_FIRST
        seen.add(func)
        with fake:
            want = _meta(func(*args))
        first = _meta(cache.call(func, args, {}))  # the meta kernel
        again = _meta(cache.call(func, args, {}))  # made from the entry read off it
        assert first == want, func
        assert again == want, func
    assert seen == set(_META_FIRST)


def test_meta_first_calls_take_the_meta_kernel_then_the_entry() -> None:
    fake = FakeTensorMode()
    cache = FakeOpCache(fake)
    with fake:
        x, w = torch.empty(8, 3, 4, 4), torch.empty(3)
    args = (x, w, w, w.clone(), w.clone(), True, 0.1, 1e-5)
    before = FakeTensorMode.cache_info()
    for _ in range(3):
        cache.call(A.native_batch_norm.default, args, {})
    after = FakeTensorMode.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)  # fake mode untouched


def test_training_batch_norm_takes_its_closed_form(monkeypatch: Any) -> None:
    fake = FakeTensorMode()
    cache = FakeOpCache(fake)
    with fake:
        calls = [(func, args) for func, args in _calls((6, 4, 5, 3), "channels_last",
                                                        torch.float32)
                 if func in closed_forms.CLOSED_FORMS
                 and closed_forms.CLOSED_FORMS[func](args) is not None]
    assert {func for func, _ in calls} == set(closed_forms.CLOSED_FORMS) and len(calls) == 4

    def decomposed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the meta kernel's decomposition ran")

    decompositions = torch._decomp.decompositions
    monkeypatch.setattr(decompositions, "native_batch_norm_helper", decomposed)
    monkeypatch.setattr(decompositions, "_broadcast_batch_norm_backward", decomposed)
    for func, args in calls:
        cache.call(func, args, {})


def test_a_repeated_call_takes_the_fake_modes_entry_from_its_first(monkeypatch: Any) -> None:
    """The fake mode runs an op once per key: its second call is made from the entry the
    first one left, as every later call; the outputs are the fake mode's."""
    fake = FakeTensorMode()
    cache = FakeOpCache(fake)
    with fake:
        a, b = torch.empty(7, 5), torch.empty(5)
        want = _meta(A.mul.Tensor(a, b))
    FakeTensorMode.cache.clear()
    dispatched = []
    dispatch = FakeTensorMode.dispatch

    def counted(self: FakeTensorMode, func: Any, *args: Any, **kwargs: Any) -> Any:
        dispatched.append(func)
        return dispatch(self, func, *args, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    outs = [_meta(cache.call(A.mul.Tensor, (a, b), {})) for _ in range(3)]
    assert outs == [want] * 3
    assert dispatched == [A.mul.Tensor]


def test_keys_read_with_subclass_handling_off_equal_keys_read_through_it(
        monkeypatch: Any) -> None:
    """``_direct_reads`` (torch-function subclass handling off while a key reads its
    arguments, FakeTensor having none of its own) leaves every key and detach as reading
    through the handling makes them."""
    from memplan.tracing import opcache

    assert opcache._SUBCLASS_OFF is not None  # this torch's FakeTensor disables its own
    fake = FakeTensorMode()
    cache = FakeOpCache(fake)
    with fake:
        calls = _calls((6, 4, 5, 3), "channels_last", torch.float32)
        x = torch.empty(6, 4, 5, 3)[1:].transpose(1, 2)
    calls += [(A.convolution.default, (x, torch.empty(2, 5, 1, 1), None, [1, 1], [0, 0], [1, 1],
                                       False, [0, 0], 1)), (A.view.default, (x.contiguous(), [-1]))]
    calls = [(f, tuple(_fake(a, fake) for a in args)) for f, args in calls]

    def read() -> list[Any]:
        keys = [cache._key(f, args, {}, aliasing) for f, args in calls for aliasing in (0, 1)]
        return keys + [_meta(cache._detach(x))]

    direct = read()
    monkeypatch.setattr(opcache, "_SUBCLASS_OFF", None)
    assert read() == direct
    assert all(k is not None for k in direct)


def _fake(a: Any, fake: FakeTensorMode) -> Any:
    return a if not isinstance(a, torch.Tensor) or hasattr(a, "fake_mode") \
        else fake.from_tensor(a)
