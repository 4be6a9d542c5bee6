"""Native kernels are built once per source, flags and toolchain, into a folder every checkout and
virtualenv shares, and imported from there without running torch's build again."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension

import tandem.kernels as kernels


def test_the_build_folder_is_keyed_by_source_flags_and_toolchain_not_by_path(tmp_path, monkeypatch):
    """The unit's source goes in as text (so no checkout's path reaches the key), and the
    toolchain names no virtualenv."""
    text, root, key = b"int x;\n", tmp_path / "kernels", "-O3|" + kernels.toolchain()
    build, _ = kernels.build_dir("k.cpp", text, root, key)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "another-venv" / "bin" / "python"))
    assert (
        kernels.build_dir("k.cpp", text, root, "-O3|" + kernels.toolchain())[0] == build
    )  # another venv
    assert str(tmp_path) not in kernels.toolchain() and sys.prefix not in kernels.toolchain()
    assert kernels.build_dir("k.cpp", text, root, "-O2|" + kernels.toolchain())[0] != build  # flags
    assert (
        kernels.build_dir("k.cpp", text, root, key.replace(torch.__version__, "0.0"))[0] != build
    )  # torch
    assert kernels.build_dir("k.cpp", b"int y;\n", root, key)[0] != build  # source


def test_a_kernels_per_isa_files_are_part_of_its_units_source():
    """A kernel's `#include "file"` lines are expanded into its unit's text: the hash naming the
    build covers those files, and the build folder needs no file but the unit."""
    text = kernels.unit_source("cpu_kernels").decode()
    assert '#include "' not in text
    for part in ("cpu_quant_gemm_avx512.h", "cpu_quant_gemm_avx2.h"):
        assert Path(kernels.__file__).with_name(part).read_text() in text


def test_a_built_kernel_is_imported_without_torchs_build(monkeypatch):
    """What `tandem prepare` built, a server start imports: torch's `load` (ninja, whose build file
    names this virtualenv's paths) is not called."""
    built = kernels._built("cpu_kernels")
    if not built.exists():
        pytest.skip("the cpu_kernels unit is not built here (`tandem prepare` builds it)")

    def no_build(*args, **kwargs):
        raise AssertionError("torch's load ran for a kernel already built")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    ext = kernels._load("cpu_kernels")
    assert ext is not None and ext.__file__ == str(built) and ext.cpu_fused_ops.rms_norm is not None


def test_prepare_starts_no_build_process_for_kernels_already_built(monkeypatch):
    """`tandem prepare` on a machine that has every kernel (the install's second step, any later
    run) loads them in-process: a build process would import torch again for nothing."""
    if not all(kernels._built(unit).exists() for unit in kernels.UNITS):
        pytest.skip("not every kernel is built here (`tandem prepare` builds them)")

    def no_process(*args, **kwargs):
        raise AssertionError("a build process started for a kernel already built")

    monkeypatch.setattr(kernels.subprocess, "Popen", no_process)
    assert kernels.prepare() == {name: True for name in kernels.UNIT_OF}


def test_a_missing_kernel_is_built_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "models"))
    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw) or "built")
    with caplog.at_level(logging.INFO, logger="tandem.kernels"):
        assert kernels._load("cpu_kernels") == "built"
    assert len(calls) == 1 and calls[0]["build_directory"] == str(
        kernels._built("cpu_kernels").parent
    )
    assert calls[0]["build_directory"].startswith(str(tmp_path / "kernels"))
    assert (
        "building native kernels cpu_fused_ops, cpu_quant_gemm, cpu_invariant_gemm" in caplog.text
    )
    assert "tandem prepare" in caplog.text
