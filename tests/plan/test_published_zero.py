"""Model-state memory against Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC20, arXiv:1910.02054), mixed-precision Adam (K = 12: 2 + 2 + 12 = 16 bytes a parameter), GB = 1e9
bytes as the paper counts them (7.5B x 16 = 120 GB). The tables were read from a structured transcription of the
paper in the stored corpus (find_string "52.5 | 41.3", its "Table 1: Per-Device Memory Consumption" and "Table 2:
Maximum Model Size"); the Nd = 64 row of the 7.5B model (31.4 / 16.6 / 1.88 GB) and Table 2's 121.6B at MP 16 on
1024 GPUs agree with a second summary of the paper (bzhng-development/summary-of-some-paper-in-cuda,
docs_backup/training-methods/ZeRO-MemoryOptimizationsTowardTrainingTrillionParameterModel.md).

- Table 1: per-device model-state memory of the 7.5B, 128B and 1T models at data-parallel degree Nd = 1 ... 1024,
  for P_os, P_os+g, P_os+g+p, against the planner's params + grads + optimizer with --zero 1 / 2 / 3 over dp = Nd
  (a bare --params model: no activations, as the table has none). 54 cells.
- Table 2: the largest model whose states fit a 32 GB V100 (theoretical columns: baseline DP, P_os, P_os+g,
  P_os+g+p) at MP = 1 ... 16 and 64-way data parallelism: the planner's states of that model, with tp = MP, must
  be the 32 GB (the table rounds the size to 0.1B: 7.6B is 7.64B). 20 cells. The "measured" columns include the
  residual memory (activations, buffers, fragmentation) of runs whose batch and activation settings are not
  given: not checked.
Issue 14's tolerance: 3% per cell. All 74 pass; the largest, -2.3%, is the table's rounding: Table 1's 0.12 GB
(16 x 7.5B / 1024 = 0.117 GB), Table 2's 0.5T / 1T / 2T (2 x MP x 64 = 512B / 1024B / 2048B).

Not checked: throughput. The paper's V100 numbers (ZeRO-100B: ~38 TFLOPS a GPU for 100B on 400 GPUs, Turing-NLG
17B at 41.4) come with the model shapes of Table 4 but without the batch sizes and model-parallel degrees of
each point (its appendix tables were not found in a readable source), and the rest are read off figures.
Inventing those settings would make the rows a fit, so they are left out. Nor Section 3.2's activations (GPT-2
1.5B, sequence 1K, batch 32: "about 60 GB", ~8 GB checkpointed): its footnote counts a rough 12 x h x b x s x L
elements without the attention scores or dropout masks, which Korthikanti et al.'s per-layer count (the
planner's, test_published_korthikanti.py) includes.
"""

import pytest

from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.inputs.model import params_only
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.memory import memory

GB = 1e9
# Table 1: model -> {Nd: (P_os, P_os+g, P_os+g+p) GB}
TABLE_1 = {
    7.5e9: {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
            256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)},
    128e9: {1: (2048, 2048, 2048), 4: (896, 704, 512), 16: (608, 368, 128), 64: (536, 284, 32),
            256: (518, 263, 8), 1024: (513, 257, 2)},
    1e12: {1: (16000, 16000, 16000), 4: (7000, 5500, 4000), 16: (4750, 2875, 1000), 64: (4187, 2218, 250),
           256: (4046, 2054, 62.5), 1024: (4011, 2013, 15.6)},
}
# Table 2 (theoretical): MP, GPUs -> largest model (parameters) with baseline DP, P_os, P_os+g, P_os+g+p
TABLE_2 = {(1, 64): (2e9, 7.6e9, 14.4e9, 128e9), (2, 128): (4e9, 15.2e9, 28.8e9, 256e9),
           (4, 256): (8e9, 30.4e9, 57.6e9, 0.5e12), (8, 512): (16e9, 60.8e9, 115.2e9, 1e12),
           (16, 1024): (32e9, 121.6e9, 230.4e9, 2e12)}
V100_GB = 32


def states(params: float, zero: int, dp: int, mp: int = 1) -> float:
    """Model-state bytes per GPU the planner computes: params + grads + optimizer."""
    gpus = dp * mp
    c = make_cluster("v100-32gb", min(16, gpus), max(1, gpus // 16))   # DGX-2: 16 V100s a node
    s = Strategy(dp=dp, tp=mp, zero=zero, micro_batch=1)
    m = memory(params_only(params), c, Training(global_batch=dp, precision="fp16", optimizer="adam"), s, 1)
    return m.params + m.grads + m.optimizer


def table1_errors() -> dict[str, float]:
    out = {}
    for psi, rows in TABLE_1.items():
        for nd, cells in rows.items():
            for zero, gb in zip((1, 2, 3), cells):
                out[f"{psi / 1e9:g}B Nd={nd} zero{zero}"] = states(psi, zero, nd) / (gb * GB) - 1
    return out


def table2_errors() -> dict[str, float]:
    out = {}
    for (mp, gpus), sizes in TABLE_2.items():
        for zero, psi in zip((0, 1, 2, 3), sizes):
            out[f"MP={mp} GPUs={gpus} zero{zero} {psi / 1e9:g}B"] = states(psi, zero, gpus // mp, mp) / (V100_GB * GB) - 1
    return out


def SCOREBOARD() -> dict[str, dict[str, float]]:
    return {"zero T1 memory": table1_errors(), "zero T2 max model": table2_errors()}


@pytest.mark.parametrize("table", ["table1", "table2"])
def test_model_states_within_3_percent_per_cell(table):
    errs = table1_errors() if table == "table1" else table2_errors()
    assert len(errs) == (54 if table == "table1" else 20)
    assert max(abs(e) for e in errs.values()) <= 0.03, errs
