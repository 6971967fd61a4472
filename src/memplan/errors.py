"""One error family: every failure memplan raises on purpose derives from ``MemplanError``."""

from __future__ import annotations


class MemplanError(Exception):
    """Base of all memplan errors. Messages say what was wrong and how to fix it."""


class ConfigError(MemplanError, ValueError):
    """A bad argument: names the argument, the accepted range, the value received and the fix."""


def bad_arg(name: str, accepted: str, got: object, fix: str) -> ConfigError:
    """Build the standard bad-argument error."""
    return ConfigError(f"{name}: expected {accepted}, got {got!r}. {fix}")
