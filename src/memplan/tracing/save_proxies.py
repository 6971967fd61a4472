"""Saves split from the values they save, in a fake step: autograd keeps a proxy of an
activation (a fake tensor of its geometry over a storage of its own, counted as the same
value) instead of the tensor itself. The value lives while either lives; the event at which
its own storage dies in the forward is when it would die had autograd saved nothing
(``Value.death_unsaved``), found without a second forward.

A mixin of ``StepTracer``: it needs the tracer's values, storages, fake mode and events.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memplan.core import graph as g
from memplan.tracing.opcache import fake_tensor

_META = torch.device("meta")


class SaveProxies:
    """Per value: its save proxies alive, whether its own storage died (orphaned), and the
    forward event at which it did (``user_deaths``)."""

    values: list[Any]
    fake: FakeTensorMode | None
    event: int
    live_bytes: int
    _by_storage: dict[int, int]

    def _init_proxies(self) -> None:
        self._proxies: dict[int, int] = {}
        self._proxy_watch: dict[weakref.ref[Any], tuple[int, int]] = {}
        self._orphaned: set[int] = set()
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
        self.user_deaths: dict[int, int] = {}
        self.frees = 0  # storage and proxy deaths seen: a stamped call must see none (stamp)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Saved-tensor pack hook of a fake step: a proxy of ``t`` (see the module's doc)."""
        if type(t) is not FakeTensor:
            return t
        hit = self._packed.get(id(t))
        if hit is not None:
            mine, proxy = hit[0](), hit[1]()
            if mine is t and proxy is not None:
                return proxy  # saved again (the same tensor, as another op's input)
        key = t.untyped_storage()._cdata
        vid = self._by_storage.get(key)
        if vid is None or not self.proxiable(t, vid):
            return t
        assert self.fake is not None  # proxiable
        with torch._C._DisableTorchDispatch():
            storage = torch.UntypedStorage(  # type: ignore[no-untyped-call]
                self.values[vid].nbytes, device=_META)
            elem = torch.empty((0,), dtype=t.dtype, device=_META)
            elem.set_(storage, t.storage_offset(), t.shape, t.stride())
        proxy = fake_tensor(self.fake, elem, t.fake_device)
        pkey = storage._cdata
        self._by_storage[pkey] = vid
        self._proxy_watch[weakref.ref(storage, self._on_proxy_free)] = (pkey, vid)
        self._proxies[vid] = self._proxies.get(vid, 0) + 1
        self._packed[id(t)] = (weakref.ref(t), weakref.ref(proxy))
        return proxy

    def proxiable(self, t: torch.Tensor, vid: int) -> bool:
        """Whether ``pack`` splits a save of ``t`` (a fake tensor, value ``vid``) from it."""
        return self.values[vid].kind == g.ACTIVATION and self.fake is not None \
            and getattr(t, "fake_mode", None) is self.fake and t.layout is torch.strided \
            and not t.is_conj() and not t.is_neg()

    def hold(self, vid: int) -> None:
        """A save split from its value without a proxy tensor: a stamped call, which knows
        the event its node releases it at (``release``)."""
        self._proxies[vid] = self._proxies.get(vid, 0) + 1

    def release(self, vid: int) -> None:
        self.frees += 1
        self._proxy_gone(vid)

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _on_proxy_free(self, ref: weakref.ref[Any]) -> None:
        key, vid = self._proxy_watch.pop(ref)
        self.frees += 1
        if self._by_storage.get(key) == vid:
            del self._by_storage[key]
        self._proxy_gone(vid)

    def _proxy_gone(self, vid: int) -> None:
        left = self._proxies[vid] - 1
        if left:
            self._proxies[vid] = left
            return
        del self._proxies[vid]
        if vid in self._orphaned:
            self._orphaned.discard(vid)
            rec = self.values[vid]
            rec.death = self.event
            self.live_bytes -= rec.nbytes
