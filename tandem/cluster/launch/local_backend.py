"""Instances as local processes: each a `tandem serve` (or embedding server) on a free port, in a
process group of its own, so stopping it also stops any process it started (its engine core).
On Linux an instance also dies with the launcher, even one killed by SIGKILL."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tandem.cluster.config import ClusterConfig
from tandem.cluster.launch.instances import (
    InstanceSpec,
    external_instances,
    free_port,
    instance_died,
    plan,
    wait_healthy,
)
from tandem.cluster.router.pool import Instance

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


def instance_command(spec: InstanceSpec, port: int, config_file: Path) -> list[str]:
    g = spec.group
    if g.kind == "embedding":
        return [
            sys.executable,
            "-m",
            "tandem.cluster.launch.embedding_server",
            "--model",
            g.model,
            "--served-model-name",
            g.name,
            "--port",
            str(port),
            "--num-threads",
            str(spec.num_threads),
            "--log-level",
            "warning",
        ]
    config_file.write_text(
        yaml.safe_dump({"serving": {"engine": {**g.engine, "num_threads": spec.num_threads}}})
    )
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--config",
        str(config_file),
        "--model",
        g.model,
        "--served-model-name",
        g.name,
        "--port",
        str(port),
        "--role",
        spec.role,
        "--log-level",
        "warning",
    ]
    return cmd + (["--elastic"] if spec.elastic else [])


class LocalBackend:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, InstanceSpec] = {}
        self.instances: dict[str, Instance] = {}
        self.left_out: set[str] = set()  # died and not restarted
        self.start_timeout = 600.0

    def start(self, timeout: float = 600.0) -> list[Instance]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout = timeout
        try:
            for spec in plan(self.cfg):
                self.specs[spec.id] = spec
                self.instances[spec.id] = spec.instance(self._launch(spec, "wb"))
            wait_healthy(
                {iid: inst.url for iid, inst in self.instances.items()}, self._exited, timeout
            )
        except BaseException:
            self.stop()
            raise
        return list(self.instances.values()) + external_instances(self.cfg)

    def _launch(self, spec: InstanceSpec, log_mode: str) -> str:
        """Start the instance's process; returns its URL. A restart appends to its log."""
        port = free_port()
        cmd = instance_command(spec, port, self.log_dir / f"{spec.id}.yaml")
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(spec.num_threads),
        }
        with open(self.log_dir / f"{spec.id}.log", log_mode) as logf:
            self.procs[spec.id] = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        return f"http://127.0.0.1:{port}"

    def rendezvous_host(self) -> str:
        """Where instances reach a store this process serves (torch_dist KV transfer)."""
        return "127.0.0.1"

    def _exited(self, iid: str) -> str | None:
        code = self.procs[iid].poll()
        if code is None:
            return None
        tail = (self.log_dir / f"{iid}.log").read_text(errors="replace")[-2000:]
        return f"exit code {code}; log {self.log_dir / f'{iid}.log'}:\n{tail}"

    def check(self) -> None:
        """An instance whose process exited is reported, then started again or left out."""
        for iid, proc in list(self.procs.items()):
            why = None if iid in self.left_out else self._exited(iid)
            if why is None:
                continue
            _kill_group(proc)  # whatever it left behind
            proc.wait()
            inst, spec = self.instances[iid], self.specs[iid]
            if not instance_died(inst, spec, why):
                self.left_out.add(iid)
                continue
            inst.url = self._launch(spec, "ab")
            try:
                wait_healthy({iid: inst.url}, self._exited, self.start_timeout)
                log.info("instance %s is back at %s", iid, inst.url)
            except (RuntimeError, TimeoutError) as e:
                log.error("instance %s did not come back, left out: %s", iid, e)
                self.left_out.add(iid)
                _kill_group(self.procs[iid])

    def stop(self) -> None:
        """SIGTERM to each instance (it drains: stops admitting, finishes what is in flight), up
        to `stop_timeout_s` for all of them to exit, then SIGKILL to every process group: what
        is still running, and any child an instance left behind."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        for iid, p in self.procs.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning(
                    "instance %s still running after %.0f s: SIGKILL", iid, self.cfg.stop_timeout_s
                )
        for p in self.procs.values():
            _kill_group(p)
            p.wait()


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGKILL the child when the thread that starts it exits
    (Linux; the launcher starts every instance from its main thread). The instance's engine core
    dies with the instance in turn. Elsewhere only stop() ends the instances."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # loaded here: no dlopen in the child
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the prctl
            os._exit(1)

    return preexec


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it was started in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty already
        pass
