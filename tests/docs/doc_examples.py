"""Run the examples in README.md and docs/**/*.md (the course too), so that the docs cannot drift from the code.

A ```console block is executed: every ``$ command`` line (with ``\\`` continuations) runs in
bash, in a sandbox folder of its own per document (``examples/`` linked in, so ``runs/...``
lands in the sandbox), the blocks of one document in order (a later block may use what an
earlier one wrote). The lines after a command are its expected output:

* blank lines, ``...`` lines, progress bars (``━``) and table rules are not compared;
* any other line must be found among the command's output lines (each answers one, in any
  order: ranks print in any order): the text with
  every number masked must match, and ``...`` inside a line stands for any text;
* each number must equal the printed one within the block's ``tol`` (relative; default 0,
  i.e. as printed); a number written ``~N`` is an example value and is not compared; one written
  ``N±T`` is compared within T (absolute), whatever the block's ``tol``: a figure that the CPU's
  kernels move (a held-out accuracy after a few epochs), next to exact ones (step counts);
* the exit code is 2 when the expected output has an ``error:`` line, else 0 (``exit=N``
  overrides).

Options follow the language on the fence line: ```console tol=0.05 exit=1. ``group=NAME`` puts
a block in a sequence of its own: the blocks of a group run in document order, as do the blocks
without a group, but the sequences run side by side in the same sandbox (many steps are process
start-ups that leave a core idle). A grouped block may use only what earlier blocks of its own
group wrote, and must not write what another sequence reads. A block that cannot
run here says why on the line above its fence: ``<!-- doc-test: skip (why) -->`` (the marker
tests/plan/test_docs.py reads too). Blocks with a ``tandem plan`` command belong to that test,
which also runs the commands before it that write its inputs, and checks numbers with units.
``` bash blocks are not run, but each of their ``tandem train`` lines must pass ``tandem spec``
(the same spec and overrides).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# a number, alone or before a unit-like "x" (1.12x); "8B" or "rank2" are text
NUM = re.compile(r"(?<![\w.])~?-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:±\d+(?:\.\d+)?)?(?=x\b|[^\w]|$)")
SKIP_LINE = re.compile(r"^\s*(\.\.\.)?\s*$|━|^[┏┡└┃┗╭╰]")


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    opts: dict
    body: list[str]
    skip: str = ""  # the reason of a <!-- doc-test: skip (...) --> marker above the fence

    @property
    def plan_block(self) -> bool:
        return any(ln.startswith("$ tandem plan") for ln in self.body)

    def commands(self) -> list[Command]:
        out: list[Command] = []
        lines = iter(self.body)
        for ln in lines:
            if ln.startswith("$ "):
                text = ln[2:]
                while text.endswith("\\"):
                    text = text[:-1] + " " + next(lines, "").strip()
                out.append(Command(text.strip()))
            elif out:
                out[-1].expected.append(ln)
        return out


SKIP_MARK = re.compile(r"<!-- doc-test: skip \((.+)\) -->")


def blocks(doc: Path) -> list[Block]:
    found, cur, above = [], None, ""
    for i, ln in enumerate(doc.read_text().splitlines(), 1):
        if cur is None and ln.startswith("```"):
            info = ln[3:].strip().split()
            opts = dict(o.split("=", 1) for o in info[1:] if "=" in o)
            m = SKIP_MARK.search(above)
            cur = Block(doc, i, info[0] if info else "", opts, [], m.group(1) if m else "")
        elif cur is not None and ln.startswith("```"):
            found.append(cur)
            cur = None
        elif cur is not None:
            cur.body.append(ln)
        if cur is None and ln.strip():
            above = ln
    return found


def sequences(found: list[Block]) -> list[list[Block]]:
    """The blocks by ``group=`` option, each sequence in document order: the blocks without a
    group first (the document's main thread), then the groups in order of first appearance."""
    out: dict[str, list[Block]] = {"": []}
    for b in found:
        out.setdefault(b.opts.get("group", ""), []).append(b)
    return [seq for seq in out.values() if seq]


def numbers(text: str) -> list[str]:
    return NUM.findall(text)


def mask(text: str) -> str:
    return " ".join(NUM.sub("#", text).split())


def line_matches(expected: str, actual: str, tol: float) -> bool:
    exp, act = mask(expected), mask(actual)
    parts = [p.strip() for p in exp.split("...")]
    pos = 0
    for p in parts:
        if not p:
            continue
        k = act.find(p, pos)
        if k < 0:
            return False
        pos = k + len(p)
    if "..." in expected:  # numbers of the elided parts cannot be paired: the text is the check
        return True
    want, got = numbers(expected), numbers(actual)
    if len(want) != len(got):
        return False
    for w, g in zip(want, got):
        if w.startswith("~"):
            continue
        if "±" in w:
            w, within = w.split("±")
            if abs(float(w) - float(g)) > float(within) + 1e-12:
                return False
            continue
        a, b = float(w), float(g)
        if abs(a - b) > tol * max(abs(a), abs(b)) + 1e-12 and not (tol == 0 and w == g):
            return False
    return True


def check_output(cmd: Command, output: str, tol: float) -> list[str]:
    """The expected lines not found in the output. Each output line answers one expected line;
    order is not required (ranks print in any order)."""
    got = [ln for ln in output.splitlines() if ln.strip()]
    missing, used = [], set()
    for e in cmd.expected:
        if SKIP_LINE.search(e):
            continue
        k = next((j for j in range(len(got)) if j not in used and line_matches(e, got[j], tol)), None)
        if k is None:
            missing.append(e)
        else:
            used.add(k)
    return missing


def expected_exit(cmd: Command, block: Block) -> int:
    if "exit" in block.opts:
        return int(block.opts["exit"])
    return 2 if any(e.lstrip().startswith("error:") for e in cmd.expected) else 0


def train_lines(block: Block) -> list[str]:
    """`tandem train ...` lines of a bash block (continuations joined, comments dropped)."""
    text = "\n".join(block.body).replace("\\\n", " ")
    out = []
    for ln in text.splitlines():
        ln = ln.split(" #", 1)[0].strip()
        if ln.startswith("tandem train "):
            out.append(" ".join(ln.split()))
    return out


def as_spec_check(line: str) -> list[str]:
    """`tandem train CONFIG args` -> `tandem spec CONFIG args` (flags of train only dropped)."""
    args = shlex.split(line)[2:]
    return ["spec"] + [a for a in args if a not in ("--json", "--stream", "--fresh")]
