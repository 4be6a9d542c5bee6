"""Restart after a crash, as a supervisor does it (examples/tandem.service: Restart=on-failure):
a server whose engine-core process was SIGKILLed exits 1, leaving nothing of its run behind
(its ZeroMQ ipc socket folder, the shared-memory segments and files its processes held), and
the same command on the same port serves again."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest
from cluster_fixture import wait_for
from structured_fixture import with_tokenizer
from test_lifecycle import Served

SHM = Path("/dev/shm")


def held_files(pids: list[int]) -> set[str]:
    """Shared-memory segments and temp-folder files the processes have open or mapped."""
    held = set()
    for pid in pids:
        proc = psutil.Process(pid)
        held |= {f.path for f in proc.open_files()}
        held |= {m.path for m in proc.memory_maps() if m.path.startswith(str(SHM))}
    return held


def new_tandem_files(folder: Path, before: set[str]) -> set[str]:
    return {
        n
        for n in (set(os.listdir(folder)) if folder.is_dir() else set()) - before
        if n.startswith("tandem")
    }


def served_once(srv: Served) -> None:
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"prompt": "a b", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow  # a served process twice, and a wait for its segments
def test_engine_core_killed_exits_1_and_a_restart_serves_with_nothing_left(
    tiny_model_dirs, tmp_path
):
    model = with_tokenizer(tiny_model_dirs["llama"], tmp_path / "m")
    run_tmp = tmp_path / "tmp"  # the server's TMPDIR: where its ipc socket folder lives
    run_tmp.mkdir()
    shm_before = new_tandem_files(SHM, set())
    first = Served(model, env={"TMPDIR": str(run_tmp)})
    try:
        served_once(first)
        [engine] = first.engine_pids()
        sockets = [p for p in run_tmp.iterdir() if p.name.startswith("tandem-core-")]
        assert len(sockets) == 1 and {p.name for p in sockets[0].iterdir()} >= {"input", "output"}
        held = held_files([first.proc.pid, engine])
        os.kill(engine, signal.SIGKILL)
        assert first.proc.wait(15) == 1
    finally:
        first.close()
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
    assert list(run_tmp.iterdir()) == [], list(run_tmp.iterdir())  # no socket folder, no file
    assert not [
        p
        for p in held
        if Path(p).exists() and (p.startswith(str(SHM)) or p.startswith(str(run_tmp)))
    ]
    # a segment this run left stays; one of a P/D transfer in a test running beside this one (on
    # another xdist worker) is unlinked by its receiver within moments
    new_shm = new_tandem_files(SHM, shm_before)
    assert wait_for(lambda: not new_shm & new_tandem_files(SHM, shm_before), 5), new_shm
    second = Served(
        model, port=first.port, env={"TMPDIR": str(run_tmp)}
    )  # the supervisor's restart
    try:
        served_once(second)
        assert httpx.get(second.url + "/health", timeout=5).status_code == 200
    finally:
        second.close()
