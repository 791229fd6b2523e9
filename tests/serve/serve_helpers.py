"""Helpers of the serve tests: tiny exports written in this process, a real `tandem serve` subprocess,
and the reference computations run on `tandem.export.load` directly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tandem_testing import ROOT, TINY, wait_for  # noqa: F401 (tests import it from here)


def export(run: Path, out: Path) -> Path:
    """`tandem export RUN --out OUT` through the real CLI entry, in this process."""
    from tandem.cli import main

    try:
        main(["export", str(run), "--out", str(out)])
    except SystemExit as e:
        assert not e.code, f"tandem export failed ({e.code})"
    return out


def write_resnet_checkpoint(run: Path, step: int = 3) -> Path:
    """A run dir holding one checkpoint of a small ResNet-18 (BatchNorm in eval mode: running stats
    made non-trivial), published the way the trainer publishes one."""
    from export.export_helpers import publish_checkpoint
    from tandem.core.config import load_spec

    run.mkdir(parents=True, exist_ok=True)
    spec_path = run / "job.toml"
    spec_path.write_text(TINY.format(model="resnet18", remainder="pad", global_batch=16, micro_batch=8,
                                     max_steps=2, dtype="fp32", every=0, keep=1, nproc=1, run_dir=str(run)))

    def bn_stats(sd: dict) -> None:
        for k, v in sd.items():
            if k.endswith(".running_mean"):
                v.normal_(0, 0.1)
            elif k.endswith(".running_var"):
                v.uniform_(0.5, 1.5)

    return publish_checkpoint(run, load_spec(spec_path, check=False), step, bn_stats)


class Server:
    """`tandem serve EXPORT --port 0 ...` as a subprocess, ready (every replica warmed up) on entry."""

    def __init__(self, export_dir: Path, run_dir: Path, *args: str, ready_timeout: float = 120,
                 headers: dict | None = None, env: dict | None = None):
        self.export_dir, self.run_dir, self.args, self.ready_timeout = export_dir, run_dir, args, ready_timeout
        self.headers, self.env = headers or {}, env or {}

    def __enter__(self) -> "Server":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(self.run_dir / "front.log", "w")
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", str(self.export_dir), "--port", "0",
                                      "--run-dir", str(self.run_dir), *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        info = self.run_dir / "server.json"
        wait_for(lambda: info.is_file() or self.proc.poll() is not None, 60, "server.json")
        assert self.proc.poll() is None, self.output()
        self.url = json.loads(info.read_text())["url"]
        self.client = httpx.Client(base_url=self.url, timeout=60, headers=self.headers)
        wait_for(self._ready, self.ready_timeout, "/readyz 200")
        return self

    def _ready(self) -> bool:
        assert self.proc.poll() is None, self.output()
        try:
            return self.client.get("/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.run_dir / "front.log").read_text()[-4000:]

    def pids(self) -> list[int]:
        return [r["pid"] for r in json.loads((self.run_dir / "replicas.json").read_text())["replicas"]]

    def metrics(self) -> dict[tuple[str, str], float]:
        """tandem_serve_requests_total by (route, code)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(self.client.get("/metrics").text):
            for s in fam.samples:
                if s.name == "tandem_serve_requests_total":
                    out[(s.labels["route"], s.labels["code"])] = s.value
                elif s.name in ("tandem_serve_replica_restarts_total", "tandem_serve_inflight"):
                    out[(s.name, "")] = s.value
                elif s.name == "tandem_serve_requests_given_up_total":
                    out[(s.name, s.labels["reason"])] = s.value
        return out

    def __exit__(self, *exc) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding on the loaded export, one sequence at a time, the plain way."""
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]
