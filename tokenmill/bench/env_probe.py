"""The machine a benchmark ran on, recorded with its figures: CPU model, cores, memory and GPU, if any."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "cpu family", "model", "flags", ...); {} where
    there is none."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


def hardware() -> dict:
    cpu = cpuinfo().get("model name") or platform.processor() or platform.machine()
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    import psutil
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": gpu}
