"""Where a report was made: nanhunt, torch, Python, OS and device."""

from __future__ import annotations

import platform

import torch

from ._version import __version__

__all__ = ["environment"]


def environment(device_type: str) -> dict[str, str]:
    env = {
        "nanhunt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "device_type": device_type,
    }
    if device_type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    else:
        env["device"] = _cpu_name()
    if torch.version.cuda:
        env["cuda"] = str(torch.version.cuda)
    if getattr(torch.version, "hip", None):
        env["rocm"] = str(torch.version.hip)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
