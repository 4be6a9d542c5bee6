"""Native kernels are built once per source, flags and toolchain, into a folder every checkout and
virtualenv shares, and imported from there without running torch's build again."""
from __future__ import annotations

import logging
import sys

import pytest
import torch.utils.cpp_extension

import tandem.kernels as kernels


def test_the_build_folder_is_keyed_by_source_flags_and_toolchain_not_by_path(tmp_path, monkeypatch):
    a, b = tmp_path / "checkout-a" / "k.cpp", tmp_path / "checkout-b" / "k.cpp"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("int x;\n")
    key = "-O3|" + kernels.toolchain()
    build, _ = kernels.build_dir(a, tmp_path / "kernels", key)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "another-venv" / "bin" / "python"))
    assert kernels.build_dir(b, tmp_path / "kernels", key)[0] == build  # another checkout, another venv
    assert str(tmp_path) not in kernels.toolchain() and sys.prefix not in kernels.toolchain()
    assert kernels.build_dir(a, tmp_path / "kernels", "-O2|" + kernels.toolchain())[0] != build  # flags
    assert kernels.build_dir(a, tmp_path / "kernels", key.replace(torch.__version__, "0.0"))[0] != build  # torch


def test_a_built_kernel_is_imported_without_torchs_build(monkeypatch):
    """What `tandem prepare` built, a server start imports: torch's `load` (ninja, whose build file
    names this virtualenv's paths) is not called."""
    built = kernels._built("cpu_fused_ops")
    if not built.exists():
        pytest.skip("cpu_fused_ops is not built here (`tandem prepare` builds it)")

    def no_build(*args, **kwargs):
        raise AssertionError("torch's load ran for a kernel already built")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    ext = kernels._load("cpu_fused_ops")
    assert ext is not None and ext.__file__ == str(built)


def test_prepare_starts_no_build_process_for_kernels_already_built(monkeypatch):
    """`tandem prepare` on a machine that has every kernel (the install's second step, any later
    run) loads them in-process: a build process would import torch again for nothing."""
    if not all(kernels._built(name).exists() for name in kernels.CFLAGS):
        pytest.skip("not every kernel is built here (`tandem prepare` builds them)")

    def no_process(*args, **kwargs):
        raise AssertionError("a build process started for a kernel already built")
    monkeypatch.setattr(kernels.subprocess, "Popen", no_process)
    assert kernels.prepare() == {name: True for name in kernels.CFLAGS}


def test_a_missing_kernel_is_built_and_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "models"))
    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(kw) or "built")
    with caplog.at_level(logging.INFO, logger="tandem.kernels"):
        assert kernels._load("cpu_fused_ops") == "built"
    assert len(calls) == 1 and calls[0]["build_directory"] == str(kernels._built("cpu_fused_ops").parent)
    assert calls[0]["build_directory"].startswith(str(tmp_path / "kernels"))
    assert "building native kernel cpu_fused_ops.cpp" in caplog.text and "tandem prepare" in caplog.text
