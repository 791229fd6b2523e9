"""The plan artifact (tandem/plan/artifact.py): every plan marked trainable or not, with the reason; the
winner's layout as job-spec overrides; the job's world counted as `tandem train` counts it."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tandem.cli import app
from tandem.core.dims import ParallelDims
from tandem.core.errors import ConfigError
from tandem.plan import artifact
from tandem.plan.inputs.args import from_job_spec

ROOT = Path(__file__).resolve().parents[2]
GPT = str(ROOT / "examples" / "gpt_reverse.toml")


def test_search_marks_what_tandem_cannot_train(tmp_path):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["plan", "--config", GPT, "--search", "--top", "200", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["artifact"] == artifact.ARTIFACT
    assert doc["job"]["world"] == 2 and doc["job"]["model"]["layers"] == 2 and doc["job"]["model"]["kv_heads"] == 2
    marks = [(p["strategy"], p["trainable"]) for p in doc["plans"]]
    # the example's embeddings are tied: the trainer's own spec check refuses every pipeline of it
    piped = [m for s, m in marks if s["pp"] > 1]
    assert piped and all(not m["ok"] and m["why"].startswith("model.tied:") for m in piped)
    assert all(m["ok"] and m["why"] is None for s, m in marks if s["pp"] == 1)
    assert "tandem train" in r.output    # the table's row for the winner

    # a model and layouts the trainer lacks: marked in the JSON and on the winner's and near misses' lines
    r = CliRunner().invoke(app, ["plan", "mixtral-8x7b", "--nodes", "4", "--search", "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert not any(p["trainable"]["ok"] for p in doc["plans"])
    assert any("ep " in (p["trainable"]["why"] or "") for p in doc["plans"] if p["strategy"]["ep"] > 1)
    assert "Not trainable by tandem yet" in doc["search"]["reasons"][1]
    # --trainable ranks only what tandem trains
    r = CliRunner().invoke(app, ["plan", "llama3-8b", "--nodes", "2", "--global-batch", "64", "--search",
                                 "--trainable", "--json"])
    doc = json.loads(r.output)
    assert doc["search"]["untrainable_left_out"] > 0 and all(p["trainable"]["ok"] for p in doc["plans"])

    # one source of truth: the degrees the trainer cannot build (ParallelDims.trainer_refusal)
    assert "pipeline" in ParallelDims.from_degrees(2, 1, 2, zero=1).trainer_refusal()
    assert "hsdp" in ParallelDims.from_degrees(8, zero=2, hybrid=True, ranks_per_node=4).trainer_refusal()
    assert ParallelDims.from_degrees(8, zero=3, hybrid=True, ranks_per_node=4).trainer_refusal() is None
    # ep composes with tp (tandem/train/parallel/expert.py); not with pp, cp, zero1 or hsdp
    assert ParallelDims.from_degrees(4, tp=2, ep=2).trainer_refusal() is None
    assert ParallelDims.from_degrees(4, tp=2, zero=3, ep=2).trainer_refusal() is None
    assert "pipeline stages or context" in ParallelDims.from_degrees(4, tp=2, pp=2, ep=2).trainer_refusal()
    assert "pipeline stages or context" in ParallelDims.from_degrees(4, cp=2, ep=2).trainer_refusal()
    assert "ep 2 with zero1" in ParallelDims.from_degrees(4, tp=2, zero=1, ep=2).trainer_refusal()
    ov, why = artifact.layout_overrides(dict(dp=8, tp=1, pp=1, zero=3, hsdp=True, micro_batch=2, global_batch=64,
                                             recompute="full", schedule="1f1b", virtual=1), gpus_per_node=4)
    assert why is None and ov["parallel.strategy"] == "hsdp" and ov["parallel.dp_shard"] == 4
    assert ov["parallel.activation_checkpoint"] == "full" and ov["schedule.micro_batch"] == 2
    _, why = artifact.layout_overrides(dict(dp=2, tp=1, pp=1, zero=0, micro_batch=2, global_batch=64,
                                            recompute="selective"), gpus_per_node=2)
    assert why.startswith("recompute selective")

    # a search whose winner tandem cannot train: train --plan refuses it and names the best it does train
    base = dict(dp=2, tp=1, pp=1, cp=1, ep=1, zero=0, hsdp=False, micro_batch=8, global_batch=64, grad_accum=4,
                schedule="1f1b", virtual=1, recompute="none")
    doc = {"job": {"gpus_per_node": 2}, "plans": [
        {"strategy": dict(base, dp=1, pp=2, zero=1), "trainable": {"ok": False}},
        {"strategy": base, "trainable": {"ok": True}}]}
    with pytest.raises(ConfigError, match=r"zero 1 with pp 2.*plan #2 \(dp2 tp1 pp1 z0 mb8\)"):
        artifact.spec_overrides(doc, "p.json")
    doc["plans"].reverse()
    ov, win = artifact.spec_overrides(doc, "p.json")
    assert ov["parallel.strategy"] == "ddp" and win["strategy"] == base

    # `tandem plan --config` counts simulated nodes in the world, as `tandem train` does
    sim = tmp_path / "sim.toml"
    sim.write_text(Path(GPT).read_text().replace("nproc_per_node = 2", "nproc_per_node = 1\nsimulate_nodes = 2"))
    assert from_job_spec(str(sim))["nodes"] == 2
