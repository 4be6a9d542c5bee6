"""`tandem cluster up` as a user runs it (a process, tiny model, two model groups of one local
instance each): an instance that dies is reported and restarted or left out as its group says;
SIGTERM drains and stops every process the launcher started, and the launcher exits 0 only once
they are gone (before issue 13, SIGTERM killed the launcher and left its instances running);
SIGKILL takes them with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from cluster_fixture import wait_for
from server_fixture import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PORT = free_port()  # the router's; any other test (or xdist worker) may serve beside it
ENGINE = {"dtype": "float32", "kv_cache_memory": 4 << 20, "num_threads": 1}


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _alive(procs) -> list[psutil.Process]:
    """is_running() compares the start time too, so a reused pid does not count."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _state(port: int = PORT) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/cluster/state", timeout=2, trust_env=False).json()


def _cluster_up(tmp: Path, doc: dict, port: int) -> tuple[subprocess.Popen, Path]:
    """`tandem cluster up` on this cluster.yaml document, its router on `port`: (process, its
    log). No native kernels: their first build (or another checkout's, holding the shared build
    lock) would stall an instance's first request for 20 s or more."""
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(doc))
    log = tmp / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "cluster",
                "up",
                "--config",
                str(tmp / "cluster.yaml"),
                "--port",
                str(port),
            ],
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_NO_NATIVE": "1"},
        )
    return proc, log


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    """A running `tandem cluster up`: (process, its log file, the processes it started). Whatever
    it leaves is killed after."""
    tmp = tmp_path_factory.mktemp("cluster-up")
    doc = {
        "log_dir": str(tmp / "logs"),
        "stop_timeout_s": 20,
        "router": {"poll_interval_s": 0.2},
        "models": [
            {
                "name": "a",
                "model": tiny_model_dirs["llama"],
                "instances": 1,
                "engine": ENGINE,
                "restart": True,
            },
            {"name": "b", "model": tiny_model_dirs["llama"], "instances": 1, "engine": ENGINE},
        ],
    }
    proc, log = _cluster_up(tmp, doc, PORT)
    seen: set[psutil.Process] = set()
    try:
        assert wait_for(lambda: _healthy(proc, ["a-0", "b-0"]), 240), log.read_text()[-3000:]
        seen.update(_descendants(proc.pid))
        yield proc, log, seen
    finally:
        _stop(proc, seen)


def _stop(proc: subprocess.Popen, seen: set[psutil.Process]) -> None:
    """SIGTERM the launcher if it still runs, then kill whatever it left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    for p in _alive(seen | set(_descendants_or_none(proc))):
        p.kill()


def _descendants_or_none(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return _descendants(proc.pid)
    except psutil.NoSuchProcess:
        return []


def _healthy(proc: subprocess.Popen, ids: list[str], port: int = PORT) -> bool:
    assert proc.poll() is None, "tandem cluster up exited"
    try:
        state = _state(port)
    except httpx.HTTPError:
        return False
    return all(state.get(i, {}).get("healthy") for i in ids)


def _instance_proc(proc: subprocess.Popen, group: str) -> psutil.Process:
    """The launcher's child serving `group` (the instance's own children are below it)."""
    (p,) = [
        p
        for p in _alive(psutil.Process(proc.pid).children())
        if f"--served-model-name {group}" in " ".join(_cmdline(p))
    ]
    return p


def _cmdline(p: psutil.Process) -> list[str]:
    """A child's command line; none for one that ended since it was listed (a short-lived helper
    can turn zombie between the two reads)."""
    try:
        return p.cmdline()
    except psutil.NoSuchProcess:  # ZombieProcess too
        return []


def test_a_dead_instance_is_restarted_or_left_out(cluster):
    proc, log, seen = cluster
    before = _state()
    for group in ("a", "b"):
        _instance_proc(proc, group).kill()
    assert wait_for(lambda: not _state()["b-0"]["healthy"], 5)
    assert wait_for(
        lambda: _healthy(proc, ["a-0"]) and _state()["a-0"]["url"] != before["a-0"]["url"], 120
    ), log.read_text()[-3000:]
    # the router can see the new a-0 healthy before the launcher's own wait for it logs "is back"
    assert wait_for(
        lambda: all(
            line in log.read_text()
            for line in ("left out (restart: false)", "instance a-0 is back")
        ),
        30,
    ), log.read_text()[-3000:]
    text = log.read_text()
    assert "instance b-0 (b) died" in text and "instance a-0 (a) died" in text
    time.sleep(1.0)  # a few more polls: b stays out
    assert not _state()["b-0"]["healthy"]
    r = httpx.post(
        f"http://127.0.0.1:{PORT}/v1/completions",
        timeout=30,
        trust_env=False,
        json={"model": "a", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    seen.update(_descendants(proc.pid))  # the restarted instance too


def test_sigterm_stops_every_process_it_started(cluster):
    proc, log, seen = cluster
    seen.update(_descendants(proc.pid))
    assert _alive(seen), "no process of the cluster is running before the signal"
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            "tandem cluster up still running 60 s after SIGTERM:\n" + log.read_text()[-3000:]
        )
    left = _alive(seen)
    assert not left, f"left running: {[(p.pid, ' '.join(p.cmdline())) for p in left]}"
    assert code == 0, log.read_text()[-3000:]
    assert "SIGTERM: stopping the router and every instance" in log.read_text()


def test_sigkill_takes_every_process_it_started_with_it(tiny_model_dirs, tmp_path):
    """A launcher killed by SIGKILL cannot stop its instances: the kernel kills each with it (it
    runs in a session of its own), and the instance's engine core with the instance."""
    port = free_port()
    doc = {
        "log_dir": str(tmp_path / "logs"),
        "models": [{"name": "a", "model": tiny_model_dirs["llama"], "engine": ENGINE}],
    }
    proc, log = _cluster_up(tmp_path, doc, port)
    started: set[psutil.Process] = set()
    try:
        assert wait_for(lambda: _healthy(proc, ["a-0"], port), 240), log.read_text()[-3000:]
        started.update(_descendants(proc.pid))
        assert len(_alive(started)) >= 2, "the instance and its engine core"
        proc.kill()
        proc.wait()
        assert wait_for(lambda: not _alive(started), 10), [
            " ".join(_cmdline(p)) for p in _alive(started)
        ]
    finally:
        _stop(proc, started)
