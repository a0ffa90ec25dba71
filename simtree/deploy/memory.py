"""Does a deployment fit its GPUs?  Per rank: the weights of the rank's shape plus the persistent
state (KV cache, recurrent state) of the sequences its attention runs, against the usable memory
of one GPU.

    fit = rank_memory("deepseek-v4-flash", "ep=8", "h200", batch_size=64, context_len=4096)
    fit.fits, fit.total_bytes, fit.usable_bytes
    check_fits("deepseek-v4-flash", "tp=1", "h200", 64, 4096)   # SimtreeError, one line:
    # deepseek-v4-flash does not fit tp=1 on NVIDIA H200: ... it needs 8 GPUs (ep=8), asked for 1

``drafter`` (every check; :func:`.drafter_memory.drafter_use` of the mode's PolicySpec or a
family name): the drafter the mode runs.  None, the default, is the MTP / EAGLE draft layer the
shape holds (counted in its weights and caches, as always); a block drafter (block, tfm, dspark)
adds its own weights, caches and round buffers and takes off the MTP layer's cache, which its
engine does not allocate (:mod:`.drafter_memory`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from simtree.parallel import Deployment, parse_deployment
from simtree.machine.machines import Machine, get_machine
from simtree.deploy.drafter_memory import DrafterMemory, DrafterUse, drafter_memory
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.models import ModelShape, get_model

__all__ = ["RankMemory", "rank_memory", "check_fits", "check_rank_fits", "smallest_fit", "largest_batch", "ep_fit_table", "GPU_COUNTS",
           "FIT_DOC_START", "FIT_DOC_END", "write_fit_doc"]

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)   # the group sizes searched for the smallest deployment that fits


@dataclass(frozen=True)
class RankMemory:
    model: str
    deployment: Deployment
    machine: Machine
    batch_size: int           # the deployment's batch
    context_len: int
    rank_batch: int           # sequences one rank holds state for
    weight_bytes: int
    cache_bytes: int
    drafter: DrafterMemory = DrafterMemory(DrafterUse())    # a block drafter's share (0 for the MTP layer)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.drafter.total_bytes

    def drafter_part(self) -> str:
        """' + X GB of the <family> drafter (...)' for a block drafter, '' for the MTP layer."""
        d = self.drafter
        if not d.use.block_drafter:
            return ""
        gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
        mtp = f", less the MTP layer's {gb(d.mtp_state_bytes)} of cache it does not hold" if d.mtp_state_bytes else ""
        return (f" + {gb(d.total_bytes)} of the {d.use.family} drafter (block {d.use.block_len}, {d.use.nodes} nodes: "
                f"{gb(d.weight_bytes)} of weights, {gb(d.state_bytes)} of caches, {gb(d.round_bytes)} of round "
                f"buffers{mtp})")

    @property
    def usable_bytes(self) -> int:
        return self.machine.usable_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def summary(self) -> str:
        gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
        return (f"{self.model} at {self.deployment} on {self.deployment.gpus} x {self.machine.name}: per GPU "
                f"{gb(self.weight_bytes)} of weights + {gb(self.cache_bytes)} of KV cache / state"
                f"{self.drafter_part()} ({self.rank_batch} sequences at context {self.context_len}) = {gb(self.total_bytes)} of "
                f"{gb(self.usable_bytes)} usable ({self.machine.memory_gb:g} GB x {self.machine.usable_fraction:g})")


def _shape(model: str | ModelShape) -> ModelShape:
    return get_model(model) if isinstance(model, str) else model


def _machine(machine: str | Machine) -> Machine:
    return machine if isinstance(machine, Machine) else get_machine(machine)


def rank_memory(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
                context_len: int, rank_alone: bool = False, drafter=None) -> RankMemory:
    """Memory one rank needs for ``batch_size`` sequences of the deployment at ``context_len``
    (a shard that does not divide the model is a one-line SimtreeError); ``rank_alone``: the rank
    run by itself holds all ``batch_size`` sequences (the full runtime's V4 rank, no data-parallel
    split), not its ceil(b / dp) share of the deployment's batch; ``drafter``: the module
    docstring's."""
    shape, dep, m = _shape(model), parse_deployment(deployment), _machine(machine)
    rank = shape.shard(dep)
    rb = int(batch_size) if rank_alone else int(dep.rank_batch(int(batch_size)))
    return RankMemory(shape.name, dep, m, int(batch_size), int(context_len), rb, rank.weight_bytes(),
                      rank.cache_bytes(rb, context_len), drafter_memory(rank, drafter, rb, int(context_len)))


def smallest_fit(model: str | ModelShape, machine: str | Machine, batch_size: int, context_len: int,
                 like: Deployment | None = None, drafter=None) -> RankMemory | None:
    """The deployment with the fewest GPUs (of :data:`GPU_COUNTS`, at most the machine's node
    when ``like`` has no more) that fits: of ``like``'s kind first (its tp under expert
    parallelism), then expert parallelism for an MoE model, then tensor parallelism; None if
    none fits."""
    shape, m = _shape(model), _machine(machine)
    moe = shape.mlp.get("kind") == "moe"
    for g in GPU_COUNTS:
        kinds = []
        if like is not None and like.ep > 1 and g % like.tp == 0 and g >= like.tp:
            kinds.append(Deployment(tp=like.tp, ep=g) if g > 1 else Deployment())
        kinds += ([Deployment(ep=g)] if moe and g > 1 else []) + [Deployment(tp=g)]
        for dep in kinds:
            try:
                mem = rank_memory(shape, dep, m, batch_size, context_len, drafter=drafter)
            except SimtreeError:
                continue   # the split does not divide this model: not a deployment of it
            if mem.fits:
                return mem
    return None


def check_fits(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
               context_len: int, drafter=None) -> RankMemory:
    """:func:`rank_memory` if it fits, else a one-line SimtreeError naming the shortfall: what
    does not fit, how many GPUs it needs (the smallest deployment that fits) and how many were
    asked for."""
    mem = rank_memory(model, deployment, machine, batch_size, context_len, drafter=drafter)
    if mem.fits:
        return mem
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    best = smallest_fit(model, mem.machine, batch_size, context_len, like=mem.deployment, drafter=drafter)
    need = (f"it needs {best.deployment.gpus} GPUs ({best.deployment})" if best is not None else
            f"no deployment of up to {GPU_COUNTS[-1]} GPUs fits")
    raise SimtreeError(
        f"{mem.model} does not fit {mem.deployment} on {mem.machine.name}: per GPU it needs {gb(mem.weight_bytes)} "
        f"of weights + {gb(mem.cache_bytes)} of KV cache / state{mem.drafter_part()} (batch {mem.batch_size}, context "
        f"{mem.context_len}) = {gb(mem.total_bytes)}, {gb(mem.total_bytes - mem.usable_bytes)} more than the "
        f"{gb(mem.usable_bytes)} usable of {mem.machine.memory_gb:g} GB; {need}, asked for {mem.deployment.gpus}")


def check_rank_fits(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
                    context_len: int, drafter=None) -> RankMemory:
    """One rank of ``deployment`` run alone on one GPU with ``batch_size`` sequences (what the full
    runtime runs: the batch is the rank's, :func:`rank_memory` with ``rank_alone``), or a one-line
    SimtreeError naming the shortfall and the largest batch that fits the rank."""
    mem = rank_memory(model, deployment, machine, batch_size, context_len, rank_alone=True, drafter=drafter)
    if mem.fits:
        return mem
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    most = largest_batch(model, deployment, machine, context_len, limit=int(batch_size), rank_alone=True,
                         drafter=drafter)
    raise SimtreeError(
        f"one {mem.deployment} rank of {mem.model} run alone does not fit {mem.machine.name} at batch {mem.batch_size}: "
        f"the rank holds all {mem.rank_batch} sequences (not ceil(b / {mem.deployment.dp}) as in the deployment), "
        f"{gb(mem.weight_bytes)} of weights + {gb(mem.cache_bytes)} of KV cache / state{mem.drafter_part()} at context "
        f"{mem.context_len} "
        f"= {gb(mem.total_bytes)}, {gb(mem.total_bytes - mem.usable_bytes)} more than the {gb(mem.usable_bytes)} usable "
        f"of {mem.machine.memory_gb:g} GB; " + (f"at most batch {most} fits" if most else "no batch fits"))


# ---- which expert-parallel degrees fit (docs/deployments.md's table) -----------------------------
FIT_DOC_START, FIT_DOC_END = "<!-- ep-fit:start -->", "<!-- ep-fit:end -->"
_FIT_DOC = dict(model="deepseek-v4-flash", machine="h200", context_lens=(4096, 32768), degrees=(1, 2, 4, 8, 16, 32))


def largest_batch(model: str | ModelShape, deployment, machine: str | Machine, context_len: int,
                  limit: int = 1 << 14, rank_alone: bool = False, drafter=None) -> int:
    """The largest batch (up to ``limit``) whose state fits beside the rank's weights; 0 if none
    (``rank_alone``, ``drafter``: as :func:`rank_memory`)."""
    fits = lambda b: rank_memory(model, deployment, machine, b, context_len, rank_alone, drafter).fits  # noqa: E731
    if not fits(1):
        return 0
    lo, hi = 1, int(limit)
    while lo < hi:                      # the rank's bytes grow with the batch: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def ep_fit_table(model: str | ModelShape, machine: str | Machine, context_lens=(4096, 32768),
                 degrees=(1, 2, 4, 8, 16, 32)) -> str:
    """Markdown: per expert-parallel degree, one rank's weights (at the shape's expert format and,
    for comparison, with bf16 experts) and the largest batch that fits at each context."""
    shape, m = _shape(model), _machine(machine)
    bf16 = replace(shape, mlp={**shape.mlp, "expert_dtype": "bf16"})
    gb = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    head = ("| deployment | weights per GPU, GB | with bf16 experts, GB | "
            + " | ".join(f"largest batch at context {c}" for c in context_lens) + " |")
    lines = [head, "|" + "---|" * (3 + len(context_lens))]
    for e in degrees:
        dep = Deployment(ep=e) if e > 1 else Deployment()
        try:
            w = shape.shard(dep).weight_bytes()
        except SimtreeError:
            continue                    # the split does not divide the model
        fits = [largest_batch(shape, dep, m, c) for c in context_lens]
        cells = ["does not fit" if not b else f"{b}+" if b == 1 << 14 else str(b) for b in fits]
        lines.append(f"| {dep} | {gb(w)} | {gb(bf16.shard(dep).weight_bytes())} | " + " | ".join(cells) + " |")
    return (f"{shape.name} on {m.name} ({m.memory_gb:g} GB, {m.usable_fraction:g} usable; experts "
            f"{shape.mlp.get('expert_dtype', 'bf16')}):\n\n" + "\n".join(lines) + "\n")


def write_fit_doc(path: str | Path, write: bool = True) -> bool:
    """Rewrite the table between FIT_DOC_START and FIT_DOC_END in ``path`` from :func:`ep_fit_table`;
    True if it was current already."""
    path = Path(path)
    text = path.read_text()
    if FIT_DOC_START not in text or FIT_DOC_END not in text:
        raise SimtreeError(f"{path}: no {FIT_DOC_START} ... {FIT_DOC_END} block")
    head, rest = text.split(FIT_DOC_START + "\n", 1)
    old, tail = rest.split(FIT_DOC_END, 1)
    new = ep_fit_table(**_FIT_DOC)
    if write and old != new:
        write_text_atomic(path, head + FIT_DOC_START + "\n" + new + FIT_DOC_END + tail)
    return old == new


if __name__ == "__main__":     # python -m simtree.deploy.memory [docs/deployments.md]: rewrite its table
    doc = sys.argv[1] if len(sys.argv) > 1 else "docs/deployments.md"
    print(f"{doc}: {'current' if write_fit_doc(doc) else 'table rewritten'}")
