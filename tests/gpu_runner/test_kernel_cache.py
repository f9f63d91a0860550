"""The CPU operators' build cache (cpu_ops/build.py): a directory of the user's own, mode 0700,
refused where another user owns it or others may write to it; builds keyed by the instruction set
(x86 flags, ARM Features), the compilers and torch; one build under the lock however many
processes ask at once; a failed build leaves nothing that a later process would load; and the
one OpenMP runtime torch loaded, shared with the kernels. No test here compiles the operators:
the build that the kernel tests use is the one each machine makes once."""
from __future__ import annotations

import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.cpu_ops import build

ARM_CPUINFO = ["processor\t: 0", "BogoMIPS\t: 50.00", "Features\t: fp asimd evtstrm aes crc32 atomics sve",
               "CPU implementer\t: 0x41", "CPU architecture: 8", "CPU part\t: 0xd40"]
X86_CPUINFO = ["processor\t: 0", "model name\t: Some CPU", "flags\t\t: fpu sse2 avx2 fma"]
needs_compilers = pytest.mark.skipif(build.compilers() is None, reason="no C/C++ compiler")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """cpu_ops.library() asked again as if nothing were loaded; the loaded operators come back after."""
    monkeypatch.setattr(cpu_ops, "_loaded", None)
    cpu_ops.library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_ops.library.cache_clear()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_cache_is_made_private(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "kernels"
    assert build.private_directory(cache) == cache and mode(cache) == 0o700
    shared = tmp_path / "readable"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    build.private_directory(shared)
    assert mode(shared) == 0o700  # readable by others: narrowed, it is this user's


@pytest.mark.parametrize("bits", [0o777, 0o770, 0o702])
def test_a_cache_others_may_write_is_refused(tmp_path: Path, bits: int) -> None:
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(bits)
    with pytest.raises(build.KernelCacheError, match=f"writable by others \\(mode {bits:o}\\)"):
        build.private_directory(cache)
    assert mode(cache) == bits  # left as it is: the user decides


def test_a_cache_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "kernels"
    cache.mkdir(mode=0o700)
    owner = cache.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(build.KernelCacheError, match=f"belongs to uid {owner}, not to this user"):
        build.private_directory(cache)


def test_a_file_in_place_of_the_cache_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kernels").write_text("")
    with pytest.raises(build.KernelCacheError, match=build.CACHE_VARIABLE):
        build.private_directory(tmp_path / "kernels")


@needs_compilers
def test_a_refused_cache_leaves_plain_torch_and_says_why(tmp_path: Path, fresh: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(0o777)
    fresh.setenv(build.CACHE_VARIABLE, str(cache))
    with pytest.raises(build.KernelCacheError):
        build.load()
    assert cpu_ops.library() is None
    assert cpu_ops.describe().startswith(f"plain torch (the kernel cache {cache} is writable by others")


def test_the_key_follows_the_instruction_set_arm_included(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {}
    for name, lines in (("x86", X86_CPUINFO), ("arm", ARM_CPUINFO)):
        monkeypatch.setattr(build, "_cpuinfo", lambda lines=lines: lines)
        keys[name] = build.build_key("cc", "c++", None)
        assert build.build_key("cc", "c++", None) == keys[name]  # the same machine: the same build
    assert keys["x86"] != keys["arm"]
    assert "Features\t: fp asimd evtstrm aes crc32 atomics sve" in build.instruction_set()
    assert build.isa_label() == "sve"
    monkeypatch.setattr(build, "_cpuinfo", lambda: X86_CPUINFO)
    assert build.isa_label() == "avx2" and "flags" in build.instruction_set()
    assert build.build_key("cc", "c++", "/lib/libgomp.so.1") != keys["x86"]


def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, seconds: float) -> list[Path]:
    """build.load with the compilers and torch's loader replaced: each build sleeps `seconds`,
    writes the library file and is recorded."""
    builds: list[Path] = []
    monkeypatch.setenv(build.CACHE_VARIABLE, str(tmp_path / "cache"))

    def compile_(directory: Path, cc: str, openmp: str | None) -> None:
        builds.append(directory)
        time.sleep(seconds)
        (directory / f"{build.NAME}.so").write_bytes(b"built")

    monkeypatch.setattr(build, "_compile", compile_)
    monkeypatch.setattr(build.torch.ops, "load_library", lambda path: None)
    return builds


@needs_compilers
def test_concurrent_loads_build_once_under_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = fake_build(monkeypatch, tmp_path, 0.5)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(build.load())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(builds) == 1 and len(results) == 4 and len(set(results)) == 1
    assert results[0].read_bytes() == b"built" and (results[0].parent / "built").exists()
    assert build.load() == results[0] and len(builds) == 1  # later processes reuse it


@needs_compilers
def test_a_failed_build_is_not_loaded_later_and_says_why(tmp_path: Path, fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv(build.CACHE_VARIABLE, str(tmp_path / "cache"))
    fresh.setattr(build, "C_FLAGS", [*build.C_FLAGS, "-fno-such-flag"])
    loads: list[str] = []
    fresh.setattr(build.torch.ops, "load_library", loads.append)
    for _ in range(2):  # each try compiles again: nothing was marked built
        with pytest.raises(subprocess.CalledProcessError) as failure:
            build.load()
        assert "no-such-flag" in failure.value.stderr
    assert loads == [] and not list((tmp_path / "cache").glob("*/built"))
    assert cpu_ops.library() is None
    reason = cpu_ops.describe()
    assert reason.startswith("plain torch (the build failed: ") and "error" in reason and "no-such-flag" in reason


@needs_compilers
def test_the_kernels_share_torchs_openmp_runtime() -> None:
    assert cpu_ops.library() is not None, cpu_ops.describe()
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if Path(line.split()[-1]).name.startswith(("libgomp", "libiomp", "libomp"))}
    assert runtimes == {build.openmp_runtime()}


@needs_compilers
def test_describe_says_what_serves() -> None:
    assert cpu_ops.describe() == f"built (torch ops, {build.isa_label()})"


def test_without_a_compiler_plain_torch_serves_and_says_so(fresh: pytest.MonkeyPatch) -> None:
    fresh.setattr(build, "compilers", lambda: None)
    assert cpu_ops.library() is None and cpu_ops.describe() == "plain torch (no compiler)"
    with pytest.raises(RuntimeError, match=r"not built \(no compiler"):
        cpu_ops.rotary(*[torch.zeros(1, 1, 2)] * 3)
    fresh.setenv(cpu_ops.ENABLE_VARIABLE, "0")
    cpu_ops.library.cache_clear()
    assert cpu_ops.describe() == "plain torch (switched off: PIPELINE_CPU_KERNELS=0)"
