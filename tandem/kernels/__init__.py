"""Native kernels, compiled on first use and cached; every caller has a PyTorch fallback."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A build lock can be left by a build that was interrupted (a server killed on its first start);
# torch would wait on it forever. A build takes about 20 s on a quiet machine and minutes on a
# loaded one, so age alone cannot tell: a lock is stale once no process builds in its folder
# (ninja and the compiler run there) after LOCK_GRACE_S, or, where /proc cannot say, after
# STALE_LOCK_S.
LOCK_GRACE_S = 5.0
STALE_LOCK_S = 900.0


def build_dir(source: Path, root: Path) -> tuple[Path, Path]:
    """The build folder for `source`, named by its content, with the source copied in: every
    checkout of the same kernel shares one build (torch rebuilds when the source's path
    changes). While another process holds the build lock this waits for it, and removes it
    once it is stale."""
    text = source.read_bytes()
    build = root / hashlib.sha256(text).hexdigest()[:16]
    build.mkdir(parents=True, exist_ok=True)
    src = build / source.name
    if not src.exists() or src.read_bytes() != text:
        tmp = build / f"{source.name}.{os.getpid()}.tmp"
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
    return _load("tandem_cpu_paged_attention", "cpu_paged_attention.cpp", ["-ffast-math", "-fopenmp"])


def cpu_paged_decode(head_dim: int):
    """The native paged decode-attention function for a model of this head_dim (the kernel
    is built for 64 and 128), or None: attention then runs on the SDPA buckets."""
    ext = cpu_paged_attention() if head_dim in (64, 128) else None
    return ext.paged_decode_attention if ext is not None else None


@functools.cache
def cpu_fused_ops():
    """Fused RMSNorm / residual-add+RMSNorm / RoPE for CPU (kernels/cpu_fused_ops.cpp), or None.
    No fast-math: each op must round exactly as the PyTorch code it replaces."""
    return _load("tandem_cpu_fused_ops", "cpu_fused_ops.cpp", ["-ffp-contract=off"])


@functools.cache
def cpu_quant_gemm():
    """int8-activation GEMMs for the int4 / int8 linears (kernels/cpu_quant_gemm.cpp), or None;
    `supported()` says whether this CPU has AVX512-VNNI. OpenMP here is torch's own runtime
    (the libgomp.so.1 torch loaded first), so at::parallel_for uses torch's thread team."""
    return _load("tandem_cpu_quant_gemm", "cpu_quant_gemm.cpp", ["-fopenmp"])


def _load(name: str, source: str, cflags: list[str]):
    """Build (once, cached by content) and import one extension; None where that fails."""
    if os.environ.get("TANDEM_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from tandem.config import cache_root
        build, src = build_dir(Path(__file__).with_name(source), cache_root().parent / "kernels")
        return load(name=name, sources=[str(src)], extra_cflags=["-O3", "-march=native", *cflags],
                    extra_ldflags=["-fopenmp"] if "-fopenmp" in cflags else [], build_directory=str(build), verbose=False)
    except Exception as e:  # a missing toolchain must not stop serving
        log.warning("native kernel %s unavailable (%s); using the PyTorch path", source, e)
        return None
