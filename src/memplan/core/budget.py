"""Memory budgets: bytes, "6GiB"/"7GB"/"512MiB" strings, or a fraction of the plain peak."""

from __future__ import annotations

import re

from memplan.core.floor import Floor
from memplan.errors import BudgetTooSmall, bad_arg

GB = 10**9  # the decimal gigabyte of the paper's figures (and of torch's docs)
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_ACCEPTED = ("an int of bytes (> 0), a string like '6GiB', '7GB' or '512MiB', "
             "or a float fraction of the plain peak in (0, 1]")


def budget_too_small(budget_bytes: int, least_peak_bytes: int, planner: str,
                     hint: str | None = None, least_peaks: dict[str, int] | None = None,
                     floor: Floor | None = None) -> BudgetTooSmall:
    """The refusal when nothing fits: the budget, the least feasible peak of ``planner``,
    the least peak of each planner in ``least_peaks`` (when compared), and what to do: use
    the planner that reaches the lowest peak, or raise the budget. With ``floor``, a budget
    below it is said to be out of any plan's reach, and why."""
    text = (f"budget {format_bytes(budget_bytes)} ({budget_bytes:,} B) is below the least "
            f"feasible peak {format_bytes(least_peak_bytes)} ({least_peak_bytes:,} B) of "
            f"planner '{planner}'. ")
    if floor is not None and budget_bytes < floor.floor_bytes:
        text += (f"No plan can fit it: at {floor.where}, the parameters, inputs and gradients "
                 f"made so far plus that op's own inputs and outputs take "
                 f"{format_bytes(floor.floor_bytes)} ({floor.floor_bytes:,} B) whatever is "
                 "kept or recomputed; a smaller batch or a smaller model lowers that. ")
    if least_peaks:
        best = min(least_peaks, key=lambda k: (least_peaks[k], k != planner, k))
        text += "Least peaks: " + ", ".join(
            f"{k} {format_bytes(v)} ({v:,} B)" for k, v in sorted(
                least_peaks.items(), key=lambda kv: (kv[1], kv[0]))) + ". "
        low = least_peaks[best]
        if best != planner and low < least_peak_bytes:
            fit = "fits this budget" if low <= budget_bytes else f"needs at least {low:,} B"
            text += (f"Use planner='{best}': it reaches {format_bytes(low)} ({fit})"
                     + ("." if low <= budget_bytes else ", or raise the budget."))
        else:
            text += (f"Raise the budget to at least {least_peak_bytes:,} B ('{planner}' "
                     "reaches the lowest peak).")
    else:
        text += (f"Raise the budget to at least {least_peak_bytes:,} B"
                 + (hint if hint is not None else ", or compare the planners: memplan.plan("
                    "model, ..., budget=...) names the least peak each reaches."))
    return BudgetTooSmall(budget_bytes, least_peak_bytes, planner, text, least_peaks,
                          None if floor is None else floor.floor_bytes)


_INT = re.compile(r"^\s*[0-9]+\s*$")
_FLOAT = re.compile(r"^\s*[0-9]*\.[0-9]+\s*$|^\s*[0-9]+\.[0-9]*\s*$")


def budget_from_text(text: str | None) -> object:
    """Budget text (the command line's) -> what ``parse_budget`` accepts: '6GiB' (str), '0.25' (fraction of the
    plain peak), '5000000000' (bytes)."""
    if text is None:
        return None
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


MAX_BUDGET_BYTES = 2**63 - 1  # the chain's int64 bytes (8 EiB)


def parse_budget(budget: object, plain_peak_bytes: int | None = None, arg: str = "budget") -> int:
    """The budget in bytes. Fractions need ``plain_peak_bytes``. ``arg`` names the argument
    in errors (``--budget`` on the command line, whose fixes are then written as flags)."""
    flag = arg.startswith("-")

    def example(text: str) -> str:
        return f"{arg} {text}" if flag else f"{arg}='{text}'"

    if isinstance(budget, bool) or budget is None:
        raise bad_arg(arg, _ACCEPTED, budget, f"Pass e.g. {example('6GiB')}.")
    if isinstance(budget, int):
        if not 0 < budget <= MAX_BUDGET_BYTES:
            raise bad_arg(arg, _ACCEPTED + f", at most {MAX_BUDGET_BYTES:,} B", budget,
                          f"Pass a positive number of bytes, e.g. {example('6GiB')}.")
        return budget
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise bad_arg(arg, _ACCEPTED, budget,
                          "A float is a fraction of the plain peak, e.g. 0.25; for bytes pass an "
                          f"int or a size like {example('6GiB')}.")
        if plain_peak_bytes is None:
            raise bad_arg(arg, "bytes or a size string here (no plain peak known)", budget,
                          f"Pass e.g. {example('6GiB')}.")
        return max(1, int(budget * plain_peak_bytes))
    if isinstance(budget, str):
        m = _PATTERN.match(budget)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in UNITS:
            raise bad_arg(arg, _ACCEPTED, budget,
                          f"Use a number and one of the units {sorted(UNITS, key=lambda u: UNITS[u])}, "
                          f"e.g. {example('6GiB')} (2**30 B) or {example('7GB')} (10**9 B).")
        size = float(m.group(1)) * UNITS[unit]  # inf for '1e400': refused below
        if not 1 <= size <= MAX_BUDGET_BYTES:
            raise bad_arg(arg, f"a size from 1 B to {MAX_BUDGET_BYTES:,} B (8 EiB)", budget,
                          f"Pass e.g. {example('6GiB')}.")
        return int(size)
    raise bad_arg(arg, _ACCEPTED, type(budget).__name__, f"Pass e.g. {example('6GiB')}.")


def format_bytes(n: float) -> str:
    """Bytes for people, in binary units: 1536 -> '1.50 KiB' (the one formatter)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
