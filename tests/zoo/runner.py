"""Runs zoo entries each in its own process with a time limit (a capture can deadlock), and
tells a deadlock (the process stopped using CPU) from a slow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import memplan
from tests.zoo.check import PHASE, RESULT, Row

ROOT = Path(__file__).resolve().parents[2]
DEADLOCK = "deadlock (the process stopped using CPU)"
TIMEOUT = "timeout"


def run_isolated(name: str, planner: str = "optimal", timeout_s: float = 300.0, seed: int = 0,
                 stall_s: float = 3.0) -> Row:
    """``tests.zoo.check.check`` in a fresh interpreter that imports this process's memplan.
    A run whose process uses no CPU for ``stall_s`` seconds is a deadlock: its stacks are
    dumped (faulthandler, SIGUSR1) and it is killed."""
    src = str(Path(memplan.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        "OMP_NUM_THREADS": os.environ.get("MEMPLAN_TEST_THREADS", "1"),
        "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "tests.zoo.check", name, "--planner", planner, "--seed",
           str(seed)]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        hung = _wait(proc, timeout_s, stall_s)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    for line in stdout.splitlines():
        if line.startswith(RESULT):
            return Row(**json.loads(line[len(RESULT):]))
    from tests.zoo import ZOO

    phases = [line[len(PHASE):] for line in stdout.splitlines() if line.startswith(PHASE)]
    phase = phases[-1] if phases else "start"
    row = Row(name, ZOO[name].library, planner, phase=phase,
              total_s=time.perf_counter() - started)
    if hung:
        row.failure = f"{phase}: {hung}"
        row.detail = f"stopped after {row.total_s:.0f} s; stuck in {_innermost(stderr)}"
    else:
        row.failure = f"{phase}: crash"
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        row.detail = f"exit status {proc.returncode}: {tail[-1][:240] if tail else ''}"
    return row


def _wait(proc: subprocess.Popen[str], timeout_s: float, stall_s: float) -> str:
    """"" when ``proc`` ended by itself, else why it was killed."""
    deadline = time.monotonic() + timeout_s
    cpu, changed = _cpu_s(proc.pid), time.monotonic()
    while True:
        try:
            proc.wait(timeout=0.25)
            return ""
        except subprocess.TimeoutExpired:
            pass
        now, now_cpu = time.monotonic(), _cpu_s(proc.pid)
        if now_cpu is None or now_cpu != cpu:
            cpu, changed = now_cpu, now
        hung = DEADLOCK if now - changed >= stall_s else TIMEOUT if now >= deadline else ""
        if hung:
            proc.send_signal(signal.SIGUSR1)  # faulthandler writes every thread's stack
            time.sleep(0.5)
            proc.kill()
            proc.wait()
            return hung


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None where unknown."""
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


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
