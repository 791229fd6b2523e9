"""Mixture of experts for the Llama decoder: token-choice top-k routing with capacity and dropped tokens.

    model.experts = 8, model.top_k = 2          # the spec's keys (docs/models.md); llama's Block takes MoE
    y = moe(x)                                  # (B, T, H) -> (B, T, H); moe.aux: this forward's router loss

Routing (Switch / GShard, Mixtral's renormalised top-k): the router (h -> experts, no bias) scores every
token in fp32; each token picks its ``top_k`` experts by softmax probability, and its output is their
outputs weighted by those probabilities renormalised to sum to 1, plus the ``shared_experts`` (one SwiGLU
of shared_experts x expert_ffn units every token runs, DeepSeek's). An expert takes at most
``capacity = ceil(capacity_factor x tokens x top_k / experts)`` tokens of a micro-batch (tokens counted on
this rank: the per-group capacity of GShard), filled first-choice first, then second choices, each in token
order; an assignment past capacity is dropped (that expert adds nothing to the token; the residual stream
carries it). In evaluation nothing is dropped (capacity = the fullest expert's count), so a held-out score
does not depend on how the batch was split.

The experts' weights are stacked, (experts, h, ffn) and (experts, ffn, h) (``GroupedExperts``), and run as
one batched matmul over a dispatch buffer (experts, capacity, h): under expert parallelism
(tandem/train/parallel/expert.py) those weights are DTensors sharded by expert over the ep ranks, and the
buffer goes to the experts' owners by all-to-all and comes back the same way (under tp, each tp rank
sends its share of the capacity slots and the shares are all-gathered back).

Router losses, added to the training loss per MoE block (tandem/train/loss.py, ``router_loss``):
``router_aux_loss x experts x sum_e f_e P_e`` (Switch's load balance: f_e the fraction of assignments
routed to expert e, P_e its mean router probability; 1 when balanced) and ``router_z_loss x
mean(logsumexp(logits)^2)`` (ST-MoE). Counts per step (``stats``): assignments routed to each expert
(before capacity) and those dropped, the trainer's ``moe_*`` metrics.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.experts import capacity


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _in_backward() -> bool:
    """True while autograd runs a backward (activation checkpointing recomputes a forward there)."""
    return torch._C._current_graph_task_id() != -1


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU MLPs with stacked weights: w2(silu(x w1) * x w3) per expert, one bmm each.
    ``expert_parallel`` (set by the trainer's ep): dispatch and combine by all-to-all to the experts' owners."""

    expert_parallel = None

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.experts = experts
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))   # gate
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn))   # up
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))   # down

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """x (local experts, tokens, h) through this rank's experts (all of them without ep)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)

    def forward(self, buf: torch.Tensor) -> torch.Tensor:
        """buf (experts, capacity, h): each expert's tokens, zero rows where slots are empty."""
        ep = self.expert_parallel
        if ep is None:
            return self.compute(buf)
        return ep.run(self, buf)


class SharedExperts(nn.Module):
    """The always-active experts as one SwiGLU of shared_experts x expert_ffn units (llama's MLP names)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The MoE block's MLP: router, routed experts, shared experts (module docstring)."""

    def __init__(self, c):
        super().__init__()
        ffn = c.expert_ffn or c.ffn
        self.experts_n, self.top_k, self.factor = c.experts, c.top_k, c.capacity_factor
        self.aux_coef, self.z_coef = c.router_aux_loss, c.router_z_loss
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.experts = GroupedExperts(c.experts, c.hidden, ffn)
        self.shared = None
        if c.shared_experts:
            self.shared = SharedExperts(c.hidden, c.shared_experts * ffn)
        self.aux = None            # the router loss of the last training forward (a 0-dim tensor)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.routed = None                                            # assignments per expert, before capacity
        self.dropped = 0                                              # assignments past capacity
        self.assigned = 0                                             # tokens x top_k
        self.aux_sum, self.forwards = 0.0, 0                          # router loss, summed over forwards

    def route(self, logits: torch.Tensor, train: bool):
        """(slot of each kept assignment in the (experts x capacity) buffer, its token, its weight, keep
        mask over all assignments, capacity, assignments per expert) of N tokens' router logits (N, E)."""
        n, e, k = logits.shape[0], self.experts_n, self.top_k
        probs = logits.softmax(-1)
        weight, expert = probs.topk(k, dim=-1)                       # (N, k): best first
        weight = weight / weight.sum(-1, keepdim=True)               # Mixtral: renormalised over the top k
        # slot-major order (all first choices, then all second ...): first choices win the capacity
        flat_e = expert.t().reshape(-1)
        flat_w = weight.t().reshape(-1)
        token = torch.arange(n, device=logits.device).repeat(k)
        onehot = F.one_hot(flat_e, e)
        counts = onehot.sum(0)
        pos = (onehot.cumsum(0) - 1).gather(1, flat_e.unsqueeze(1)).squeeze(1)   # place in its expert's queue
        cap = capacity(n, k, e, self.factor) if train else max(1, int(counts.max()))
        keep = pos < cap
        slot = flat_e * cap + pos
        return slot[keep], token[keep], flat_w[keep], keep, cap, counts, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        xf = x.reshape(-1, h)
        n = xf.shape[0]
        with torch.autocast(x.device.type, enabled=False):   # routing decisions in fp32 whatever autocast runs
            logits = F.linear(xf.float(), self.router.weight.float())
        slot, token, w, keep, cap, counts, probs = self.route(logits, self.training)
        buf = xf.new_zeros(self.experts_n * cap, h).index_copy(0, slot, xf.index_select(0, token))
        out = self.experts(buf.view(self.experts_n, cap, h)).reshape(-1, h)
        picked = out.index_select(0, slot) * w.unsqueeze(1).to(out.dtype)
        y = torch.zeros(n, h, dtype=picked.dtype, device=x.device).index_add(0, token, picked)
        if self.shared is not None:
            y = y + self.shared(xf)
        if self.training:
            aux = logits.new_zeros(())
            if self.aux_coef:   # Switch: E x sum_e (fraction of assignments to e) x (mean probability of e)
                frac = counts.to(probs.dtype) / (n * self.top_k)
                aux = aux + self.aux_coef * self.experts_n * (frac * probs.mean(0)).sum()
            if self.z_coef:
                aux = aux + self.z_coef * logits.logsumexp(-1).pow(2).mean()
            self.aux = aux
            if not _in_backward():   # a recomputed forward (activation checkpointing) is not counted twice
                c = counts.detach().cpu()
                self.routed = c if self.routed is None else self.routed + c
                self.dropped += int((~keep).sum())
                self.assigned += n * self.top_k
                self.aux_sum += float(aux.detach())
                self.forwards += 1
        return y.to(x.dtype).view(b, t, h)


def moe_layers(model: nn.Module) -> list[MoE]:
    inner = getattr(model, "module", model)   # DDP
    return [m for m in inner.modules() if isinstance(m, MoE)]


def router_loss(model: nn.Module):
    """The router losses of the model's last training forward, summed over its MoE blocks (None: dense)."""
    layers = getattr(getattr(model, "module", model), "moe", None)
    if not layers:
        return None
    losses = [m.aux for m in layers if m.aux is not None]
    for m in layers:
        m.aux = None
    return sum(losses) if losses else None


def add_router_loss(loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """loss + aux; tp's loss parallel gives a replicated DTensor loss, so aux (the same on every tp rank, the
    experts being whole there) joins it as one."""
    if hasattr(loss, "device_mesh"):
        from torch.distributed.tensor import DTensor, Replicate
        aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
    return loss + aux


def init_expert(name: str, t: torch.Tensor, g: torch.Generator, layers: int, std: float = 0.02) -> None:
    """N(0, std) per expert, the down projection w2 scaled by 1/sqrt(2 layers) as the dense MLP's."""
    s = std / math.sqrt(2 * layers) if name.endswith(".w2") else std
    nn.init.normal_(t, 0.0, s, generator=g)
