"""The advice against diagnose's own model: a proposed setting predicted slower is never the
change (verdicts.weigh), and evidence lines name the rank they are about (verdicts.judge)."""

from __future__ import annotations

import copy

from tandem.diagnose.verdicts import judge, weigh

# the README's diagnose example on this VM: the no-overlap verdict's bucket size priced at 1.11x
STEP_TIME = {"now": {"setting": "now", "step_ms": 50.9},
             "rows": [{"setting": "parallel.strategy zero1", "changes": {"parallel.strategy": "zero1"},
                       "step_ms": 58.0, "vs_now": 1.139},
                      {"setting": "parallel.comm_hook bf16", "changes": {"parallel.comm_hook": "bf16"},
                       "step_ms": 47.9, "vs_now": 0.941},
                      {"setting": "precision.dtype bf16", "changes": {"precision.dtype": "bf16"}, "error": "refused"},
                      {"setting": "parallel.bucket_cap_mb 0.0895", "changes": {"parallel.bucket_cap_mb": 0.0895},
                       "step_ms": 56.6, "vs_now": 1.112}]}


def _no_overlap() -> dict:
    return {"kind": "no-overlap", "ranks": [0, 1], "evidence": [], "setting": {"parallel.bucket_cap_mb": 0.0895},
            "title": "no overlap: one gradient bucket, sent after the backward",
            "change": "lower parallel.bucket_cap_mb to 0.0895 (about 4 buckets per step): ..."}


def test_a_setting_predicted_slower_gives_way_to_the_fastest_what_if():
    v = _no_overlap()
    weigh([v], STEP_TIME)
    assert v["setting"] == {"parallel.comm_hook": "bf16"}
    assert v["change"].startswith("parallel.comm_hook bf16 (the fastest step-time what-if: 47.9 ms a step, 0.94x)")
    assert "not parallel.bucket_cap_mb 0.0895" in v["change"] and "1.11x" in v["change"]
    assert "lower parallel.bucket_cap_mb" not in v["change"]
    assert v["rejected"] == {"setting": {"parallel.bucket_cap_mb": 0.0895}, "step_ms": 56.6, "vs_now": 1.112}


def test_no_faster_what_if_says_no_change_helps():
    st = copy.deepcopy(STEP_TIME)
    st["rows"][1].update(step_ms=52.0, vs_now=1.022)
    v = _no_overlap()
    weigh([v], st)
    assert "setting" not in v and v["rejected"]["vs_now"] == 1.112
    assert v["change"].startswith("no change found that helps: the model on this run's rates predicts "
                                  "parallel.bucket_cap_mb 0.0895 at 56.6 ms a step, 1.11x the 50.9 ms")


def test_a_setting_predicted_faster_stays():
    st = copy.deepcopy(STEP_TIME)
    st["rows"][3].update(step_ms=45.0, vs_now=0.884)
    v, before = _no_overlap(), _no_overlap()
    weigh([v], st)
    assert v == before


def test_without_step_time_rows_nothing_changes():
    v, before = _no_overlap(), _no_overlap()
    weigh([v], None)
    weigh([v], {"error": "the planner cannot price this model"})
    assert v == before


def _rank(rank: int, data_pct: float) -> dict:
    return {"rank": rank, "median": {"data_pct": data_pct, "step_ms": 66.5, "comm_pct": 1.0, "overlap_pct": 0.0},
            "collectives": {}, "lateness_ms": {"per_step": 0.0, "max": 0.0}}


def _rep(*ranks) -> dict:
    return {"world": len(ranks), "ranks": list(ranks), "spec": {"num_workers": 0}, "metrics": {"data_pct": 0.7},
            "sections": {}, "clock": {"residual_us": 250.0}}


def test_data_bound_evidence_cites_its_own_rank():
    v = [x for x in judge(_rep(_rank(0, 0.7), _rank(1, 61.3))) if x["kind"] == "data-bound"]
    assert v and v[0]["ranks"] == [1]
    assert v[0]["evidence"] == ["rank 1: data 61.3% of a 66.5 ms step"]  # not rank 0's 0.7% of metrics.jsonl


def test_data_bound_on_rank_0_quotes_its_metrics():
    v = [x for x in judge(_rep(_rank(0, 32.3), _rank(1, 31.0))) if x["kind"] == "data-bound"]
    assert v[0]["evidence"][-1] == "rank 0's metrics.jsonl (data_time_s / step_time_s): 0.7%"
    assert all(e.startswith("rank ") for e in v[0]["evidence"])
