"""Building the CPU operators once per machine: the C kernels compiled as C (cc, -march=native),
ops.cpp compiled and linked with them by torch.utils.cpp_extension into one library that registers
torch.ops.pipeline.*, cached per user and per build key.

The cache (PIPELINE_KERNEL_CACHE, else ~/.cache/pipeline/kernels) must be a directory of the user's
own, writable by no one else (it is created with mode 0700, and an existing one of the user's is
narrowed to it); anything else is refused with KernelCacheError, since whoever can write there can
put code into every process that loads the kernels. A build lives in a directory named by its key:
the hash of the sources, the flags, both compilers, the torch and Python versions, the OpenMP
runtime and the CPU's instruction set (x86 "flags", ARM "Features"). One process builds a key under
an exclusive flock of `<key>.lock` (released by the kernel if the builder dies); the others wait on
it, then load what it built. A build is complete once its `built` marker exists; from then on a
process loads the library without taking the lock and without starting the compilers.

OpenMP: the kernels keep their `#pragma omp` loops and are linked to the OpenMP runtime torch has
loaded (found in /proc/self/maps), so they share torch's thread pool and at::set_num_threads,
and no second runtime is loaded.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import torch

from stages.progress import Progress

HERE = Path(__file__).parent
C_SOURCES = tuple(sorted(HERE.glob("*.c")))  # every C file beside this one: a new kernel's file is built too
HEADERS = tuple(sorted(HERE.glob("*.h")))
CXX_SOURCES = tuple(sorted(HERE.glob("*.cpp")))  # ops.cpp and the operators beside it
# No contraction of a * b + c into one rounding: elementwise.c rounds where torch's operators do.
# -fno-trapping-math changes no value: it lets loops that select (exp.h's edges) become vector code.
C_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp", "-fPIC", "-std=c11"]
CXX_FLAGS = ["-O2"]
NAME = "pipeline_cpu_ops"
CACHE_VARIABLE = "PIPELINE_KERNEL_CACHE"
LOCK_TIMEOUT_S = 900.0  # a build takes a minute or two on a busy 2-core machine


class KernelCacheError(RuntimeError):
    """The kernel cache directory is not the user's own, or others may write to it."""


def compilers() -> tuple[str, str] | None:
    """(C compiler, C++ compiler) from CC / CXX or the PATH, or None where either is missing."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return None if cc is None or cxx is None else (cc, cxx)


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def instruction_set() -> str:
    """What -march=native compiles for: the CPU's model lines and its instruction set (x86 "flags",
    ARM "Features"), else the machine and processor names where there is no /proc/cpuinfo."""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
    lines = sorted({line for line in _cpuinfo() if line.startswith(keys)})
    return "\n".join(lines) or f"{platform.machine()} {platform.processor()}"


def isa_label() -> str:
    """The instruction set in a word or two, for status lines: avx512 (+vnni, bf16, amx), avx2, sve, neon."""
    words: set[str] = set()
    for line in _cpuinfo():
        if line.startswith(("flags", "Features")):
            words.update(line.split(":", 1)[-1].split())
    if "avx512f" in words:
        extras = [name for flag, name in (("avx512_vnni", "vnni"), ("avx512_bf16", "bf16"), ("amx_tile", "amx"))
                  if flag in words]
        return "+".join(["avx512", *extras])
    for flag, name in (("avx2", "avx2"), ("sve", "sve"), ("asimd", "neon")):
        if flag in words:
            return name
    return platform.machine()


def openmp_runtime() -> str | None:
    """The OpenMP library torch has loaded (libgomp, libiomp or libomp), by path, or None."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split()[-1]
        if Path(path).name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in path:
            return path
    return None


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "pipeline" / "kernels")


def private_directory(path: Path) -> Path:
    """`path` as a directory of this user's, mode 0700 (created so, with its missing parents);
    KernelCacheError where it is another user's, not a directory, or writable by group or others."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        raise KernelCacheError(f"the kernel cache {path} cannot be made ({exc}); set {CACHE_VARIABLE}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise KernelCacheError(f"the kernel cache {path} is not a directory; set {CACHE_VARIABLE}")
    if info.st_uid != os.getuid():
        raise KernelCacheError(f"the kernel cache {path} belongs to uid {info.st_uid}, not to this user "
                               f"(uid {os.getuid()}): its libraries would run in this process; set {CACHE_VARIABLE}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelCacheError(f"the kernel cache {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): "
                               f"its libraries would run in this process; chmod 700 it or set {CACHE_VARIABLE}")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def _identify(program: str) -> str:
    """A compiler by its resolved path, size and modification time (no process started)."""
    resolved = Path(shutil.which(program) or program).resolve()
    info = resolved.stat()
    return f"{resolved} {info.st_size} {info.st_mtime_ns}"


def build_key(cc: str, cxx: str, openmp: str | None) -> str:
    """The hash that names a build: everything the library's bytes and its loading depend on."""
    parts = [path.read_bytes() for path in (*C_SOURCES, *HEADERS, *CXX_SOURCES)]
    parts += [" ".join(C_FLAGS + CXX_FLAGS).encode(), _identify(cc).encode(), _identify(cxx).encode(),
              f"torch {torch.__version__} {torch.version.git_version} python {sys.version_info[:2]}".encode(),
              str(openmp).encode(), instruction_set().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


class _Lock:
    """An exclusive flock of `path`, waited for up to LOCK_TIMEOUT_S (TimeoutError after)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> _Lock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"another process has held {self.path} for {LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _ninja_on_path() -> None:
    """cpp_extension runs `ninja` from the PATH: where none is there, the ninja package's own binary
    (a dependency, in the environment's bin directory, which the PATH lacks when its python is run
    directly) is put first."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # noqa: PLC0415
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _compile(directory: Path, cc: str, openmp: str | None) -> None:
    """The build itself, in `directory`: the C objects, then ops.cpp and the link by cpp_extension
    (which loads the library into this process)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 - only a build needs it

    _ninja_on_path()
    objects = [directory / f"{source.stem}.o" for source in C_SOURCES]
    for source, obj in zip(C_SOURCES, objects):
        subprocess.run([cc, *C_FLAGS, "-c", str(source), "-o", str(obj)], capture_output=True, text=True,
                       check=True)
    stale = directory / "lock"  # cpp_extension's FileBaton, left by a builder that died: no one holds it now
    stale.unlink(missing_ok=True)
    cpp_extension.load(NAME, [str(source) for source in CXX_SOURCES], extra_cflags=CXX_FLAGS,
                       extra_ldflags=[*map(str, objects), openmp or "-fopenmp"], build_directory=str(directory),
                       is_python_module=False, verbose=False)


def load() -> Path:
    """Builds the operators where this machine's cache lacks them, and loads them into torch.ops
    (torch.ops.pipeline.*): the library's path. CalledProcessError, OSError or RuntimeError where
    the build fails, KernelCacheError where the cache is not private, TimeoutError where another
    process holds the build lock too long."""
    found = compilers()
    if found is None:
        raise FileNotFoundError("no C and C++ compiler")
    cc, cxx = found
    openmp = openmp_runtime()
    root = private_directory(cache_root())
    key = build_key(cc, cxx, openmp)
    directory, library = root / key, root / key / f"{NAME}.so"
    marker = directory / "built"
    if marker.exists():
        torch.ops.load_library(str(library))
        return library
    with _Lock(root / f"{key}.lock"):
        if marker.exists():  # built by the process that held the lock before
            torch.ops.load_library(str(library))
            return library
        private_directory(directory)
        if "CXX" not in os.environ and shutil.which("c++") is None:
            os.environ["CXX"] = cxx  # what cpp_extension compiles with; it looks for c++ only
        with Progress(f"compiling the CPU operators into {directory} (once per machine)"):
            _compile(directory, cc, openmp)
        marker.write_text(f"{library.name}\n")
    return library
