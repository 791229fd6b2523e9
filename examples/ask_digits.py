"""Ask a running `tandem serve` of a digits export about the held-out images, and score the answers.

The course's lab 1 (docs/course/01-basics/lab1-seed-case.md) ends with this: the model trained on
2 simulated nodes x 2 workers, exported, served, and asked over HTTP about images it never trained on.

    tandem serve runs/lab1/2x2/export/step-00000046 --port 0 --run-dir runs/lab1/serve &
    python examples/ask_digits.py runs/lab1/serve runs/lab1/2x2 --n 100 --stop

SERVE_RUN_DIR is the server's --run-dir (its server.json says the URL and pid); TRAIN_RUN_DIR is the
training run (its spec.json rebuilds the same held-out split, normalised as the workers did). The
script waits for /readyz (the replicas load and warm up first), sends the first N held-out images
in one POST /v1/predict, and prints how many the server got right next to the run's own held-out
accuracy. --stop sends the server SIGTERM afterwards (it drains and exits).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("serve_run_dir", type=Path)
    ap.add_argument("train_run_dir", type=Path)
    ap.add_argument("--n", type=int, default=100, help="held-out images to ask about (at most --max-batch 32 a batch)")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the server to be ready")
    ap.add_argument("--stop", action="store_true", help="SIGTERM the server afterwards")
    a = ap.parse_args()

    from tandem.core.config import from_dict
    from tandem.train.data import load_datasets

    spec = from_dict(json.loads((a.train_run_dir / "spec.json").read_text()))
    _, held = load_datasets(spec.data, spec.schedule.seed, spec.model.num_classes, spec.model.in_channels)
    n = min(a.n, len(held))

    # The server writes server.json once it listens, then loads its replicas: wait for both, as a
    # client behind a load balancer would wait for the readiness probe.
    deadline, info = time.monotonic() + a.wait, None
    while time.monotonic() < deadline:
        f = a.serve_run_dir / "server.json"
        if f.is_file():
            info = json.loads(f.read_text())
            if _ready(info["url"]):
                break
        time.sleep(0.2)
    else:
        if a.stop and info:
            os.kill(info["pid"], signal.SIGTERM)
        raise SystemExit(f"error: the server in {a.serve_run_dir} was not ready within {a.wait:g} s")

    try:
        right = _ask(info["url"], held, n)
        acc = json.loads((a.train_run_dir / "result.json").read_text())["accuracy"]
        print(f"asked {info['url']}/v1/predict about {n} held-out images: {right} right ({right / n:.2f}); "
              f"the run's own held-out accuracy {acc:.2f}", flush=True)
    finally:  # stopped even when asking failed: a server left behind would hold its port and a core
        if a.stop:
            os.kill(info["pid"], signal.SIGTERM)


def _ask(url: str, held, n: int) -> int:
    right = 0
    for start in range(0, n, 32):  # the server's default --max-batch is 32 examples a request
        xs = [held[i][0].tolist() for i in range(start, min(start + 32, n))]
        req = urllib.request.Request(f"{url}/v1/predict", data=json.dumps({"inputs": xs}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            outs = json.loads(r.read())["outputs"]
        for k, logits in enumerate(outs):
            right += int(max(range(len(logits)), key=logits.__getitem__) == int(held[start + k][1]))
    return right


if __name__ == "__main__":
    main()
