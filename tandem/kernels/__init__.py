"""Native kernels, compiled on first use and cached; every caller has a PyTorch fallback."""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


@functools.cache
def cpu_paged_attention():
    """The CPU paged decode-attention extension, or None when it cannot be built here
    (no compiler, or TANDEM_NO_NATIVE=1)."""
    if os.environ.get("TANDEM_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        from tandem.models.loader import cache_root
        build = cache_root().parent / "kernels"
        build.mkdir(parents=True, exist_ok=True)
        return load(name="tandem_cpu_paged_attention",
                    sources=[str(Path(__file__).with_name("cpu_paged_attention.cpp"))],
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    build_directory=str(build), verbose=False)
    except Exception as e:  # a missing toolchain must not stop serving
        log.warning("CPU attention kernel unavailable (%s); using the PyTorch path", e)
        return None
