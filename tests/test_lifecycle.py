"""`tandem serve` as two real processes on the tiny model, over real sockets: a non-streaming
client that disconnects is aborted; SIGTERM drains and exits 0 within --shutdown-timeout; a
SIGKILLed engine core fails every stream at once and the server exits non-zero; a SIGKILLed
API process leaves no engine-core process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from server_fixture import free_port
from structured_fixture import with_tokenizer

import tandem

LONG = {"prompt": "a b c", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama wide enough that a 1,000-token request runs for seconds (the tiny one
    would finish before a client could leave), with a real tokenizer."""
    import torch
    import transformers as tf
    from conftest import TINY

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        **{
            **TINY,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        }
    )
    path = tmp_path_factory.mktemp("wide")
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return with_tokenizer(str(path), tmp_path_factory.mktemp("tok") / "m")


class Served:
    """A `tandem serve` subprocess of this tree's code."""

    def __init__(
        self, model_dir: str, *flags: str, port: int | None = None, env: dict | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            **(env or {}),
            "PYTHONPATH": str(Path(tandem.__file__).resolve().parents[1]),
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "serve",
                "--model",
                model_dir,
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--kv-cache-memory",
                str(64 << 20),
                "--num-threads",
                "1",
                "--log-level",
                "warning",
                *flags,
            ],
            env=env,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()  # not left running after the test
        raise TimeoutError("tandem serve did not come up")

    def engine_pids(self) -> list[int]:
        """The engine-core process (multiprocessing's spawn; not its resource tracker)."""
        return [
            c.pid
            for c in psutil.Process(self.proc.pid).children()
            if "spawn_main" in " ".join(c.cmdline())
        ]

    def running(self) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("tandem:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no tandem:num_requests_running")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _stream(url: str, ended: list, started: threading.Event | None = None) -> None:
    """A streaming completion; records (when it ended, how) once the stream closes."""
    how = "closed"
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
        ) as r:
            for line in r.iter_lines():
                if started is not None and line.startswith("data: {"):
                    started.set()
                if line.startswith("data: ") and '"error"' in line:
                    how = "error"
    except httpx.HTTPError:
        how = "dropped"
    ended.append((time.monotonic(), how))


def _streams(url: str, n: int) -> tuple[list, list[threading.Thread]]:
    """n streaming clients, returned once each has its first token: (ended, threads)."""
    ended: list = []
    started = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(url, ended, s)) for s in started]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)
    return ended, threads


@pytest.mark.slow  # a served process, a drain and its timeout: ~10-14 s
def test_disconnect_then_sigterm_drains_and_exits_zero(model_dir):
    srv = Served(model_dir, "--shutdown-timeout", "3")
    try:
        # a non-streaming client that goes away: its request is aborted
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=LONG, timeout=1.5)
        gone = time.monotonic()
        while srv.running() > 0 and time.monotonic() - gone < 2.0:
            time.sleep(0.05)
        assert srv.running() == 0, "the disconnected request still runs"
        # SIGTERM with requests in flight: 503 for new ones, exit 0 within the timeout
        ended, threads = _streams(srv.url, 2)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        r = httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert srv.proc.wait(15) == 0
        assert time.monotonic() - sent < 3.0  # gone within --shutdown-timeout
        for t in threads:
            t.join(5)
        assert sorted(how for _, how in ended) == [
            "error",
            "error",
        ]  # aborted with an error they saw
    finally:
        srv.close()


def test_engine_core_kill_ends_16_streams_within_2s(model_dir):
    srv = Served(model_dir)
    try:
        [engine_pid] = srv.engine_pids()
        ended, threads = _streams(srv.url, 16)
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(5)
        assert len(ended) == 16 and all(t - killed < 2.0 for t, _ in ended), ended
        assert all(how in ("error", "closed", "dropped") for _, how in ended)
        try:
            health = httpx.get(srv.url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            health = None  # already gone
        assert health in (503, None)
        assert srv.proc.wait(10) == 1
    finally:
        srv.close()


@pytest.mark.slow  # two served processes, one killed
def test_request_metrics_cross_then_no_orphan_after_the_api_process_is_killed(model_dir):
    srv = Served(model_dir)
    try:
        # what `tandem bench serve` reads for the front-end delay (§8.3): the usage chunk's split
        body = {
            "prompt": "a b",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        split = chunks[-1]["metrics"]
        assert split["queue_time"] >= 0 and split["prefill_time"] > 0 and split["decode_time"] > 0
        [engine_pid] = srv.engine_pids()
        engine = psutil.Process(engine_pid)
        srv.proc.kill()
        srv.proc.wait(10)
        engine.wait(5)  # raises psutil.TimeoutExpired if it outlived its parent
    finally:
        srv.close()
