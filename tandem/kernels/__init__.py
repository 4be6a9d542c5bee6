"""Native kernels, built once into a cache shared by every checkout and virtualenv on the machine
(`tandem prepare` builds them; a process that finds one missing builds it and says so); every
caller has a PyTorch fallback."""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# A build lock can be left by a build that was interrupted (a server killed on its first start);
# torch would wait on it forever. A build takes about 20 s on a quiet machine and minutes on a
# loaded one, so age alone cannot tell: a lock is stale once no process builds in its folder
# (ninja and the compiler run there) after LOCK_GRACE_S, or, where /proc cannot say, after
# STALE_LOCK_S.
LOCK_GRACE_S = 5.0
STALE_LOCK_S = 900.0


@functools.cache
def toolchain() -> str:
    """What a built extension depends on besides its source and flags: the compiler, torch, the
    Python ABI and the CPU (-march=native). Not the virtualenv's or the checkout's path."""
    import torch

    try:
        cxx = subprocess.run(
            [os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        cxx = "no compiler"
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _cpuinfo().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return "|".join(
        (
            cxx,
            torch.__version__,
            sysconfig.get_config_var("EXT_SUFFIX") or "",
            platform.machine(),
            cpu,
        )
    )


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def build_dir(name: str, text: bytes, root: Path, key: str = "") -> tuple[Path, Path]:
    """The build folder for source `text` (file `name`), named by a hash of it and `key` (flags
    and toolchain), with the source written in: every checkout and virtualenv with the same
    kernels, flags, compiler and torch shares one build. While another process holds the build
    lock this waits for it, and removes it once it is stale."""
    build = _build_folder(text, root, key)
    build.mkdir(parents=True, exist_ok=True)
    src = build / name
    if not src.exists() or src.read_bytes() != text:
        tmp = build / f"{name}.{os.getpid()}.tmp"
        tmp.write_bytes(text)
        tmp.replace(src)
    lock, waiting = build / "lock", False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return build, src
        if _lock_is_stale(build, age):
            log.warning("removing a kernel build lock left %.0f s ago by an interrupted build", age)
            lock.unlink(missing_ok=True)
            return build, src
        if not waiting:
            log.info("waiting for another process's kernel build (%s)", lock)
            waiting = True
        time.sleep(0.5)


def _build_folder(text: bytes, root: Path, key: str) -> Path:
    """A build's folder: its source and key hashed, so equal builds share it."""
    return root / hashlib.sha256(text + b"\0" + key.encode()).hexdigest()[:16]


def _lock_is_stale(build: Path, age: float) -> bool:
    if age < LOCK_GRACE_S:
        return False  # the builder may not have started ninja yet
    proc = Path("/proc")
    if not (proc / "self" / "cwd").exists():
        return age > STALE_LOCK_S
    folder = str(build.resolve())
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "cwd") == folder:
                    return False
            except OSError:  # gone, or not ours to read
                continue
    return True


@functools.cache
def cpu_paged_attention():
    """The CPU paged decode-attention extension, or None when it cannot be built here
    (no compiler, or TANDEM_NO_NATIVE=1)."""
    return _kernel("cpu_paged_attention")


def cpu_paged_decode(head_dim: int):
    """The native paged decode-attention function for a model of this head_dim (the kernel
    is built for 64, 128 and 256), or None: attention then runs on the SDPA buckets."""
    ext = cpu_paged_attention() if head_dim in (64, 128, 256) else None
    return ext.paged_decode_attention if ext is not None else None


@functools.cache
def cpu_prefill_attention():
    """The CPU paged prefill-attention extension (flash-style, sliding windows read only), or
    None when it cannot be built here."""
    return _kernel("cpu_prefill_attention")


def cpu_paged_prefill(head_dim: int):
    """The native paged prefill-attention function for a model of this head_dim (64, 128 or
    256), or None: prefills then run on SDPA."""
    ext = cpu_prefill_attention() if head_dim in (64, 128, 256) else None
    return ext.paged_prefill_attention if ext is not None else None


@functools.cache
def cpu_fused_ops():
    """Fused RMSNorm / residual-add+RMSNorm / RoPE for CPU (kernels/cpu_fused_ops.cpp), or None.
    No fast-math: each op must round exactly as the PyTorch code it replaces."""
    return _kernel("cpu_fused_ops")


@functools.cache
def cpu_quant_gemm():
    """int8-activation GEMMs for the int4 / int8 linears (kernels/cpu_quant_gemm.cpp), or None;
    `supported()` says whether this CPU runs it (AVX512-VNNI, or AVX2 with FMA). OpenMP here is
    torch's own runtime (the libgomp.so.1 torch loaded first), so at::parallel_for uses torch's
    thread team. Its FMAs are its intrinsics', so its unit's -ffp-contract=off changes nothing in
    it."""
    return _kernel("cpu_quant_gemm")


@functools.cache
def cpu_invariant_gemm():
    """The batch-invariant GEMM for the deterministic mode (kernels/cpu_invariant_gemm.cpp), or
    None. No fast-math and no FMA contraction beyond the kernel's own: its per-element FMA chain
    is the point."""
    return _kernel("cpu_invariant_gemm")


@functools.cache
def cpu_lora_sgmv():
    """LoRA's shrink and expand for every adapter segment of a batch in one call per linear
    (kernels/cpu_lora_sgmv.cpp), or None. Its FMAs are its intrinsics'."""
    return _kernel("cpu_lora_sgmv")


def target_flags() -> list[str]:
    """The instruction set the kernels are built for: this CPU's (-march=native), or with
    TANDEM_CPU_ISA=avx2 its AVX2 subset, no AVX-512: what an AVX2-only machine runs, reproduced
    (and tested) on an AVX-512 one."""
    isa = os.environ.get("TANDEM_CPU_ISA", "native")
    if isa not in ("native", "avx2"):
        raise ValueError(f"TANDEM_CPU_ISA={isa!r}: 'native' or 'avx2'")
    return ["-march=native"] + (["-mno-avx512f"] if isa == "avx2" else [])


# Each build unit: its kernels and the flags besides -O3 and the target's (why each: the kernel
# functions' docstrings). A unit is one translation unit, its kernels' sources joined and one
# module holding a submodule for each: torch's and pybind11's headers, most of a build's CPU
# (~10 s), are parsed once per unit, not once per kernel; so kernels whose flags agree share one.
UNITS = {
    "cpu_paged_attention": (
        ("cpu_paged_attention", "cpu_prefill_attention"),
        ["-ffast-math", "-fopenmp"],
    ),
    "cpu_kernels": (
        ("cpu_fused_ops", "cpu_quant_gemm", "cpu_invariant_gemm", "cpu_lora_sgmv"),
        ["-ffp-contract=off", "-fopenmp"],
    ),
}
UNIT_OF = {kernel: unit for unit, (kernels, _) in UNITS.items() for kernel in kernels}


def unit_source(unit: str) -> bytes:
    """A unit's translation unit: its kernels' sources, then the module binding each (every
    kernel's code is in its own namespace, tandem_<kernel>, with a bind function)."""
    kernels, _ = UNITS[unit]
    binds = "".join(f'  tandem_{k}::bind(m.def_submodule("{k}"));\n' for k in kernels)
    parts = [kernel_source(f"{k}.cpp") for k in kernels]
    return (
        "\n".join(parts) + f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}}}\n"
    ).encode()


_INCLUDE = re.compile(r'^#include "([^"]+)"\n', re.MULTILINE)


def kernel_source(name: str) -> str:
    """Kernel file `name` with each `#include "file"` line (its per-ISA parts, beside it) replaced
    by that file's text, as the preprocessor would: the unit built from it is then one file, and
    the hash naming its build covers every file it is made of."""
    text = Path(__file__).with_name(name).read_text()
    return _INCLUDE.sub(lambda m: kernel_source(m.group(1)), text)


def _build_spec(unit: str) -> tuple[bytes, Path, list[str], str]:
    """Unit `unit`'s source, the cache its builds go to, its full flags, and its build key."""
    from tandem.config import cache_root

    cflags = ["-O3", *target_flags(), *UNITS[unit][1]]
    return (
        unit_source(unit),
        cache_root().parent / "kernels",
        cflags,
        " ".join(cflags) + "|" + toolchain(),
    )


def _built(unit: str, build: Path | None = None) -> Path:
    """Where unit `unit`'s extension file is once built (in `build`, its build folder, when
    known)."""
    if build is None:
        text, root, _, key = _build_spec(unit)
        build = _build_folder(text, root, key)
    return build / f"tandem_{unit}.so"


def _kernel(kernel: str):
    """One kernel's functions (its submodule of its unit's module), or None."""
    module = _unit(UNIT_OF[kernel])
    return getattr(module, kernel) if module is not None else None


@functools.cache
def _unit(unit: str) -> ModuleType | None:
    """A unit's module, imported (or built) once per process for all its kernels."""
    return _load(unit)


def _load(unit: str) -> ModuleType | None:
    """Import one unit's extension from the shared cache, building it first when it is not
    there; None where that fails."""
    if os.environ.get("TANDEM_NO_NATIVE") == "1":
        return None
    try:
        import torch  # noqa: F401 - the extension links against the libraries torch loads

        text, root, cflags, key = _build_spec(unit)
        build, src = build_dir(f"{unit}.cpp", text, root, key)
        built = _built(unit, build)
        name = built.stem
        if not built.exists():
            log.info(
                "building native kernels %s in %s (once per machine and toolchain; "
                "`tandem prepare` builds them ahead)",
                ", ".join(UNITS[unit][0]),
                build,
            )
            t0 = time.monotonic()
            from torch.utils.cpp_extension import load

            ext = load(
                name=name,
                sources=[str(src)],
                extra_cflags=cflags,
                build_directory=str(build),
                extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [],
                verbose=False,
            )
            log.info("built %s in %.1f s", ", ".join(UNITS[unit][0]), time.monotonic() - t0)
            return ext
        return _import(name, built)
    except Exception as e:  # a missing toolchain must not stop serving
        log.warning(
            "native kernels %s unavailable (%s); using the PyTorch path",
            ", ".join(UNITS[unit][0]),
            e,
        )
        return None


def _import(name: str, path: Path):
    """The built extension module, imported from its file (torch's `load` would re-run ninja,
    whose build file names this virtualenv's paths)."""
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs_build(unit: str) -> bool:
    """Neither built nor being built (its folder's lock). False where that cannot be told (no
    torch, a bad TANDEM_CPU_ISA): loading the unit then says why, as any other failure."""
    try:
        built = _built(unit)
    except Exception:
        return False
    return not built.exists() and not (built.parent / "lock").exists()


def prepare() -> dict[str, bool]:
    """Build (or find) every native kernel; True for each that loads. Each unit neither built nor
    being built (its folder's lock) builds in a process of its own, all at once: a build is one
    compiler on one core. A unit another process is building is waited for."""
    if os.environ.get("TANDEM_NO_NATIVE") != "1":
        code = (
            "import sys, logging, tandem.kernels as k; "
            "logging.basicConfig(level=logging.INFO); k._load(sys.argv[1])"
        )
        builds = [
            subprocess.Popen([sys.executable, "-c", code, unit])
            for unit in UNITS
            if _needs_build(unit)
        ]
        for b in builds:
            b.wait()
    return {kernel: _kernel(kernel) is not None for kernel in UNIT_OF}
