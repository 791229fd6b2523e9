"""explain[] clauses for single terms whose bytes or rates a sentence of explain.py would otherwise print without
their arithmetic: the parameter all-gathers' bytes per parameter (config.Training.gather_bytes)."""

from __future__ import annotations

from tandem.plan.cost import Plan

GATHERS = ("dp-params", "fsdp-params", "ep-params")


def gather_note(p: Plan, o) -> str:
    """' (N parameters x B B: why)' for a ZeRO/FSDP parameter all-gather: the parameters gathered (the stage's,
    per tp rank; an MoE model's experts for ep-params) times the bytes each moves; '' for other operations."""
    if o.name not in GATHERS:
        return ""
    from tandem.plan import cost
    from tandem.plan import moe_cp as MC
    from tandem.plan import stages as ST
    from tandem.plan.explain import si

    m, s, t = p.model, p.strategy, p.training
    if o.name == "ep-params":
        psi = MC.stage_states(m.moe, ST.split(m.gpt, s.pp, s.stage_layers, ST.chunks_of(s)), s.tp, s.ep)[1]
    else:
        psi = cost.stage_psi(m, s)
    pb = t.gather_bytes
    if t.autocast:
        why = (": fp32, the weights as stored: tandem's trainer keeps them in fp32 under autocast and its FSDP2 "
               "has no MixedPrecisionPolicy")
    else:
        why = f": the {'bf16' if t.precision == 'fp8' else t.precision} working weights" if pb != 4 else ""
    return f" ({si(psi, '')} parameters x {pb} B{why})"


def attn_seq(p) -> tuple[float, int]:
    """(sequence, head dim) one attention call runs on, for the attention kernel's arithmetic; (0, 128) where
    there is no single sequence (no transformer shape, or ring attention, whose blocks explain_layout prices)."""
    g = p.model.gpt
    if g is None or p.strategy.cp > 1:
        return 0.0, 128
    return float(g.seq), g.hidden // g.heads
