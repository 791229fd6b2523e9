"""The examples in README.md and docs/**/*.md (the course included) run, and print what the docs say (doc_examples.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from docs.doc_examples import Block, Command, as_spec_check, blocks, check_output, expected_exit, line_matches, \
    sequences, train_lines
from tandem_testing import ROOT, tandem_in_process

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]   # docs/course/** too


def _sandbox(tmp_path: Path) -> Path:
    box = tmp_path / "sandbox"
    box.mkdir()
    for name in ("examples", "bench"):
        (box / name).symlink_to(ROOT / name)
    return box


def _run(cmd: Command, box: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", cmd.text], cwd=box, env=env, capture_output=True, text=True, timeout=900)


def _run_blocks(seq: list[Block], box: Path) -> list[str]:
    """Run one sequence of blocks in order; the problems found."""
    problems = []
    for block in seq:
        tol = float(block.opts.get("tol", 0))
        for cmd in block.commands():
            r = _run(cmd, box)
            where = f"{block.doc.name}:{block.line} $ {cmd.text}"
            want = expected_exit(cmd, block)
            if r.returncode != want:
                problems.append(f"{where}: exit {r.returncode}, the doc implies {want}\n{r.stderr[-1500:]}")
                continue
            missing = check_output(cmd, r.stdout + r.stderr, tol)
            if missing:
                problems.append(f"{where}: not printed (tol {tol}):\n  " + "\n  ".join(missing) +
                                f"\n--- printed:\n{(r.stdout + r.stderr)[-3000:]}")
    return problems


# Sequences run at once (group= in doc_examples.py): on 2 cores a lone sequence keeps about one
# busy (imports, process start-ups, rendezvous waits); three fill both without starving any.
SIDE_BY_SIDE = 3


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_console_examples_run_and_print_what_the_doc_says(doc, tmp_path):
    box = _sandbox(tmp_path)
    runnable = [b for b in blocks(doc) if b.lang == "console" and not b.skip
                and not b.plan_block]  # plan blocks: tests/plan/test_docs.py
    with ThreadPoolExecutor(max_workers=SIDE_BY_SIDE) as pool:
        problems = [p for found in pool.map(lambda seq: _run_blocks(seq, box), sequences(runnable)) for p in found]
    assert not problems, "\n\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_train_lines_in_bash_examples_are_valid_specs(doc, capsys, monkeypatch):
    """The `tandem train ...` lines the docs show (not run: they train) pass `tandem spec`: tandem's
    own main in this process (read-only checks; a process each cost seconds of imports)."""
    problems = []
    for block in blocks(doc):
        if block.lang != "bash":
            continue
        for line in train_lines(block):
            code, _, err = tandem_in_process(as_spec_check(line), capsys, monkeypatch)
            if code != 0:
                problems.append(f"{doc.name}:{block.line} {line}\n  {err.strip()}")
    assert not problems, "\n".join(problems)


def test_every_skipped_block_says_why():
    for doc in DOCS:
        for b in blocks(doc):
            assert "skip" not in b.opts, f"{doc.name}:{b.line}: skip with <!-- doc-test: skip (why) --> above"
            if b.skip:
                assert len(b.skip) >= 5, f"{doc.name}:{b.line}: say why the block cannot run"


def test_the_matcher_can_fail():
    """The doc test's own rules: text with numbers masked, numbers within tol, ~N not compared, N±T within T."""
    assert line_matches("done: 69 steps on 4 workers", "done: 69 steps on 4 workers", 0)
    assert not line_matches("done: 69 steps on 4 workers", "done: 70 steps on 4 workers", 0)
    assert line_matches("acc 0.95", "acc 0.96", 0.05) and not line_matches("acc 0.95", "acc 0.85", 0.05)
    assert line_matches("~211 samples/s", "180 samples/s", 0)
    # N±T: within T whatever the block's tol; the other numbers of the line keep the block's
    assert line_matches("69 steps, accuracy 0.95±0.03", "69 steps, accuracy 0.9238", 0)
    assert not line_matches("69 steps, accuracy 0.95±0.03", "69 steps, accuracy 0.9199", 0.5)
    assert not line_matches("69 steps, accuracy 0.95±0.03", "70 steps, accuracy 0.95", 0)
    assert line_matches("(~1.12x)", "(1.5x)", 0) and not line_matches("(1.12x)", "(1.5x)", 0.1)
    assert not line_matches("size 8B", "size 9B", 1.0)
    assert not line_matches("211 samples/s", "211 tokens/s", 1.0)
    assert line_matches("error: tp: ... (got 3)", "error: tp: tp 3 x pp 1 = 3 does not divide 2 (got 3)", 0)
    cmd = Command("tandem x", ["a 1", "", "...", "b 2"])
    assert check_output(cmd, "a 1\nnoise\nb 2\n", 0) == []
    assert check_output(cmd, "b 2\na 1\n", 0) == []  # any order (ranks print in any order)
    assert check_output(Command("x", ["a 1", "a 1"]), "a 1\n", 0) == ["a 1"]  # one output line answers one
    b = Block(Path("x.md"), 1, "bash", {}, ["tandem train a.toml \\", "  --x.y 1   # comment", "echo hi"])
    assert train_lines(b) == ["tandem train a.toml --x.y 1"]
    assert as_spec_check("tandem train a.toml --json --x.y 1") == ["spec", "a.toml", "--x.y", "1"]
    one, two, three = (Block(Path("x.md"), i, "console", o, []) for i, o in ((1, {}), (2, {"group": "g"}), (3, {})))
    assert sequences([one, two, three]) == [[one, three], [two]]  # the main sequence in order, the group apart


COURSE = ROOT / "docs" / "course"


def test_the_chinese_course_has_the_english_blocks_tested_once():
    """docs/course/zh/X is docs/course/X in Chinese: the same fenced blocks in the same order, each marked
    skip (tested once, on the English page), so that the two cannot drift apart."""
    pages = sorted(p for p in COURSE.rglob("*.md") if "zh" not in p.relative_to(COURSE).parts)
    labs = [p for p in pages if p.parent != COURSE]
    assert labs, "the course has labs"
    for en in labs:
        zh = COURSE / "zh" / en.relative_to(COURSE)
        assert zh.is_file(), f"{en.relative_to(ROOT)} has no Chinese copy at {zh.relative_to(ROOT)}"
        want, got = blocks(en), blocks(zh)
        assert [(b.lang, b.opts, b.body) for b in got] == [(b.lang, b.opts, b.body) for b in want], \
            f"{zh.relative_to(ROOT)}: its blocks differ from {en.relative_to(ROOT)}'s"
        for b in got:
            assert "same block as the English lab" in b.skip, f"{zh.relative_to(ROOT)}:{b.line}: mark it skip"
