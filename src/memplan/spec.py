"""Model specs as the command line writes them: ``resnet:depth=1000,batch=32``."""

from __future__ import annotations

from typing import Any

from memplan import models
from memplan.errors import bad_arg


def parse_spec(spec: str) -> models.Workload:
    """``name[:key=value,...]`` -> a lazy Workload. Values are ints, floats or strings."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in models.names():
        raise bad_arg(
            "MODEL", f"a built-in model {models.names()} with optional ':key=value,...'",
            spec, "Write e.g. 'resnet:depth=1000,batch=32' or 'lstm:steps=1024'.",
        )
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip() or not raw.strip():
            raise bad_arg(
                "MODEL", "comma-separated key=value pairs after ':'", item,
                f"Write e.g. '{name}:{next(iter(models.defaults(name)))}=...'.",
            )
        params[key.strip()] = _number(raw.strip())
    return models.get(name, **params)


def _number(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
