"""The machine a profile was measured on, and a warning when a CPU profile is used elsewhere.

A CPU step time depends on the CPU's vector units (AMX makes prefill several times faster
than AVX-512) and on the cores the run had, so `tandem profile` records them and
`tandem simulate` / `tandem plan` compare them with the machine they run on."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

# Vector features that change CPU step times by a large factor (from /proc/cpuinfo flags).
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo() -> tuple[str, list[str]]:
    """(CPU model name, the VECTOR_FLAGS it has); platform's name where /proc is absent."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), [
        f for f in VECTOR_FLAGS if f in flags
    ]


def cores_available() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def machine_info(
    threads: int | None = None, dtype: str | None = None, gpu: str | None = None
) -> dict:
    """This machine: CPU model and vector flags, cores (available and used), torch, dtype, GPU."""
    model, flags = _cpuinfo()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {
        "cpu_model": model,
        "cpu_flags": flags,
        "cores_available": cores_available(),
        "cores_used": threads,
        "torch": torch_version,
        "dtype": dtype,
        "gpu": gpu,
    }


def describe(m: dict | None) -> str:
    if not m:
        return "machine not recorded"
    cpu = f"{m.get('cpu_model')} ({', '.join(m.get('cpu_flags') or []) or 'no AVX2/AVX-512/AMX'})"
    parts = [
        f"GPU {m['gpu']}" if m.get("gpu") else None,
        cpu,
        f"{m.get('cores_used') or '?'} of {m.get('cores_available')} cores",
        f"torch {m.get('torch')}",
        m.get("dtype"),
    ]
    return ", ".join(p for p in parts if p)


def profile_warning(info: dict, kind: str) -> str | None:
    """A warning when a measured CPU profile comes from another machine than this one (or does
    not say which); None for roofline and GPU profiles, and when the machines match."""
    if kind != "measured" or not str(info.get("device", "cpu")).startswith("cpu"):
        return None
    recorded = info.get("machine")
    if not recorded:
        return (
            "warning: this CPU profile does not record the machine it was measured on; "
            "CPU step times differ by several times between CPUs: "
            "run `tandem profile` here for figures of this machine"
        )
    here = machine_info()
    diffs = [
        f"{name} {recorded.get(key)!r} here {here[key]!r}"
        for name, key in (("CPU", "cpu_model"), ("vector flags", "cpu_flags"))
        if recorded.get(key) != here[key]
    ]
    used = recorded.get("cores_used")
    if used and used > here["cores_available"]:
        diffs.append(f"it used {used} cores, {here['cores_available']} are available here")
    if not diffs:
        return None
    return (
        "warning: this CPU profile was measured on another machine ("
        + "; ".join(diffs)
        + "): its step times may not hold here; run `tandem profile` on this machine"
    )


def provenance_lines(info: dict, kind: str) -> list[str]:
    """What `tandem simulate` and `tandem plan` print under the cost model's name."""
    lines = [f"  measured on: {describe(info.get('machine'))}"] if kind == "measured" else []
    warning = profile_warning(info, kind)
    return lines + ([f"  {warning}"] if warning else [])
