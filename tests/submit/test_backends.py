"""The submit interface: every engine implements every method, `--on` goes through one registry, the
submit stage never imports the trainer, and `tandem status` of a k8s job asks kubectl or says it cannot.

No Kubernetes cluster runs here: the kubectl answers below are a stand-in `kubectl` on PATH printing
JSON of the shape `kubectl get -o json` gives for a JobSet, a batch/v1 Job and a Kubeflow TrainJob
(written after the objects' API reference, trimmed to the status fields tandem reads).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
from pathlib import Path

import pytest

import tandem
from tandem.submit.backend import Backend
from tandem.submit.k8s import k8s_state
from tandem.submit.record import read_record, update_record, write_record
from tandem.submit.registry import BACKENDS
from tandem.submit.ray_worker import WORKER_ENTRY, resolve
from tandem_testing import tandem_in_process

METHODS = ("options", "dry_run", "submit", "status", "cancel", "logs")


def test_every_backend_implements_every_method_with_the_interfaces_arguments():
    assert list(BACKENDS) == ["slurm", "k8s", "ssh", "ray"]
    for name, backend in BACKENDS.items():
        assert backend.name == name
        for m in METHODS:
            want = list(inspect.signature(getattr(Backend, m)).parameters)[1:]
            assert list(inspect.signature(getattr(backend, m)).parameters) == want, (name, m)


def test_unknown_backend_is_the_same_one_line_as_before(capsys, monkeypatch):
    code, out, err = tandem_in_process(["submit", "--on", "nowhere", "examples/hello_dist.py"], capsys, monkeypatch)
    assert (code, out) == (2, "")
    assert err == ("error: --on: 'nowhere' is not one of slurm, k8s, ssh, ray. Fix: use --on slurm, --on k8s, "
                   "--on ssh or --on ray\n"), err


def test_status_of_an_unknown_engine_is_one_line(tmp_path, capsys, monkeypatch):
    write_record(tmp_path, {"engine": "nomad"})
    code, out, err = tandem_in_process(["status", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: run_dir: status of nomad jobs is not implemented") and \
        err.count("\n") == 1, err


def test_the_record_is_one_file_every_engine_shares(tmp_path):
    write_record(tmp_path, {"engine": "ssh", "state": "RUNNING"})
    assert update_record(tmp_path, state="DONE", reason="x") == {"engine": "ssh", "state": "DONE", "reason": "x"}
    assert read_record(tmp_path) == {"engine": "ssh", "state": "DONE", "reason": "x"}
    assert [p.name for p in (tmp_path / "submit").iterdir()] == ["job.json"]  # no temporary left behind


def test_submit_never_imports_train():
    """Submit sits below train: the Ray backend names the worker (WORKER_ENTRY), it does not import it."""
    pkg = Path(tandem.__file__).parent
    found = {}
    for p in sorted((pkg / "submit").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad = [n for n in names if n.startswith(("tandem.train", "tandem.cli"))]
            if bad:
                found[p.name] = bad
    assert found == {}
    assert "runpy" not in (pkg / "submit" / "ray_worker.py").read_text()


def test_the_ray_worker_entry_is_handed_over_by_name():
    assert resolve("json:dumps") is json.dumps
    module, _, func = WORKER_ENTRY.partition(":")
    spec = importlib.util.find_spec(module)  # found without importing it (torch) here
    assert spec is not None and f"def {func}(run_dir: str)" in Path(spec.origin).read_text()


def test_ray_dry_run_prints_the_job_and_starts_nothing(tiny_spec, tmp_path, capsys, monkeypatch):
    run = tmp_path / "r"
    code, out, err = tandem_in_process(["submit", "--on", "ray", "--workers", "2", "--max-failures", "1",
                                        "--run-dir", str(run), "--dry-run", str(tiny_spec())], capsys, monkeypatch)
    assert code == 0, err
    head, spec = out.split("\n", 2)[:2], json.loads(out.split("\n", 2)[2])
    assert head[0] == "# ray job: TorchTrainer with 2 worker(s) on a local Ray, up to 1 restart(s) " \
                      "(FailureConfig), device auto", out
    assert head[1].startswith(f"# each worker runs {WORKER_ENTRY}('{run}')"), out
    assert spec["launch"]["run_dir"] == str(run) and spec["launch"]["nproc_per_node"] == 2
    assert not run.exists()


def test_slurm_dry_run_says_where_the_script_would_go_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Its comment used to name a RUN_DIR/submit/job.sbatch that only a real submit writes."""
    run = tmp_path / "r"
    code, out, err = tandem_in_process(["submit", "--on", "slurm", "--run-dir", str(run), "--dry-run",
                                        "examples/hello_dist.py"], capsys, monkeypatch)
    assert code == 0, err
    assert out.splitlines()[1] == ("# Dry run of `tandem submit --on slurm`: nothing written; without --dry-run this "
                                   f"script goes to {run}/submit/job.sbatch and to sbatch"), out
    assert not run.exists()


# -- k8s status ------------------------------------------------------------------------------------

def _k8s_run(tmp_path: Path, kind: str = "jobset") -> Path:
    run = tmp_path / "run"
    write_record(run, {"engine": "k8s", "kind": kind, "name": "hello", "namespace": "team"})
    return run


def _fake_kubectl(tmp_path: Path, answer: dict | None = None, fail: str = "") -> str:
    """A `kubectl` that records its argv and prints ``answer`` (or fails with ``fail`` on stderr)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "answer.json").write_text(json.dumps(answer or {}))
    body = f'echo "{fail}" >&2; exit 1' if fail else f'cat {tmp_path / "answer.json"}'
    exe = bin_dir / "kubectl"
    exe.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "argv"}\n{body}\n')
    exe.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def test_k8s_status_without_kubectl_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    run = _k8s_run(tmp_path)
    (tmp_path / "empty").mkdir()
    code, out, err = tandem_in_process(["status", str(run)], capsys, monkeypatch, path=str(tmp_path / "empty"))
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith("error: run_dir: k8s jobset hello: status unknown: kubectl is not on PATH, so no cluster "
                          "can be asked"), err
    assert "kubectl get jobsets.jobset.x-k8s.io hello -n team" in err, err


def test_k8s_status_when_the_cluster_does_not_answer(tmp_path, capsys, monkeypatch):
    run = _k8s_run(tmp_path)
    refused = "The connection to the server localhost:8080 was refused - did you specify the right host or port?"
    code, out, err = tandem_in_process(["status", str(run)], capsys, monkeypatch,
                                       path=_fake_kubectl(tmp_path, fail=refused))
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert f"k8s jobset hello: status unknown: the cluster did not answer: {refused}" in err, err


JOBSET_RUNNING = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "hello"},
                  "status": {"restarts": 1, "conditions": [
                      {"type": "Completed", "status": "False"}],
                      "replicatedJobsStatus": [{"name": "node", "ready": 1, "active": 1, "succeeded": 0,
                                                "failed": 0, "suspended": 0}]}}
JOBSET_FAILED = {"kind": "JobSet", "status": {"restarts": 3, "conditions": [
    {"type": "Failed", "status": "True", "reason": "FailedJobs",
     "message": "jobset failed due to reaching max number of restarts"}],
    "replicatedJobsStatus": [{"name": "node", "ready": 0, "active": 0, "succeeded": 0, "failed": 1}]}}
JOB_COMPLETE = {"apiVersion": "batch/v1", "kind": "Job", "status": {"succeeded": 2, "ready": 0, "conditions": [
    {"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"}]}}
TRAINJOB_SUSPENDED = {"kind": "TrainJob", "status": {"conditions": [
    {"type": "Suspended", "status": "True", "reason": "Suspended"}], "jobsStatus": []}}


@pytest.mark.parametrize("kind,answer,code,line", [
    ("jobset", JOBSET_RUNNING, 0, "k8s jobset hello (namespace team): RUNNING; jobs active 1, ready 1, succeeded 0, "
                                  "failed 0; restarted 1 time(s)"),
    ("jobset", JOBSET_FAILED, 1, "k8s jobset hello (namespace team): FAILED; jobs active 0, ready 0, succeeded 0, "
                                 "failed 1; restarted 3 time(s); FailedJobs: jobset failed due to reaching max "
                                 "number of restarts"),
    ("indexed", JOB_COMPLETE, 0, "k8s indexed hello (namespace team): COMPLETED; pods active 0, ready 0, "
                                 "succeeded 2, failed 0; restarted 0 time(s)"),
    ("trainjob", TRAINJOB_SUSPENDED, 0, "k8s trainjob hello (namespace team): SUSPENDED; jobs active 0, ready 0, "
                                        "succeeded 0, failed 0; restarted 0 time(s); waiting to be admitted (Kueue) "
                                        "or suspended by hand"),
])
def test_k8s_status_reads_kubectls_answer(tmp_path, capsys, monkeypatch, kind, answer, code, line):
    run = _k8s_run(tmp_path, kind)
    got, out, err = tandem_in_process(["status", str(run)], capsys, monkeypatch, path=_fake_kubectl(tmp_path, answer))
    assert (got, out, err) == (code, line + "\n", ""), (out, err)
    resource = {"jobset": "jobsets.jobset.x-k8s.io", "indexed": "jobs.batch",
                "trainjob": "trainjobs.trainer.kubeflow.org"}[kind]
    assert (tmp_path / "argv").read_text().split() == ["get", resource, "hello", "-n", "team", "-o", "json"]


def test_k8s_state_of_a_job_not_yet_started():
    assert k8s_state({"kind": "JobSet", "status": {}}) == (
        "PENDING", "jobs active 0, ready 0, succeeded 0, failed 0; restarted 0 time(s)")


def test_each_engine_says_where_its_own_output_is(tmp_path):
    """Backend.logs: the line `tandem logs` can print before the rank logs (None: the rank logs are all)."""
    assert BACKENDS["k8s"].logs(_k8s_run(tmp_path)) == \
        "k8s jobset hello: the pods' own output: kubectl logs -n team -l tandem.dev/job=hello --prefix"
    write_record(tmp_path / "s", {"engine": "slurm", "job_id": "42"})
    assert BACKENDS["slurm"].logs(tmp_path / "s") == f"slurm job 42: sbatch output in {tmp_path / 's' / 'submit'}" \
                                                     "/slurm-42.out"
    assert BACKENDS["ssh"].logs(tmp_path / "s") is None and BACKENDS["ray"].logs(tmp_path / "s") is None
