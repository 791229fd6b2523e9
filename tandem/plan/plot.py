"""`--plot FILE.png`: step time (compute / exposed comm / bubble) and memory per GPU against capacity."""

from __future__ import annotations

from tandem.core.errors import ConfigError


def plot_plans(plans, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("matplotlib is not installed", field="plot", value=path,
                          fix="pip install 'tandem[plot]'") from None
    if not str(path).endswith(".png"):
        raise ConfigError("expected a .png path", field="plot", value=path, fix="give --plot FILE.png")
    labels = [p.strategy.label().replace(" ", "\n") for p in plans]
    x = range(len(plans))
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(plans) + 4), 4.5))
    comp = [p.compute_s for p in plans]
    comm = [p.exposed_comm_s for p in plans]
    bub = [p.bubble_s for p in plans]
    a.bar(x, comp, label="compute")
    a.bar(x, comm, bottom=comp, label="exposed comm")
    a.bar(x, bub, bottom=[c + m for c, m in zip(comp, comm)], label="bubble")
    a.set_xticks(list(x), labels, fontsize=7)
    a.set_ylabel("seconds per step")
    a.set_title("step time")
    a.legend(fontsize=8)
    gib = 1024**3
    parts = ("params", "grads", "optimizer", "activations", "other")
    bottom = [0.0] * len(plans)
    for part in parts:
        vals = [getattr(p.memory, part) / gib for p in plans]
        b.bar(x, vals, bottom=bottom, label=part)
        bottom = [u + v for u, v in zip(bottom, vals)]
    cap = plans[0].memory.capacity / gib
    b.axhline(cap, color="black", linestyle="--", label=f"capacity {cap:.0f} GiB")
    b.set_xticks(list(x), labels, fontsize=7)
    b.set_ylabel("GiB per GPU")
    b.set_title("memory per GPU")
    b.legend(fontsize=8)
    fig.suptitle(f"{plans[0].model.name} on {plans[0].cluster.world} x {plans[0].cluster.gpu.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
