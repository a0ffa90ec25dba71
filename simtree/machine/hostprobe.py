"""How fast this host runs, right now, the work a tiny model's decode round is made of.

A closed loop on the runtime's tiny models (``scripts/loop.sh``) measures the host as much as
the accelerator: a round is Python, small torch calls and kernel launches.  When the host
runs slower or faster between the profile and the runs (another tenant, a clock change, a
different lent instance), the plan's error moves with it.  The loop calls this probe right
before each of its steps, so its report can say how fast the host was during each run
against during the profile.

    python -m simtree.machine.hostprobe [--device cpu|cuda] [--step NAME]
        -> one TSV line: step, python_us, torch_us, launch_us

python_us: a fixed pure-Python loop (list and dict work, like a scheduler's bookkeeping);
torch_us: one small CPU torch op (dispatch overhead); launch_us: one tiny CUDA op launched and
the stream synchronised every 50 ops, per op (None without CUDA; "nan" in the TSV line).
Each is the median of ``repeats`` timings; lower is faster.
"""
from __future__ import annotations

import argparse
import math
import time
from statistics import median

__all__ = ["probe", "ratio", "main"]
METRICS = ("python_us", "torch_us", "launch_us")


def _python_work(n: int = 2000) -> int:
    acc, d = 0, {}
    for i in range(n):
        d[i % 97] = d.get(i % 97, 0) + i
        acc += len(str(i)) + (i & 7)
    return acc + len(d)


def probe(device: str = "cpu", repeats: int = 7) -> dict[str, float | None]:
    """{python_us, torch_us, launch_us}: medians of ``repeats`` timings (see module doc)."""
    import torch

    py, tc, la = [], [], []
    x = torch.arange(64, dtype=torch.float32)
    for _ in range(repeats):
        t0 = time.perf_counter()
        _python_work()
        py.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        for _ in range(200):
            x = (x + 1.0).mul_(0.5)
        tc.append((time.perf_counter() - t0) * 1e6 / 200)
    launch = None
    if device == "cuda" and torch.cuda.is_available():
        y = torch.ones(64, device="cuda")
        torch.cuda.synchronize()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(200):
                y = y * 0.5 + 0.5
                if i % 50 == 49:
                    torch.cuda.synchronize()
            la.append((time.perf_counter() - t0) * 1e6 / 200)
        launch = median(la)
    return {"python_us": median(py), "torch_us": median(tc), "launch_us": launch}


def ratio(now: dict, then: dict) -> float:
    """How much slower (> 1) or faster the host runs ``now`` than ``then`` (two ``probe``
    results): the geometric mean of the time ratios over the metrics both measured; nan if
    none."""
    rs = []
    for k in METRICS:
        a, b = now.get(k), then.get(k)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) \
                and math.isfinite(b) and a > 0 and b > 0:
            rs.append(math.log(a / b))
    return math.exp(sum(rs) / len(rs)) if rs else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--step", default="probe", help="name written in the line's first field")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    r = probe(args.device, max(1, args.repeats))
    fields = [f"{r[k]:.3f}" if r[k] is not None else "nan" for k in METRICS]
    print("\t".join([args.step, *fields]), flush=True)


if __name__ == "__main__":
    main()
