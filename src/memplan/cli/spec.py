"""Model specs as the command line writes them.

* a built-in workload: ``resnet:depth=1000,batch=32``, ``lstm:steps=1024``, ``gpt:layers=12``;
* a user factory: ``package.module:callable`` or ``path/to/file.py:callable``, a
  zero-argument callable returning
  ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``. ``example_inputs``: a
  tuple (``model(*inputs)``), one tensor, or a dict of keyword inputs (``model(**batch)``).
  The module is imported only because the spec names it (from the current directory or the
  installed packages; a file as ``python path/to/file.py`` would import its neighbours).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from memplan import models
from memplan.errors import ConfigError, MemplanError, bad_arg
from memplan.models.size import step_size

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_FILE_FACTORY = re.compile(r"^.+\.py:[A-Za-z_][\w.]*$")  # path/to/file.py:callable
_EXAMPLES = ("'resnet:depth=1000,batch=32', 'lstm:steps=1024', 'mypkg.models:make' or "
             "'path/to/models.py:make'")


@dataclass(frozen=True)
class ModelSpec:
    """A resolved MODEL: either a lazy built-in Workload or a user model with its inputs."""

    label: str
    workload: models.Workload | None = None
    model: Any = None
    inputs: tuple[Any, ...] = ()
    loss_fn: Callable[[Any], Any] | None = None
    kwargs: dict[str, Any] | None = None  # keyword inputs (a factory's dict)

    def call_args(self) -> tuple[Any, tuple[Any, ...], dict[str, Any] | None,
                                 Callable[[Any], Any] | None]:
        """``(model_or_workload, inputs, kwargs, loss_fn)`` for capture / measure / plan."""
        if self.workload is not None:
            return self.workload, (), None, None
        return self.model, self.inputs, self.kwargs, self.loss_fn


def estimate(target: ModelSpec) -> str:
    """What a status line calls the model: a built-in's name and its estimated forward ops
    (``memplan.models.size``), or the factory (its size is unknown until its forward runs)."""
    if target.workload is None:
        return target.label
    size = step_size(target.workload.name, target.workload.params)
    return f"{target.workload.name} (about {size.forward_ops:,} forward ops)"


def parse_spec(spec: str, batch: int | None = None) -> models.Workload:
    """``name[:key=value,...]`` -> a lazy Workload. Values are ints, floats or strings;
    ``batch`` (when given) overrides the spec's batch."""
    name, params = split_spec(spec)
    if batch is not None:
        params["batch"] = batch
    return models.get(name, **params)


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name[:key=value,...]`` -> (built-in name, the parameters written), unchecked values."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in models.names():
        raise bad_arg(
            "MODEL", f"a built-in model {models.names()} with optional ':key=value,...', or a "
            "factory 'package.module:callable' or 'path/to/file.py:callable'", spec,
            f"Write e.g. {_EXAMPLES}.",
        )
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip() or not raw.strip():
            raise bad_arg(
                "MODEL", "comma-separated key=value pairs after ':'", item,
                f"Write e.g. '{name}:{next(iter(models.defaults(name)))}=...'.",
            )
        key = key.strip()
        if key in params:
            raise bad_arg("MODEL", "each parameter once", spec,
                          f"'{key}' is given twice: keep one {key}=... .")
        params[key] = _number(raw.strip())
    return name, params


def is_factory(spec: str) -> bool:
    """``package.module:callable`` (no '=' after the colon) and not a built-in name, or
    ``path/to/file.py:callable``."""
    name = spec.partition(":")[0].strip()
    if _FILE_FACTORY.match(spec.strip()):
        return True
    return name not in models.names() and bool(_FACTORY.match(spec.strip()))


def resolve(spec: str, batch: int | None = None) -> ModelSpec:
    """A built-in workload spec or a user factory (``package.module:callable``,
    ``path/to/file.py:callable``)."""
    if batch is not None and (isinstance(batch, bool) or batch < 1):
        raise bad_arg("--batch", "an integer >= 1", batch, "Use e.g. --batch 32.")
    if not is_factory(spec):
        w = parse_spec(spec, batch)
        return ModelSpec(w.spec, workload=w)
    return _from_factory(spec.strip(), batch)


def _from_factory(spec: str, batch: int | None) -> ModelSpec:
    module_name, _, attr = spec.rpartition(":")  # a file path may hold colons, a name not
    fn = _import_callable(module_name, attr)
    kwargs: dict[str, Any] = {}
    if batch is not None:
        if not _accepts(fn, "batch"):
            raise bad_arg("--batch", f"a factory that takes a 'batch' keyword ({spec} does not)",
                          batch, "Drop --batch, or add a batch=... parameter to the factory.")
        kwargs["batch"] = batch
    try:
        result = fn(**kwargs)
    except MemplanError:
        raise
    except (Exception, SystemExit) as err:  # the user's code: report it in one line
        raise ConfigError(
            f"MODEL: factory {spec} raised {_what(err)}. Fix the factory "
            "(run it with --debug for the traceback)."
        ) from err
    return _check_result(spec, result)


def _import_callable(module_name: str, attr: str) -> Callable[..., Any]:
    is_file = module_name.endswith(".py")
    folder = str(Path(module_name).expanduser().resolve().parent) if is_file else os.getcwd()
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)  # as `python -m` or `python file.py` would
    try:
        module = _load_file(module_name) if is_file else importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise bad_arg(
            "MODEL", f"an importable module before ':' (from {folder} or installed)",
            module_name, f"No module named {err.name!r}: check the spelling, run from the "
            "directory that holds it, or install it.",
        ) from err
    except MemplanError:
        raise
    except (Exception, SystemExit) as err:
        raise ConfigError(
            f"MODEL: importing {module_name} raised {_what(err)}. Fix the module "
            "(run with --debug for the traceback)."
        ) from err
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and
                            callable(getattr(module, n)))[:8]
            raise bad_arg("MODEL", f"a callable in {module_name}", attr,
                          f"{module_name} has no {part!r}; its callables include {public}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise bad_arg("MODEL", "a callable after ':'", f"{attr} ({type(obj).__name__})",
                      "Point at a function returning (model, example_inputs[, loss_fn]).")
    fn: Callable[..., Any] = obj
    return fn


def _load_file(path_text: str) -> ModuleType:
    """The module of a Python file, registered under a name of its own (what dataclasses and
    pickle look up), as ``python path/to/file.py`` would run it but not as ``__main__``."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise bad_arg("MODEL", "an existing Python file before ':'", path_text,
                      f"No such file (from {os.getcwd()}): check the path.")
    name = f"memplan_factory_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise bad_arg("MODEL", "a Python file before ':'", path_text,
                      "Name a .py file whose callable returns (model, example_inputs).")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _what(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"SystemExit (it called sys.exit({err.code!r}))"
    return f"{type(err).__name__}: {err}"


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _check_result(spec: str, result: Any) -> ModelSpec:
    import torch
    from torch import nn

    want = "a tuple (model, example_inputs) or (model, example_inputs, loss_fn)"
    fix = ("Return e.g. (model, (x, y)), (model, (x,), lambda out: out.mean()) or, for "
           "keyword inputs, (model, {'input_ids': ids}, lambda out: out.loss) from the "
           "factory.")
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        got = f"{type(result).__name__}" + (f" of length {len(result)}"
                                             if isinstance(result, tuple) else "")
        raise bad_arg(f"MODEL {spec}", want, got, fix)
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise bad_arg(f"MODEL {spec}", "a torch.nn.Module first", type(model).__name__, fix)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    kwargs: dict[str, Any] | None = None
    if isinstance(inputs, dict):  # keyword inputs: model(**inputs)
        if not inputs or not all(isinstance(k, str) for k in inputs):
            raise bad_arg(f"MODEL {spec}", "a non-empty dict with string keys (keyword inputs) "
                          "second", f"dict with keys {list(inputs)[:5]}", fix)
        inputs, kwargs = (), dict(inputs)
    elif not isinstance(inputs, tuple) or not inputs:
        raise bad_arg(f"MODEL {spec}", "a non-empty tuple of example inputs, or a dict of "
                      "keyword inputs, second", type(inputs).__name__, fix)
    if loss_fn is not None and not callable(loss_fn):
        raise bad_arg(f"MODEL {spec}", "a callable loss_fn third", type(loss_fn).__name__, fix)
    return ModelSpec(spec, model=model, inputs=inputs, loss_fn=loss_fn, kwargs=kwargs)


def _number(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
