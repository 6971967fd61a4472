"""Every error memplan raises on purpose, as one small tree, so that a caller can tell them
apart without parsing messages::

    MemplanError                  base: the message says what was wrong and how to fix it
     +-- ConfigError (ValueError) a bad argument: its name, the accepted range, the value
     +-- CaptureError             the model's training step could not be captured or run
     +-- BudgetTooSmall           no plan fits the budget (states the least feasible peak)
     +-- PlanInvalid              a plan (or graph) file or a schedule is malformed
     +-- PlanMismatch             a valid plan made for another model or other inputs
     +-- ReplayError              the runtime cannot recompute what backward asks for

Standard library only: every layer imports this module.
"""

from __future__ import annotations


class MemplanError(Exception):
    """Base of all memplan errors. Messages say what was wrong and how to fix it."""


class ConfigError(MemplanError, ValueError):
    """A bad argument: names the argument, the accepted range, the value received and the fix."""


class CaptureError(MemplanError):
    """The model's training step (forward, loss, backward) could not be captured or run."""


class BudgetTooSmall(MemplanError):
    """No plan fits the budget. ``least_peak_bytes``: the least peak ``planner`` reaches;
    ``least_peaks``: the least peak of each planner compared (``memplan.plan`` compares them
    when it refuses), by name; ``floor_bytes``: the peak no plan can go below
    (``memplan.core.floor``), when known. Build it with
    ``memplan.core.budget.budget_too_small`` (which words the message)."""

    def __init__(self, budget_bytes: int, least_peak_bytes: int, planner: str,
                 message: str, least_peaks: dict[str, int] | None = None,
                 floor_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.least_peak_bytes = least_peak_bytes
        self.planner = planner
        self.least_peaks = dict(least_peaks or {})
        self.floor_bytes = floor_bytes
        super().__init__(message)

    def __reduce__(self) -> tuple[type, tuple[int, int, str, str, dict[str, int], int | None]]:
        return (type(self), (self.budget_bytes, self.least_peak_bytes, self.planner,
                             str(self), self.least_peaks, self.floor_bytes))  # picklable


class PlanInvalid(MemplanError):
    """A plan (file, dict or schedule) or a graph file that is malformed: wrong types, ranges
    or nesting."""


class PlanMismatch(MemplanError):
    """A well-formed plan that was made for another model or other inputs."""


class ReplayError(MemplanError):
    """The runtime cannot recompute a value backward asks for."""


def bad_arg(name: str, accepted: str, got: object, fix: str) -> ConfigError:
    """Build the standard bad-argument error."""
    return ConfigError(f"{name}: expected {accepted}, got {got!r}. {fix}")
