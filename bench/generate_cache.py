"""`tandem generate`'s decoding with the model's KV cache against the uncached path, in the same run.

    python bench/generate_cache.py [--tokens 150] [--prompt 16] [--seq 256] [--threads 1] [--repeat 3]

Two models the size issue 28 timed (a GPT of 0.79M parameters and a Llama of 1.05M: 4 layers, hidden 128,
4 heads, 2 kv heads, vocab 256, seq 256), seeded weights. For each, ``tandem.serve.generate.sample``
greedy-decodes ``--tokens`` tokens after a ``--prompt``-token prompt, cached (prefill once, one cached
step per token) and uncached (a whole forward over the text per token), alternating, ``--repeat`` times;
it prints the best time of each, tokens/s, the ratio uncached / cached, and whether the tokens are equal.
"""

from __future__ import annotations

import argparse
import time

import torch

from tandem.models.gpt import GPT, GPTConfig
from tandem.models.llama import Llama, LlamaConfig
from tandem.serve.generate import sample


def models(seq: int) -> dict:
    shape = dict(layers=4, hidden=128, heads=4, kv_heads=2, seq=seq, vocab=256)
    torch.manual_seed(0)
    return {"gpt": GPT(GPTConfig(**shape)).eval(), "llama": Llama(LlamaConfig(**shape)).eval()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.prompt + a.tokens > a.seq:
        print(f"note: prompt + tokens = {a.prompt + a.tokens} > seq {a.seq}: past seq both paths run a whole "
              "forward per token (the window slides)")
    torch.set_num_threads(a.threads)
    ids = torch.randint(0, 256, (a.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{a.tokens} tokens after a {a.prompt}-token prompt, greedy, {a.threads} thread(s), best of {a.repeat}")
    print(f"{'model':<6} {'params':>8} {'uncached s':>11} {'cached s':>9} {'uncached tok/s':>15} "
          f"{'cached tok/s':>13} {'ratio':>6}  same tokens")
    for name, m in models(a.seq).items():
        best = {True: float("inf"), False: float("inf")}
        out = {}
        for _ in range(a.repeat):
            for cache in (False, True):
                t0 = time.perf_counter()
                out[cache] = sample(m, ids, a.tokens, a.seq, 0.0, 0, cache=cache)
                best[cache] = min(best[cache], time.perf_counter() - t0)
        params = sum(p.numel() for p in m.parameters())
        print(f"{name:<6} {params / 1e6:>7.2f}M {best[False]:>11.3f} {best[True]:>9.3f} "
              f"{a.tokens / best[False]:>15.1f} {a.tokens / best[True]:>13.1f} {best[False] / best[True]:>5.1f}x  "
              f"{out[True] == out[False]}")


if __name__ == "__main__":
    main()
