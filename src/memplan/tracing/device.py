"""The one device check: where real steps may run."""

from __future__ import annotations

import torch

from memplan.errors import bad_arg


def check_device(device: str, arg: str = "device") -> torch.device:
    """``device`` as a torch.device: the CPU, or a CUDA device present on this machine.
    ``arg`` names the argument in the error (``--device`` on the command line)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = torch.device("meta")  # any unsupported spelling: rejected just below
    if dev.type not in ("cpu", "cuda"):
        raise bad_arg(arg, "'cpu', 'cuda' or 'cuda:N'", device, f"Pass {arg} cpu or cuda.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise bad_arg(arg, "a device present on this machine", device,
                      f"No CUDA device is visible here (torch {torch.__version__}); use cpu.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise bad_arg(arg, f"a CUDA index below {torch.cuda.device_count()}", device,
                      "Pick a GPU this machine has.")
    return dev
