"""Per-rank log names (launch/logs.py)."""


def test_a_joining_agent_names_its_logs_apart(tmp_path, monkeypatch):
    """torchrun may give a joining node's workers the ranks the first node had (ranks follow
    sorted addresses): on a shared run_dir its files must not truncate the first node's."""
    from tandem.launch.logs import JOINING_ENV, RankLogsSpecs

    envs = {0: {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, 1: {"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0"}}
    first = RankLogsSpecs(tmp_path).reify({k: dict(v) for k, v in envs.items()})
    monkeypatch.setenv(JOINING_ENV, "1")
    joiner = RankLogsSpecs(tmp_path)
    joined = joiner.reify({k: dict(v) for k, v in envs.items()})
    again = joiner.reify({k: dict(v) for k, v in envs.items()})
    names = [set(d.stdouts.values()) | set(d.stderrs.values()) | set(d.error_files.values())
             for d in (first, joined, again)]
    assert names[0] & names[1] == set() and names[1] & names[2] == set() and names[0] & names[2] == set()
    assert first.stdouts[0].endswith("rank-0.log") and ".join-" in joined.stdouts[0]
    assert again.stdouts[1].endswith(".restart1.log")
