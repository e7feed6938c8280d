"""Builds the C++ sources beside this module into one library of torch operators (`torch.ops.spec_batch.*`).

The library is compiled once per source, torch, compiler and CPU (``-march=native``) and cached as
``<cache_dir>/kernels/spec_batch_ops-<hash>.so``; processes that start together wait on a file lock, and a
finished library is moved into place whole, so no process loads a half-written file. Floating-point contraction
is off (``-ffp-contract=off``); ``-fopenmp`` lets `at::parallel_for` use torch's OpenMP threads: the kernels' summation order is their exactness contract, and a fused
multiply-add the compiler chose would change it between builds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from ..compat import cxx11_abi
from .tuning import tuned

COMPILE_CHOICES = ("auto", "on", "off")
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # in the cache key with the sources
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


def _flags() -> tuple[str, ...]:
    """FLAGS and SPEC_BATCH_KERNEL_FLAGS after them (e.g. -mno-avx512vnni: the AVX2 paths on a VNNI CPU, or one
    library for a fleet of older CPUs); every path computes the same bits."""
    return FLAGS + tuple(os.environ.get("SPEC_BATCH_KERNEL_FLAGS", "").split())


class KernelBuildError(RuntimeError):
    """The native kernels could not be compiled or loaded here; the message says why."""


def native_ops(compile: str = "auto", cache_dir: str | os.PathLike | None = None) -> bool:
    """True when `torch.ops.spec_batch` holds the native CPU kernels. `compile`: auto builds them where a C++
    compiler is found (False otherwise), on requires them (KernelBuildError), off never builds them."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile={compile!r} is not one of {', '.join(COMPILE_CHOICES)}")
    if compile == "off":
        return False
    try:
        _load(str(_cache_root(cache_dir)))
    except KernelBuildError:
        if compile == "on":
            raise
        return False
    return True


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is None:
        from ...settings import get_settings

        cache_dir = get_settings().cache_dir
    return Path(cache_dir).expanduser() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256()
    for part in (torch.__version__, version, _cpu_flags(), " ".join(_flags())):
        h.update(part.encode() + b"\0")
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


_LOCK = threading.Lock()
_loaded: Path | None = None


def _load(root: str) -> Path:
    """Builds (or finds) and loads the library once per process: a second library registering the same operators
    would abort the process, so later calls, whatever their cache dir, get the first one."""
    global _loaded
    with _LOCK:
        if _loaded is None:
            _loaded = _build_and_load(root)
            tuned(_loaded)  # which of the equivalent paths is faster on this machine (the same bits either way)
        return _loaded


def _build_and_load(root: str) -> Path:
    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    out = Path(root) / f"spec_batch_ops-{_key(cxx)}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / ".build.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not out.exists():
                _compile(cxx, out)
    try:
        torch.ops.load_library(str(out))
    except (OSError, RuntimeError) as exc:
        raise KernelBuildError(f"the native kernels at {out} could not be loaded: {exc}") from exc
    return out


def _compile(cxx: str, out: Path) -> None:
    torch_dir = Path(torch.__file__).parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include"]
    abi = cxx11_abi()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [cxx, *_flags(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes)]
        cmd += [f"-I{sysconfig.get_paths()['include']}", *map(str, SOURCES), "-o", str(partial)]
        cmd += [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_dir / 'lib'}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise KernelBuildError(f"compiling the native kernels failed ({cxx}):\n{done.stderr[-4000:]}")
        os.replace(partial, out)
