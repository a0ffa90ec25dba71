"""The ``collectives`` profile stage: NCCL (gloo on a CPU) all-reduce, all-gather and all-to-all
over groups of 2, 4, 8 ranks and message sizes from 4 KB to 256 MB, one profile-table row per
(collective, group, message size), rank 0 writing.

A sweep entry (the sweep's ``models`` add their layers' message sizes)::

    - stage: collectives
      ops: [all_reduce, all_to_all, all_gather]
      group_sizes: [2, 4, 8]             # those above the GPUs visible are skipped; [1]: a dry run
      message_bytes: {min: 4096, max: 268435456, factor: 4}   # or a list of sizes
      tokens: [1, 16, 64, 256, 1024]     # + each model's T x hidden (all-reduce, all-gather) and
                                         #   T x experts_per_token x hidden (all-to-all) sizes
      repeats: 25                        # timed repetitions per point (median, p10, p90)
      inner: 10                          # calls per repetition (one CUDA graph replay)
      cuda_graph: true                   # capture the calls in a CUDA graph where NCCL allows
      world_size: 4                      # CPU only: gloo processes (default: the largest group)

Rows: stage ``comm_<op>``, model ``collective``, variant ``nccl_graph`` / ``nccl`` / ``gloo``,
deployment ``tp=g`` (all-reduce, all-gather) or ``ep=g`` (all-to-all), ``message_bytes`` S as
:mod:`simtree.costs.comm` defines it (the reduced buffer, the gathered output, each rank's send
buffer); latency of one call: the slowest rank's, per repetition.  ``simtree fit`` fits the
alpha-beta model from them.  Resumable: points in the table are skipped.

Launch: one process per rank (``python -m simtree.profiler.collectives --worker ...``, as
``torchrun`` would start them; a run under torchrun reads RANK / WORLD_SIZE itself), rendezvous
through a file, the point list a JSON file; the sweep starts them and waits.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from simtree.costs.comm import COLLECTIVES, COMM_STAGES
from simtree.errors import SimtreeError
from simtree.models import DTYPE_BYTES, get_model

__all__ = ["COLLECTIVES_STAGE", "check_collectives_entry", "collective_points", "run_collectives_entry", "main"]

COLLECTIVES_STAGE = "collectives"
MODEL_LABEL = "collective"
_ENTRY_KEYS = {"stage", "ops", "group_sizes", "message_bytes", "tokens", "repeats", "inner", "cuda_graph",
               "world_size", "budget_s", "models"}
_DEFAULT_SIZES = {"min": 4096, "max": 268435456, "factor": 4}


def _ints(value, where: str, low: int) -> list[int]:
    if not isinstance(value, list) or not value or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value):
        raise SimtreeError(f"{where} must be a non-empty list of integers >= {low}, got {value!r}")
    return value


def check_collectives_entry(entry: dict, where: str) -> None:
    """Types and ranges of a ``collectives`` sweep entry (one line naming the first problem)."""
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise SimtreeError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_ENTRY_KEYS))})")
    ops = entry.get("ops", list(COLLECTIVES))
    if not isinstance(ops, list) or not ops or any(o not in COLLECTIVES for o in ops):
        raise SimtreeError(f"{where}: ops must list collectives of {', '.join(COLLECTIVES)}, got {ops!r}")
    _ints(entry.get("group_sizes", [2, 4, 8]), f"{where} group_sizes", 1)
    sizes = entry.get("message_bytes", _DEFAULT_SIZES)
    if isinstance(sizes, dict):
        lo, hi, f = (sizes.get(k) for k in ("min", "max", "factor"))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi, f)) or not (1 <= lo <= hi) or f < 2:
            raise SimtreeError(f"{where}: message_bytes needs integers min >= 1, max >= min, factor >= 2; got {sizes!r}")
    else:
        _ints(sizes, f"{where} message_bytes", 1)
    if "tokens" in entry:
        _ints(entry["tokens"], f"{where} tokens", 1)
    for key in ("repeats", "inner", "world_size"):
        if key in entry:
            _ints([entry[key]], f"{where} {key}", 1)
    if "cuda_graph" in entry and not isinstance(entry["cuda_graph"], bool):
        raise SimtreeError(f"{where}: cuda_graph must be true or false")


def _sizes(entry: dict) -> list[int]:
    spec = entry.get("message_bytes", _DEFAULT_SIZES)
    if isinstance(spec, list):
        return sorted(set(int(v) for v in spec))
    out, s = [], int(spec["min"])
    while s <= int(spec["max"]):
        out.append(s)
        s *= int(spec["factor"])
    return out


def collective_points(entry: dict, models: list[str], groups: list[int], elem_bytes: int) -> list[tuple[str, int, int]]:
    """(op, group, message_bytes) of an entry, smallest groups and messages first.  Sizes are
    rounded up to a whole number of elements per rank of the group."""
    base = _sizes(entry)
    per_op = {op: set(base) for op in entry.get("ops", COLLECTIVES)}
    for name in models:
        shape = get_model(name)
        act = DTYPE_BYTES.get(shape.dtype, 2)
        k = int(shape.mlp.get("experts_per_token", 0)) if shape.mlp.get("kind") == "moe" else 0
        for t in entry.get("tokens", []):
            for op in per_op:
                if op == "all_to_all":
                    if k:
                        per_op[op].add(t * k * shape.hidden * act)
                else:
                    per_op[op].add(t * shape.hidden * act)
    out = []
    for g in sorted(groups):
        for op in per_op:
            for s in sorted(per_op[op]):
                unit = g * elem_bytes
                out.append((op, g, int(math.ceil(s / unit) * unit)))
    return list(dict.fromkeys(out))


def _point(key: tuple) -> tuple:
    """A row key without its model and variant: (stage, device, dtype, deployment, message_bytes)."""
    return key[0], key[2], key[3], key[-2], key[-1]


def _deployment(op: str, group: int) -> str:
    return f"ep={group}" if op == "all_to_all" and group > 1 else f"tp={group}"


def run_collectives_entry(entry: dict, table, *, device: str, dtype_name: str, max_s: float,
                          remeasure: bool = False, models: list[str] | None = None, echo=print) -> dict:
    """Time an entry's points not yet in ``table`` (all of them with ``remeasure``) in one
    process per rank; returns {"measured", "skipped", "failed"} counts."""
    import torch

    from simtree.costs import profile_table as pt
    from simtree.machine.metadata import device_label

    cuda = device.startswith("cuda")
    visible = torch.cuda.device_count() if cuda else int(entry.get("world_size", max(entry.get("group_sizes", [2]))))
    wanted = list(entry.get("group_sizes", [2, 4, 8]))
    groups = [g for g in wanted if g <= visible]
    for g in sorted(set(wanted) - set(groups)):
        echo(f"  collectives: group of {g} skipped ({visible} {'GPUs' if cuda else 'processes'} here)")
    if not groups:
        return {"measured": 0, "skipped": 0, "failed": 0}
    dtype = "fp32" if not cuda else dtype_name
    variant = ("nccl_graph" if entry.get("cuda_graph", True) else "nccl") if cuda else "gloo"
    label = device_label(device)
    points = collective_points(entry, models if models is not None else list(entry.get("models", [])), groups,
                               DTYPE_BYTES[dtype])
    rows = [{"stage": COMM_STAGES[op], "model": MODEL_LABEL, "device": label, "dtype": dtype, "variant": variant,
             "batch_size": 1, "nodes_per_seq": 1, "context_len": 0, "tree_shape": "any",
             "deployment": _deployment(op, g), "message_bytes": s} for op, g, s in points]
    if remeasure:
        pt.drop_rows(table, {pt.row_key({**r, "variant": v}) for r in rows for v in ("nccl_graph", "nccl", "gloo")})
    # a point is done whatever its variant (a graph capture NCCL refused is timed eagerly, "nccl")
    done = {_point(k) for k in pt.measured_keys(table)}
    todo = [r for r in rows if _point(pt.row_key(r)) not in done]
    skipped = len(rows) - len(todo)
    if not todo:
        return {"measured": 0, "skipped": skipped, "failed": 0}
    world = max(groups)
    echo(f"  collectives: {len(todo)} points over groups {groups} in {world} processes ({variant})")
    before = len(pt.load_profile(table, allow_empty=True)) if Path(table).exists() else 0
    with tempfile.TemporaryDirectory(prefix="simtree-coll-") as tmp:
        spec = {"table": str(table), "rows": todo, "cuda": cuda, "dtype": dtype, "repeats": int(entry.get("repeats", 25)),
                "inner": int(entry.get("inner", 10)), "cuda_graph": bool(entry.get("cuda_graph", True)),
                "deadline": time.time() + max_s, "rendezvous": str(Path(tmp) / "rendezvous")}
        spec_path = Path(tmp) / "points.json"
        spec_path.write_text(json.dumps(spec))
        procs = [subprocess.Popen([sys.executable, "-m", "simtree.profiler.collectives", "--worker", str(spec_path),
                                   "--rank", str(r), "--world-size", str(world)]) for r in range(world)]
        failed = _wait(procs, max_s + 60)
    after = len(pt.load_profile(table, allow_empty=True)) if Path(table).exists() else 0
    measured = after - before
    if failed:
        echo(f"  collectives: {failed}; {measured} of {len(todo)} points written (rerun to resume)")
    return {"measured": measured, "skipped": skipped, "failed": len(todo) - measured if failed else 0}


def _wait(procs, timeout_s: float) -> str:
    """Wait for every rank; stop the rest when one fails or the time is up. '' when all ended well."""
    end = time.time() + timeout_s
    reason = ""
    while any(p.poll() is None for p in procs):
        bad = [p for p in procs if p.poll() not in (None, 0)]
        if bad or time.time() > end:
            reason = f"rank exited with code {bad[0].returncode}" if bad else "time limit reached"
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    if not reason and any(p.returncode for p in procs):
        reason = f"rank exited with code {next(p.returncode for p in procs if p.returncode)}"
    return reason


# ---- one rank --------------------------------------------------------------------------------------
def _op(dist, op: str, send, recv, group):
    if op == "all_reduce":
        return lambda: dist.all_reduce(send, group=group)
    if op == "all_to_all":
        return lambda: dist.all_to_all_single(recv, send, group=group)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return lambda: gather(recv, send, group=group)


def _time_point(torch, dist, row: dict, group, g: int, rank: int, cfg: dict, device) -> list[float]:
    """Per repetition, microseconds of one call on this rank."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    elem = torch.empty((), dtype=dtype).element_size()
    n = int(row["message_bytes"]) // elem
    op = row["stage"].removeprefix("comm_")
    send_n = n // g if op == "all_gather" else n
    send = torch.randn(send_n, device=device).to(dtype)
    recv = torch.empty(n, dtype=dtype, device=device)
    call = _op(dist, op, send, recv, group)
    inner = cfg["inner"] if cfg["cuda"] else 1
    for _ in range(3):
        call()
    times = []
    if cfg["cuda"]:
        torch.cuda.synchronize(device)
        run = lambda: [call() for _ in range(inner)]  # noqa: E731
        if cfg["cuda_graph"]:
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                call()
            torch.cuda.synchronize(device)
            try:
                with torch.cuda.graph(graph, stream=stream):
                    run()
                run = graph.replay
            except RuntimeError:   # a collective NCCL cannot capture here: timed eagerly
                torch.cuda.synchronize(device)
                row["variant"] = "nccl"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(cfg["repeats"]):
            dist.barrier(group=group, device_ids=[device.index])
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
    else:
        for _ in range(cfg["repeats"]):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def _worker(spec_path: Path, rank: int, world: int) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist

    from simtree.costs.profile_table import append_rows
    from simtree.parallel import parse_deployment

    cfg = json.loads(Path(spec_path).read_text())
    if cfg["cuda"]:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    if "RANK" in os.environ:   # started by torchrun
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"file://{cfg['rendezvous']}", rank=rank, world_size=world)
    groups = {}
    for g in sorted({parse_deployment(r["deployment"]).gpus for r in cfg["rows"]}):
        groups[g] = dist.new_group(list(range(g)))   # every rank creates every group, in one order
    pending, last = [], time.time()
    flag = torch.ones(1, device=device)
    for row in cfg["rows"]:
        flag.fill_(1.0 if time.time() < cfg["deadline"] else 0.0)
        dist.broadcast(flag, 0)
        if flag.item() == 0:
            break
        g = parse_deployment(row["deployment"]).gpus
        if rank < g:
            times = torch.tensor(_time_point(torch, dist, row, groups[g], g, rank, cfg, device), device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=groups[g])   # a call ends when its slowest rank does
            if rank == 0:
                t = times.cpu().numpy()
                pending.append({**row, "latency_us_median": float(np.median(t)),
                                "latency_us_p10": float(np.percentile(t, 10)),
                                "latency_us_p90": float(np.percentile(t, 90)), "repeats": int(len(t))})
        if rank == 0 and pending and (len(pending) >= 20 or time.time() - last > 3):
            append_rows(cfg["table"], pending)
            pending, last = [], time.time()
        dist.barrier()
    if rank == 0 and pending:
        append_rows(cfg["table"], pending)
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    """``python -m simtree.profiler.collectives --worker POINTS.json --rank R --world-size W``
    (started by the sweep; under torchrun, RANK and WORLD_SIZE come from the environment)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simtree.profiler.collectives", description=main.__doc__)
    ap.add_argument("--worker", type=Path, required=True)
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    args = ap.parse_args(argv)
    return _worker(args.worker, args.rank, args.world_size)


if __name__ == "__main__":
    sys.exit(main())
