"""Builds the CPU kernels (csrc/*.cpp) with g++ against the installed torch, once per instruction set.

Plain g++ rather than torch's JIT loader: one library from a handful of sources, no ninja, and the ISA flags
are ours. The same sources (one per kernel family, sharing vec.h; torch_bindings.cpp registers every op) are
compiled for AVX-512 and for AVX2+FMA, each registering its ops under its own namespace
(torch.ops.tokenmill_avx512, torch.ops.tokenmill_avx2), so one process can load both (the tests compare them).
A build is keyed by every source and header, the flags, torch's version and the compiler, and kept in the cache
directory; `make` builds both ahead of time (python -m tokenmill.kernels), and a first use builds what is missing.

    python -m tokenmill.kernels [--isa avx512|avx2|all]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
import time

import torch
from torch.utils import cpp_extension

from tokenmill import envs

CSRC = os.path.join(os.path.dirname(__file__), "csrc")


def sources() -> list[str]:
    """The translation units (one kernel family each: attention.cpp, quant_linear.cpp, ...)."""
    return sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
COMMON_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                "-w"]


def cache_dir() -> str:
    return os.path.join(envs.TOKENMILL_CACHE_DIR, "kernels")


def compiler() -> str:
    return envs.CXX


def command(isa: str, output: str) -> list[str]:
    abi = int(torch.compiled_with_cxx11_abi())
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdir = cpp_extension.library_paths()[0]
    return [compiler(), *COMMON_FLAGS, *ISA_FLAGS[isa], f"-DTM_NAMESPACE=tokenmill_{isa}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *sources(), f"-L{libdir}", "-lc10", "-ltorch_cpu",
            "-ltorch", f"-Wl,-rpath,{libdir}", "-o", output]


def library_path(isa: str) -> str:
    digest = hashlib.sha256(repr((command(isa, ""), torch.__version__)).encode())
    for path in sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    key = digest.hexdigest()[:16]
    return os.path.join(cache_dir(), f"tokenmill_cpu_{isa}_{key}.so")


def build(isa: str, verbose: bool = False) -> str:
    """The path of the built library, compiling it first if the cache lacks it. Raises on a failed build."""
    path = library_path(isa)
    if os.path.exists(path):
        return path
    if shutil.which(compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({compiler()}) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    start = time.monotonic()
    try:
        proc = subprocess.run(command(isa, tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the {isa} kernels failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if verbose:
        print(f"built {path} in {time.monotonic() - start:.0f} s", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=[*ISA_FLAGS, "all"], default="all")
    args = parser.parse_args()
    isas = list(ISA_FLAGS) if args.isa == "all" else [args.isa]
    with concurrent.futures.ThreadPoolExecutor(len(isas)) as pool:
        for path in pool.map(lambda isa: build(isa, verbose=True), isas):
            print(path)
    return 0
