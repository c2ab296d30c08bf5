"""tokenmill's native CPU kernels, chosen at run time from the CPU's flags.

`cpu_ops()` returns the op namespace of the build that matches this CPU (torch.ops.tokenmill_avx512 or
torch.ops.tokenmill_avx2), building it on first use if `make` did not, or None where no build can serve
(another architecture, no compiler, a failed build): the engine then runs its pure-torch path and says so.
TOKENMILL_CPU_ISA=avx2|avx512|none overrides the choice (to test the AVX2 path on an AVX-512 machine, or to
turn the kernels off)."""
from __future__ import annotations

import functools
import logging

import torch

from tokenmill import envs
from tokenmill.kernels.build import ISA_FLAGS, build

logger = logging.getLogger("tokenmill.kernels")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """The kernel builds this CPU can execute, best first."""
    flags = cpu_flags() if flags is None else flags
    isas = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        isas.append("avx512")
    if {"avx2", "fma", "f16c"} <= flags:
        isas.append("avx2")
    return isas


@functools.cache
def load_ops(isa: str):
    """Build (if needed) and load one ISA's library; returns its torch.ops namespace."""
    torch.ops.load_library(build(isa))
    return getattr(torch.ops, f"tokenmill_{isa}")


@functools.cache
def cpu_ops():
    """The ops for this CPU, or None (logged once, with the reason)."""
    wanted = envs.TOKENMILL_CPU_ISA
    runnable = runnable_isas()
    if wanted == "none":
        logger.info("CPU kernels: off (TOKENMILL_CPU_ISA=none); using the pure-torch path")
        return None
    if wanted:
        if wanted not in ISA_FLAGS:
            raise ValueError(f"TOKENMILL_CPU_ISA={wanted!r}: choose from {sorted(ISA_FLAGS)} or none")
        if wanted not in runnable:
            raise ValueError(f"TOKENMILL_CPU_ISA={wanted}: this CPU cannot run it (it runs {runnable or 'neither'})")
        runnable = [wanted]
    if not runnable:
        logger.warning("CPU kernels: this CPU has neither AVX-512 nor AVX2+FMA; using the pure-torch path")
        return None
    try:
        ops = load_ops(runnable[0])
    except Exception as e:  # noqa: BLE001 - any failure to build or load falls back, with the reason
        logger.warning("CPU kernels: the %s build is unavailable (%s); using the pure-torch path", runnable[0], e)
        return None
    logger.info("CPU kernels: %s", runnable[0])
    return ops
