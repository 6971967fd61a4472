"""Repeated fake ops at a fraction of the cost: ``FakeTensorMode``'s own cache entries, found by
a cheaper key and built into outputs without its generic machinery.

A captured step repeats the same few ops on the same shapes thousands of times (residual units,
LSTM steps, decoder layers). ``FakeTensorMode`` caches an op's output metadata already, but
most of an op's time goes to building its cache key (a generic walk over the arguments and 17
properties of every tensor) and to rebuilding the output. Here a key made of the same
information for the arguments memplan sees (shape, stride, dtype, device and flags of plain fake
tensors, their storage offset and size where an output may alias them; scalars with their
types) maps to ``FakeTensorMode``'s entry,
found once the key repeats, and outputs are made as ``FakeTensorMode`` makes them from that
entry. Anything else (constants, real or symbolic values, nested containers, ops it does not
cache) takes the normal path. ``tests/tracing/test_capture_speed.py`` checks the result equals
the normal path's, graph for graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    TensorMetadata,
    _BypassDispatchCache,
    _DispatchCacheEntryOutputInfo,
    _DispatchCacheValidEntry,
    in_kernel_invocation_manager,
)
from torch.utils._pytree import tree_leaves

from memplan.tracing.closed_forms import CLOSED_FORMS

_SEEN = object()  # seen once: the next call looks up the entry
_NEVER = object()  # this key takes the normal path
_UNCACHED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output,
                  torch.Tag.inplace_view)
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)
_SELECT = torch.ops.aten.select.int
_DETACH = torch.ops.aten.detach.default
_META = torch.device("meta")
_ATEN = torch.ops.aten
# Ops FakeTensorMode runs as Python decompositions, every inner op through its dispatch: a
# batch norm's first call at a shape takes 15-20 ms, most of a ResNet's cache misses. Their
# meta kernels make the same outputs in a quarter of that where the predicate holds (not
# elsewhere: in eval mode and on bfloat16 input, batch norm's saved statistics differ;
# tests/tracing/test_opcache.py checks each op over layouts and dtypes); the outputs'
# metadata is then this cache's entry.
_META_FIRST: dict[Any, Callable[[tuple[Any, ...]], bool]] = {
    _ATEN.native_batch_norm.default: lambda a: a[5] is True and a[0].dtype == torch.float32,
    _ATEN.native_batch_norm_backward.default: lambda a: a[1].dtype == torch.float32,
    _ATEN.threshold_backward.default: lambda a: True,
}


class FakeOpCache:
    """``call(func, args, kwargs)``: ``func(*args, **kwargs)`` under ``fake``, built from
    ``FakeTensorMode``'s cache entry when the arguments' metadata has been seen before."""

    def __init__(self, fake: FakeTensorMode) -> None:
        self.fake = fake
        # Keyed by id(func) (an OpOverload hashes in Python); each value holds func itself, so
        # that an id reused by another overload is never taken for it.
        self._entries: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._ops: dict[int, tuple[Any, bool, bool]] = {}  # id -> (func, cacheable, aliasing)
        self._make = _fast_fake_tensor if _fast_matches(fake) else _slow_fake_tensor

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is _DETACH and not kwargs:
            out = self._detach(*args)
            if out is not None:
                return out
        if func is _SELECT and not kwargs:
            out = self._select(*args)
            if out is not None:
                return out
        known = self._ops.get(id(func))
        if known is None or known[0] is not func:
            known = self._ops[id(func)] = (
                func,
                self.fake.cache_enabled and self.fake.shape_env is None
                and not any(t in func.tags for t in _UNCACHED_TAGS),
                func.is_view or any(r.alias_info is not None for r in func._schema.returns))
        key = self._key(func, args, kwargs, known[2]) if known[1] else None
        if key is None:
            return func(*args, **kwargs)
        hit = self._entries.get(key)
        found = None if hit is None or hit[0] is not func else hit[1]
        if found is None and func in _META_FIRST and not kwargs and _META_FIRST[func](args):
            out, entry = self._meta_first(func, args)
            self._entries[key] = (func, entry)
            return out
        if found is None:
            self._entries[key] = (func, _SEEN)
            return func(*args, **kwargs)
        if found is _SEEN:
            # The fake mode made its entry at the first call: read it now, sparing the fake
            # mode's dispatch of this call (unless these very arguments have none yet).
            found = self._lookup_entry(func, args, kwargs, known[2])
            if found is None:
                out = func(*args, **kwargs)
                self._entries[key] = (func, self._lookup_entry(func, args, kwargs, known[2])
                                      or _NEVER)
                return out
            self._entries[key] = (func, found)
        if found is _NEVER:
            return func(*args, **kwargs)
        is_tuple, recipes = found
        if is_tuple:
            return tuple(self._output(r, args) for r in recipes)
        return self._output(recipes[0], args)

    def _meta_first(self, func: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(output, entry) of a ``_META_FIRST`` op, called without keywords: run as the fake
        mode runs an op on its meta kernel (plain fake tensors of one device, as ``_key`` let
        through), the entry read off the outputs (fresh tensors: these ops alias nothing);
        where ``closed_forms`` knows the outputs' layouts, made from those instead."""
        flat: list[Any] = [a for a in tree_leaves(args) if isinstance(a, FakeTensor)]
        if len({a.fake_device for a in flat}) != 1:
            return func(*args), _SEEN
        closed = self._closed_form(func, args, flat[0].fake_device)
        if closed is not None:
            return closed
        with in_kernel_invocation_manager(self.fake):
            raw = func(*args)
        no_device: Any = None  # as the fake mode passes it: these ops take no device argument
        out = self.fake.wrap_meta_outputs_with_default_device_logic(raw, func, flat, no_device)
        outs = out if isinstance(out, tuple) else (out,)
        recipes = tuple(self._fresh_recipe(t) for t in outs)
        entry = _SEEN if any(r is None for r in recipes) else (isinstance(out, tuple), recipes)
        return out, entry

    def _closed_form(self, func: Any, args: tuple[Any, ...], device: torch.device
                     ) -> tuple[Any, Any] | None:
        """(output, entry) of ``func`` from the layouts ``closed_forms`` works out (None: it
        cannot, here)."""
        form = CLOSED_FORMS.get(func)
        layouts = None if form is None else form(args)
        if layouts is None:
            return None
        recipes = tuple(_NO_OUTPUT if lay is None else _fresh(lay[0], lay[1], torch.float32,
                                                              False, device) for lay in layouts)
        return tuple(self._output(r, args) for r in recipes), (True, recipes)

    def _fresh_recipe(self, t: Any) -> tuple[Any, ...] | None:
        """``_recipe`` of a fresh output (None: not one ``_output`` can remake)."""
        if t is None:
            return _NO_OUTPUT
        if not self._plain(t) or t.storage_offset() != 0 or t.untyped_storage().nbytes() != \
                _storage_bytes(t.shape, t.stride(), t.element_size()):
            return None
        return _fresh(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad,
                      t.fake_device)

    def _output(self, recipe: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """``FakeTensorMode._get_output_tensor_from_cache_entry`` for shape_env None, from
        the entry's fields laid out by ``_recipe``."""
        inplace, view, shape, stride, dtype, grad, conj, neg, offset, device, value = recipe
        if inplace >= 0:
            return args[inplace]
        if shape is None:
            return value
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(shape, stride, dtype=dtype, device=_META,
                                        requires_grad=grad)
            if conj:
                torch._C._set_conj(empty, True)
            if neg:
                torch._C._set_neg(empty, True)
            if view >= 0:
                empty.set_(args[view].untyped_storage(), offset, shape, stride)
        return self._make(self.fake, empty, device)

    def _plain(self, t: Any) -> bool:
        """Whether ``t`` is a fake tensor of this mode whose aliases ``_alias`` makes as torch's
        fake kernels do: strided, no constant, no conjugate or negative bit, not quantized."""
        return type(t) is FakeTensor and t.fake_mode is self.fake and t.constant is None \
            and t.layout is torch.strided and not t.is_quantized and not t.is_conj() \
            and not t.is_neg()

    def _alias(self, t: Any, offset: int, shape: Any, stride: Any) -> Any:
        """A fake tensor over ``t``'s storage with this geometry (not requiring grad)."""
        with torch._C._DisableTorchDispatch():
            view = torch.empty((0,), dtype=t.dtype, device=_META)
            view.set_(t.untyped_storage(), offset, shape, stride)
        return self._make(self.fake, view, t.fake_device)

    def _detach(self, t: Any) -> Any:
        """``t.detach()``: autograd unpacks every saved tensor through one (a new key at every
        call, the storage offset and size being part of it); an alias of ``t``, as the fake
        mode makes it from its cache entry."""
        with _direct_reads():
            if not self._plain(t):
                return None
            return self._alias(t, t.storage_offset(), t.shape, t.stride())

    def _select(self, t: Any, dim: Any, index: Any) -> Any:
        """``t.select(dim, index)``, an RNN's ``x[t]``: a new key at every index, so never a
        cache hit; worked out as torch's fake kernel (``meta_select``) does."""
        if type(dim) is not int or type(index) is not int or not self._plain(t) or not t.dim():
            return None
        shape, stride = list(t.shape), list(t.stride())
        dim = dim + len(shape) if dim < 0 else dim
        if not 0 <= dim < len(shape):
            return None
        size = shape[dim]
        index = index + size if index < 0 else index
        if not 0 <= index < size:
            return None  # the normal path raises torch's own error
        offset = t.storage_offset() + index * stride[dim]
        del shape[dim], stride[dim]
        return self._alias(t, offset, shape, stride)

    def _lookup_entry(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      aliasing: bool) -> Any:
        """``FakeTensorMode``'s entry for this call, made when it ran it or one like it (None:
        it has none yet; _NEVER: it keeps none, having found the op or its output not
        cacheable)."""
        try:
            ftm_key = self.fake._cache_key(_CacheKeyState(None), func, args, kwargs)
        except (_BypassDispatchCache, TypeError):  # it would not cache this call either
            return _NEVER
        entry = FakeTensorMode.cache.get(ftm_key)
        if entry is None:
            return None
        if not isinstance(entry, _DispatchCacheValidEntry) or not all(
                _plain_info(i) for i in entry.output_infos):
            return _NEVER
        if not aliasing and any(i.inplace_idx is not None or i.view_idx is not None
                                            for i in entry.output_infos):
            return _NEVER  # an output aliases an argument after all: keep the exact path
        return entry.is_output_tuple, tuple(_recipe(i, func.is_view) for i in entry.output_infos)

    def _key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], aliasing: bool
             ) -> tuple[Any, ...] | None:
        key: list[Any] = [id(func), torch.get_default_dtype(), torch.is_inference_mode_enabled()]
        with _direct_reads():
            if not self._describe(args, key, aliasing):
                return None
            if kwargs:
                key.append(tuple(kwargs))
                if not self._describe(tuple(kwargs.values()), key, aliasing):
                    return None
        return tuple(key)

    def _describe(self, args: tuple[Any, ...] | list[Any], key: list[Any], storage: bool
                  ) -> bool:
        """Append what ``FakeTensorMode``'s key holds for each argument (the storage offset
        and size only when the output may alias an argument: fresh outputs do not depend
        on them); False when one is not a plain fake tensor of this mode, a scalar or a flat
        list of those."""
        key.append(len(args))
        for a in args:
            if type(a) is FakeTensor:
                if a.fake_mode is not self.fake or a.constant is not None \
                        or a.layout is not torch.strided or a.is_quantized:
                    return False
                meta: tuple[Any, ...] = (a.shape, a.stride(), a.dtype, a.fake_device, a.requires_grad,
                        a.is_conj(), a.is_neg(), a.is_inference())
                if storage:
                    meta += (a.storage_offset(), a.untyped_storage().nbytes())
                key.append(meta)
            elif isinstance(a, _SCALARS):
                key.append((type(a), a))
            elif isinstance(a, (list, tuple)):
                key.append(type(a))
                if any(isinstance(b, (list, tuple)) for b in a) \
                        or not self._describe(a, key, storage):
                    return False
            else:
                return False
        return True


def _recipe(info: _DispatchCacheEntryOutputInfo, is_view: bool) -> tuple[Any, ...]:
    """An entry's output, as the fields ``_output`` reads (-1: no such index)."""
    inplace = -1 if info.inplace_idx is None else info.inplace_idx
    md: Any = info.metadata
    if md is None:
        return (inplace, -1, None, None, None, False, False, False, 0, None,
                info.constant_value)
    view = int(info.view_idx) if is_view and info.view_idx is not None else -1
    return (inplace, view, tuple(md.shape), tuple(md.stride), md.dtype, md.requires_grad,
            md.is_conj, md.is_neg, md.storage_offset, md.device, None)


def _direct_reads() -> Any:
    """A block in which a fake tensor's metadata (shape, strides, dtype, flags) is read
    without torch-function subclass handling. ``FakeTensor`` turns that handling off
    (``_disabled_torch_function_impl``), yet each read still looks the override up on the
    class: three times the cost (0.5 us, a dozen reads per argument of every op). Where this
    torch's FakeTensor has an override of its own, the reads keep going through it."""
    return contextlib.nullcontext() if _SUBCLASS_OFF is None else _SUBCLASS_OFF()


_DISABLED = getattr(torch._C, "_disabled_torch_function_impl", None)
_SUBCLASS_OFF = getattr(torch._C, "DisableTorchFunctionSubclass", None) \
    if _DISABLED is not None and FakeTensor.__torch_function__ is _DISABLED else None
_NO_OUTPUT = (-1, -1, None, None, None, False, False, False, 0, None, None)  # a None output


def _fresh(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, grad: bool,
           device: torch.device) -> tuple[Any, ...]:
    """The recipe of a fresh output: its own storage, from offset 0."""
    return (-1, -1, shape, stride, dtype, grad, False, False, 0, device, None)


def _storage_bytes(shape: Any, stride: Any, itemsize: int) -> int:
    """The bytes ``empty_strided(shape, stride)`` allocates."""
    if any(n == 0 for n in shape):
        return 0
    return int((1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize)


def _plain_info(info: _DispatchCacheEntryOutputInfo) -> bool:
    md = info.metadata
    return md is None or (isinstance(md, TensorMetadata) and md.layout is torch.strided
                          and all(type(v) is int for v in (*md.shape, *md.stride,
                                                           md.storage_offset)))


def fake_tensor(fake: FakeTensorMode, elem: torch.Tensor, device: torch.device,
                requires_grad: bool = False) -> torch.Tensor:
    """A fake tensor on ``device`` over the meta tensor ``elem`` (``FakeTensor(fake, elem,
    device)``), a leaf that requires grad if asked."""
    make = _fast_fake_tensor if _fast_matches(fake) else _slow_fake_tensor
    out = make(fake, elem, device)
    return out.requires_grad_() if requires_grad else out


def _slow_fake_tensor(fake: FakeTensorMode, elem: torch.Tensor, device: torch.device
                      ) -> torch.Tensor:
    return FakeTensor(fake, elem, device)


_PROTO: dict[str, Any] = {}


def _fast_fake_tensor(fake: FakeTensorMode, elem: torch.Tensor, device: torch.device
                      ) -> torch.Tensor:
    """``FakeTensor(fake, elem, device)`` without its argument checks: the same subclass
    call and the same attributes (``_fast_matches`` checks they are)."""
    t = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                    device_for_backend_keys=device)
    if fake._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    state = t.__dict__
    state.update(_PROTO)
    state["_fake_device"] = device
    state["fake_mode"] = fake
    return t


_CHECKED: list[bool] = []


def _fast_matches(fake: FakeTensorMode) -> bool:
    """Whether ``_fast_fake_tensor`` makes what ``FakeTensor`` makes in this torch (checked
    once)."""
    if not _CHECKED:
        _CHECKED.append(_check_fast(fake))
    return _CHECKED[0]


def _check_fast(fake: FakeTensorMode) -> bool:
    with torch._C._DisableTorchDispatch():
        elem = torch.empty_strided((2, 3), (3, 1), device="meta")
    ref = FakeTensor(fake, elem, torch.device("cpu"))
    _PROTO.clear()
    _PROTO.update({k: v for k, v in ref.__dict__.items() if k not in ("_fake_device",
                                                                       "fake_mode")})
    if any(v is not None for v in _PROTO.values()):
        return False
    fast = _fast_fake_tensor(fake, elem, torch.device("cpu"))
    return (fast.__dict__ == ref.__dict__ and type(fast) is type(ref)
            and str(torch._C._dispatch_keys(fast)) == str(torch._C._dispatch_keys(ref))
            and fast.device == ref.device)
