"""Context parallelism: each sequence split over the cp ranks, causal attention by ring.

    ctx_par = apply_cp(model, mesh["cp"], seq)      # parallelize() does this for parallel.cp > 1
    x, y = ctx_par.shard(x), ctx_par.shard(y)       # this rank's tokens (and targets) of every sequence
    with ctx_par.sharded():                         # forward and backward (activation recompute included)
        loss = loss_fn(model(x), y)

Load balancing (torchtitan's and Megatron-core's causal CP): a sequence of T tokens is cut into
2 x cp chunks of T / (2 cp); rank r holds chunks r and 2cp-1-r, one early and one late, so every rank
has the same share of the causal triangle. The model reads its positions from here
(``positions``): RoPE's angles (llama) or the learned position rows (gpt) of the chunks' true
positions, not 0..T/cp-1.

Attention (``RingAttention``): the rank's queries stay; the K/V blocks travel rank to rank
(``batch_isend_irecv``: send to r+1, receive from r-1, cp-1 steps, the next block in flight while the
current one is scored). Each (query chunk, key chunk) pair is skipped when the key chunk lies wholly
in the future, causally masked on the diagonal, full otherwise; the partial outputs merge by their
log-sum-exp (online softmax) in fp32. The backward is the ring again (flash attention's backward per
block pair from the saved output and log-sum-exp; no score matrix is stored): dQ stays, dK/dV
accumulate on a buffer that travels with the K/V block and reaches its owner after cp sends.

The cp ranks hold the same weights and read the same batch: each computes its tokens' summed loss
over the step's full denominator, and the gradients are averaged over dp x cp (DDP, ZeRO-1, FSDP
and the tp bucketed all-reduce on the flattened dp_cp group), so the Stepper scales each rank's
backward by cp (the cp sum is cp x the mean). torch's own
``torch.distributed.tensor.experimental.context_parallel`` is not used: it dispatches CUDA SDPA kernels
only (on CPU, ``aten._scaled_dot_product_flash_attention_for_cpu`` has no CP rule in torch 2.13).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) rank ``rank`` holds: one from the front, its mirror from the back."""
    return rank, 2 * cp - 1 - rank


def shard(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks of ``t`` along ``dim`` (the sequence), concatenated."""
    parts = t.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp, rank)
    return torch.cat([parts[a], parts[b]], dim=dim)


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence back from every rank's ``shard`` (rank order): the inverse of ``shard``."""
    cp = len(parts)
    chunks: list = [None] * (2 * cp)
    for r, t in enumerate(parts):
        a, b = chunk_ids(cp, r)
        chunks[a], chunks[b] = t.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The true positions (int64) of rank ``rank``'s tokens of a ``seq``-token sequence."""
    return shard(torch.arange(seq), cp, rank, dim=0)


class ContextParallel:
    """What the model's attention and positions read while ``active`` (``sharded()``); a plain object, not
    a module, set on the model and each attention module as ``context_parallel``."""

    def __init__(self, group, seq: int):
        self.group, self.seq = group, seq
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)
        self.active = False
        self._pos = positions(seq, self.cp, self.rank)
        self._pos_on: dict = {}
        self.sent_bytes = 0     # K/V (and backward dK/dV) bytes this rank sent around the ring

    def positions(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._pos_on:
            self._pos_on[key] = self._pos.to(device)
        return self._pos_on[key]

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch of sequences (B, T, ...): class labels (1-D) pass unchanged."""
        return shard(t, self.cp, self.rank, dim=1) if t.dim() >= 2 else t

    @contextmanager
    def sharded(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence: q (B, Hq, L, D), k and v
        (B, Hkv, L, D) with L = T / cp local tokens (grouped-query: Hq a multiple of Hkv)."""
        return RingAttention.apply(q, k, v, self)

    def exchange(self, t: torch.Tensor):
        """Send ``t`` to the next rank and receive the previous rank's into a new buffer: (requests, buffer)."""
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        self.sent_bytes += t.numel() * t.element_size()
        return dist.batch_isend_irecv(ops), buf


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _pairs(cp: int, rank: int, source: int):
    """(query chunk i, key chunk j, causal) of the block pairs to score when rank holds the K/V of ``source``:
    a key chunk after the query chunk is skipped (all future), the same chunk is causally masked."""
    mine, theirs = chunk_ids(cp, rank), chunk_ids(cp, source)
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (module docstring); fp32 inside whatever autocast gave."""

    @staticmethod
    def forward(ctx, q, k, v, par: ContextParallel):
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        with torch.autocast(q.device.type, enabled=False):
            qf = q.float().reshape(b, hkv, hq // hkv, n, d)    # query head h reads key/value head h // (hq / hkv)
            qc = qf.chunk(2, dim=3)
            outs = [torch.zeros_like(c) for c in qc]
            lses = [torch.full(c.shape[:-1], float("-inf"), device=q.device) for c in qc]
            kv = torch.stack([k.float(), v.float()])
            for step in range(par.cp):
                reqs, nxt = par.exchange(kv) if step < par.cp - 1 else ([], None)
                kc, vc = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
                for i, j, causal in _pairs(par.cp, par.rank, (par.rank - step) % par.cp):
                    s = _scores(qc[i], kc[j], scale, causal)
                    lse = s.logsumexp(-1)
                    o = torch.einsum("bhgqk,bhkd->bhgqd", (s - lse.unsqueeze(-1)).exp(), vc[j])
                    new = torch.logaddexp(lses[i], lse)   # online softmax: reweight both by their share
                    outs[i] = outs[i] * (lses[i] - new).exp().unsqueeze(-1) + o * (lse - new).exp().unsqueeze(-1)
                    lses[i] = new
                _wait(reqs)
                kv = nxt
            # laid out (B, L, H, D) as SDPA's CPU and flash kernels return it: the caller's transpose to
            # (B, L, H x D) for the output projection is then a view, not a second copy kept for its backward
            out = torch.cat(outs, dim=3).reshape(b, hq, n, d).transpose(1, 2).contiguous().transpose(1, 2)
            lse = torch.cat(lses, dim=3)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.par = par
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        par = ctx.par
        b, hq, n, d = q.shape
        hkv = k.shape[1]
        scale = 1.0 / math.sqrt(d)
        with torch.autocast(q.device.type, enabled=False):
            qc = q.float().reshape(b, hkv, hq // hkv, n, d).chunk(2, dim=3)
            do = dout.float().reshape(b, hkv, hq // hkv, n, d)
            delta = (do * out.reshape(b, hkv, hq // hkv, n, d)).sum(-1)   # rowsum(dO * O): the softmax backward's D
            doc, dc, lc = do.chunk(2, dim=3), delta.chunk(2, dim=3), lse.chunk(2, dim=3)
            dq = [torch.zeros_like(c) for c in qc]
            kv = torch.stack([k.float(), v.float()])
            dkv = torch.zeros_like(kv)                          # the travelling dK/dV of the block held now
            for step in range(par.cp):
                reqs, nxt = par.exchange(kv) if step < par.cp - 1 else ([], None)
                kc, vc = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
                dk, dv = list(dkv[0].chunk(2, dim=2)), list(dkv[1].chunk(2, dim=2))
                for i, j, causal in _pairs(par.cp, par.rank, (par.rank - step) % par.cp):
                    p = (_scores(qc[i], kc[j], scale, causal) - lc[i].unsqueeze(-1)).exp()
                    dv[j] = dv[j] + torch.einsum("bhgqk,bhgqd->bhkd", p, doc[i])
                    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", doc[i], vc[j]) - dc[i].unsqueeze(-1))
                    dq[i] = dq[i] + torch.einsum("bhgqk,bhkd->bhgqd", ds, kc[j]) * scale
                    dk[j] = dk[j] + torch.einsum("bhgqk,bhgqd->bhkd", ds, qc[i]) * scale
                dkv = torch.stack([torch.cat(dk, dim=2), torch.cat(dv, dim=2)])
                # pass the block's gradient on with it; after the last step it goes home to its owner
                dreqs, dnext = par.exchange(dkv)
                _wait(reqs)
                _wait(dreqs)
                kv, dkv = nxt, dnext
            dq = torch.cat(dq, dim=3).reshape(b, hq, n, d)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each block's attention (the decoder's ``layout``: blocks under ``layers``, attention at ``.attn``)."""
    lay = model.layout
    return [getattr(block, "attn") for block in getattr(model, lay.blocks).values()]


def apply_cp(model: nn.Module, group, seq: int) -> ContextParallel:
    """Point the model's positions and every attention at one ``ContextParallel`` over ``group``."""
    par = ContextParallel(group, seq)
    model.context_parallel = par
    for attn in attention_modules(model):
        attn.context_parallel = par
    return par
