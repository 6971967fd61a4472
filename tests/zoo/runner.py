"""Runs zoo entries each in its own process with a time limit (a capture can deadlock), and
tells a deadlock (the process stopped using CPU) from a slow run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import memplan
from tests.zoo.check import PHASE, RESULT, Row

ROOT = Path(__file__).resolve().parents[2]
DEADLOCK = "deadlock (no CPU used, timeout)"
TIMEOUT = "timeout"


def run_isolated(name: str, planner: str = "optimal", timeout_s: float = 300.0, seed: int = 0
                 ) -> Row:
    """``tests.zoo.check.check`` in a fresh interpreter that imports this process's memplan."""
    src = str(Path(memplan.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "OMP_NUM_THREADS": os.environ.get("MEMPLAN_TEST_THREADS", "1"),
        "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "tests.zoo.check", name, "--planner", planner, "--seed",
           str(seed), "--stack-after", str(max(timeout_s - 15, timeout_s / 2))]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    started = time.perf_counter()
    try:
        out, err = proc.communicate(timeout=timeout_s)
        hung = ""
    except subprocess.TimeoutExpired:
        hung = DEADLOCK if _stalled(proc.pid) else TIMEOUT
        proc.kill()
        out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith(RESULT):
            return Row(**json.loads(line[len(RESULT):]))
    from tests.zoo import ZOO

    phases = [line[len(PHASE):] for line in out.splitlines() if line.startswith(PHASE)]
    phase = phases[-1] if phases else "start"
    row = Row(name, ZOO[name].library, planner, phase=phase,
              total_s=time.perf_counter() - started)
    if hung:
        row.failure = f"{phase}: {hung}"
        row.detail = f"no result in {timeout_s:.0f} s; stuck in {_innermost(err)}"
    else:
        row.failure = f"{phase}: crash"
        tail = [line for line in err.strip().splitlines() if line.strip()]
        row.detail = f"exit status {proc.returncode}: {tail[-1][:240] if tail else ''}"
    return row


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None where unknown."""
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _stalled(pid: int, window_s: float = 2.0) -> bool:
    before = _cpu_s(pid)
    time.sleep(window_s)
    after = _cpu_s(pid)
    return before is not None and after is not None and after - before < 0.05


def _innermost(stderr: str) -> str:
    """The innermost frame of the thread running the check, from faulthandler's dump (each
    thread's frames come most recent first)."""
    blocks = stderr.split("(most recent call first):")[1:]
    for block in blocks:
        frames = [f.strip() for f in block.splitlines() if f.strip().startswith("File")]
        if frames and any("check.py" in f for f in frames):
            return frames[0].replace(str(ROOT) + "/", "")
    return "(no stack dump)"


def run_many(names: list[str], planner: str, timeout_s: float, jobs: int) -> list[Row]:
    """Rows in the order of ``names``; ``jobs`` entries at a time."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(lambda n: run_isolated(n, planner, timeout_s), names))


COLUMNS = [f.name for f in fields(Row)]
