"""Module calls reported to the tracer by their path, through torch's global module hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from memplan.tracing.tracer import StepTracer


@contextmanager
def module_hooks(tracer: StepTracer, root: torch.nn.Module) -> Iterator[None]:
    """Report module calls under ``root`` to the tracer, by their path."""
    names = {id(m): name for name, m in root.named_modules()}
    pre: Callable[..., None] = lambda mod, inp: _pre(tracer, names, mod)
    post: Callable[..., None] = lambda mod, inp, out: _post(tracer, names, mod)
    with global_module_hooks(pre, post):
        yield


@contextmanager
def global_module_hooks(pre: Callable[..., None], post: Callable[..., None],
                        post_kwargs: bool = False) -> Iterator[None]:
    """Forward pre- and post-hooks on every module call while the block runs; ``post_kwargs``:
    the post-hook is called as ``post(module, args, kwargs, out)`` (torch gives a global
    pre-hook no keyword arguments)."""
    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post, with_kwargs=post_kwargs)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _pre(tracer: StepTracer, names: dict[int, str], mod: torch.nn.Module) -> None:
    name = names.get(id(mod))
    if name is not None:
        tracer.module_pre(name)


def _post(tracer: StepTracer, names: dict[int, str], mod: torch.nn.Module) -> None:
    if names.get(id(mod)) is not None:
        tracer.module_post()
