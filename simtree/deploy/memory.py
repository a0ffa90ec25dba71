"""Does a deployment fit its GPUs?  Per rank: the weights of the rank's shape, the persistent
state (KV cache, recurrent state) of the sequences its attention runs at the cache length the
runtime allocates, the verify round's buffers (:mod:`.verify_memory`) and the CUDA context,
against the usable memory of one GPU (its capacity as CUDA reports it x the machine's usable
fraction, the rest a margin for the allocator's fragmentation).

    fit = rank_memory("deepseek-v4-flash", "ep=8", "h200", batch_size=64, context_len=4096)
    fit.fits, fit.total_bytes, fit.usable_bytes
    check_fits("deepseek-v4-flash", "tp=1", "h200", 64, 4096)   # SimtreeError, one line:
    # deepseek-v4-flash does not fit tp=1 on NVIDIA H200 at batch 64: ... it needs 4 GPUs (ep=4), asked for 1

``drafter`` (every check; :func:`.drafter_memory.drafter_use` of the mode's PolicySpec or a
family name): the mode the rank runs.  Its round (verified nodes per sequence, accepted-path
rows) sizes the verify buffers and the cache rows past the context; None, the default, is an
MTP-drafted round of the public block's 8 nodes.  The MTP / EAGLE draft layer is the shape's own
(counted in its weights and caches); a block drafter (block, tfm, dspark) adds its own weights,
caches and round buffers and takes off the MTP layer's cache, which its engine does not allocate
(:mod:`.drafter_memory`).  ``cache_len``: the rows each sequence's caches hold (default the
context plus the round's path rows; the full runtime's timed runs allocate more, its own).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from simtree.parallel import Deployment, parse_deployment
from simtree.machine.machines import Machine, get_machine
from simtree.deploy.drafter_memory import DrafterMemory, DrafterUse, drafter_memory, drafter_use
from simtree.deploy.verify_memory import VerifyRound, verify_round
from simtree.errors import SimtreeError
from simtree.fileio import rewrite_marked_block
from simtree.models import ModelShape, get_model
from simtree.quant import runtime_attn_proj

__all__ = ["RankMemory", "rank_memory", "check_fits", "check_rank_fits", "smallest_fit", "largest_batch", "ep_fit_table", "GPU_COUNTS",
           "FIT_DOC_START", "FIT_DOC_END", "write_fit_doc"]

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)   # the group sizes searched for the smallest deployment that fits


_GB = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731


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
    verify: VerifyRound = VerifyRound(0)                    # the target's verify round
    cache_len: int = 0        # rows each sequence's caches hold

    @property
    def round_peak_bytes(self) -> int:
        """The round's transient peak: the verify's buffers or a block drafter's draft, the larger."""
        return max(self.verify.total_bytes, self.drafter.draft_peak_bytes)

    @property
    def drafter_bytes(self) -> int:
        """What the drafter adds to the total: its held bytes and its draft's peak over the verify's."""
        return self.drafter.held_bytes + self.round_peak_bytes - self.verify.total_bytes

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.cache_bytes + self.drafter.held_bytes + self.round_peak_bytes
                + self.machine.context_bytes)

    def drafter_part(self) -> str:
        """' + X GB of the <family> drafter (...)' for a block drafter, the MTP layer's cache taken off
        for plain decoding, '' for an MTP-drafted mode."""
        d = self.drafter
        if not d.use.block_drafter:
            return (f" - {_GB(d.mtp_state_bytes)} of the MTP layer's cache plain decoding does not allocate"
                    if d.mtp_state_bytes else "")
        mtp = f", less the MTP layer's {_GB(d.mtp_state_bytes)} of cache it does not hold" if d.mtp_state_bytes else ""
        return (f" + {_GB(d.held_bytes)} of the {d.use.family} drafter (block {d.use.block_len}, {d.use.nodes} nodes: "
                f"{_GB(d.weight_bytes)} of weights, {_GB(d.state_bytes)} of caches, {_GB(d.feature_bytes)} of tapped "
                f"features{mtp})")

    def parts(self) -> str:
        """Every counted part, ' + '-joined, and the total: the one line a refusal and a summary say."""
        v, d = self.verify, self.drafter
        peak = (f"{_GB(self.round_peak_bytes)} of the round's peak (the verify of {v.rows} rows: {_GB(v.kept_bytes)} "
                f"kept for the commit, {_GB(v.hidden_bytes)} of hidden rows, {_GB(v.peak_bytes)} of logits / layer "
                f"buffers" + (f"; the {d.use.family} draft's {_GB(d.draft_peak_bytes)} is less)"
                              if d.use.block_drafter and d.draft_peak_bytes <= v.total_bytes else
                              f"; the {d.use.family} draft's {_GB(d.draft_peak_bytes)}, larger, counted)"
                              if d.use.block_drafter else ")"))
        seqs = f"{self.rank_batch} sequence{'s' if self.rank_batch != 1 else ''}"
        return (f"{_GB(self.weight_bytes)} of weights + {_GB(self.cache_bytes)} of KV cache / state ({seqs} x "
                f"{self.cache_len} rows, context {self.context_len}){self.drafter_part()} + {peak} + "
                f"{_GB(self.machine.context_bytes)} of CUDA context = {_GB(self.total_bytes)}")

    @property
    def usable_bytes(self) -> int:
        return self.machine.usable_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    def summary(self) -> str:
        return (f"{self.model} at {self.deployment} on {self.deployment.gpus} x {self.machine.name}: per GPU "
                f"{self.parts()} of {_GB(self.usable_bytes)} usable ({self.machine.describe()})")


def _shape(model: str | ModelShape) -> ModelShape:
    return get_model(model) if isinstance(model, str) else model


def _machine(machine: str | Machine) -> Machine:
    return machine if isinstance(machine, Machine) else get_machine(machine)


def rank_memory(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
                context_len: int, rank_alone: bool = False, drafter=None, cache_len: int | None = None) -> RankMemory:
    """Memory one rank needs for ``batch_size`` sequences of the deployment at ``context_len``
    (a shard that does not divide the model is a one-line SimtreeError); ``rank_alone``: the rank
    run by itself holds all ``batch_size`` sequences (the full runtime's V4 rank, no data-parallel
    split), not its ceil(b / dp) share of the deployment's batch; ``drafter``, ``cache_len``: the
    module docstring's."""
    shape, dep, m = _shape(model), parse_deployment(deployment), _machine(machine)
    rank = shape.shard(dep)
    rb = int(batch_size) if rank_alone else int(dep.rank_batch(int(batch_size)))
    use = drafter if isinstance(drafter, DrafterUse) else drafter_use(drafter)
    rows = int(context_len) + use.path_rows if cache_len is None else int(cache_len)
    if rows < int(context_len):
        raise SimtreeError(f"cache_len {rows}: shorter than the context {context_len}")
    return RankMemory(shape.name, dep, m, int(batch_size), int(context_len), rb, rank.weight_bytes(),
                      rank.cache_bytes(rb, rows), drafter_memory(rank, use, rb, rows),
                      verify_round(rank, rb * use.nodes, plain=use.plain), rows)


def smallest_fit(model: str | ModelShape, machine: str | Machine, batch_size: int, context_len: int,
                 like: Deployment | None = None, drafter=None, cache_len: int | None = None) -> RankMemory | None:
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
                mem = rank_memory(shape, dep, m, batch_size, context_len, drafter=drafter, cache_len=cache_len)
            except SimtreeError:
                continue   # the split does not divide this model: not a deployment of it
            if mem.fits:
                return mem
    return None


def _over(mem: RankMemory) -> str:
    return (f"{_GB(mem.total_bytes - mem.usable_bytes)} more than the {_GB(mem.usable_bytes)} usable "
            f"({mem.machine.describe()})")


def check_fits(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
               context_len: int, drafter=None, cache_len: int | None = None) -> RankMemory:
    """:func:`rank_memory` if it fits, else a one-line SimtreeError naming the shortfall: what
    does not fit, how many GPUs it needs (the smallest deployment that fits) and how many were
    asked for."""
    mem = rank_memory(model, deployment, machine, batch_size, context_len, drafter=drafter, cache_len=cache_len)
    if mem.fits:
        return mem
    best = smallest_fit(model, mem.machine, batch_size, context_len, like=mem.deployment, drafter=drafter,
                        cache_len=cache_len)
    need = (f"it needs {best.deployment.gpus} GPUs ({best.deployment})" if best is not None else
            f"no deployment of up to {GPU_COUNTS[-1]} GPUs fits")
    raise SimtreeError(
        f"{mem.model} does not fit {mem.deployment} on {mem.machine.name} at batch {mem.batch_size}: per GPU it needs "
        f"{mem.parts()}, {_over(mem)}; {need}, asked for {mem.deployment.gpus}")


def check_rank_fits(model: str | ModelShape, deployment, machine: str | Machine, batch_size: int,
                    context_len: int, drafter=None, cache_len: int | None = None) -> RankMemory:
    """One rank of ``deployment`` run alone on one GPU with ``batch_size`` sequences (what the full
    runtime runs: the batch is the rank's, :func:`rank_memory` with ``rank_alone``), or a one-line
    SimtreeError naming the shortfall and the largest batch that fits the rank."""
    mem = rank_memory(model, deployment, machine, batch_size, context_len, rank_alone=True, drafter=drafter,
                      cache_len=cache_len)
    if mem.fits:
        return mem
    most = largest_batch(model, deployment, machine, context_len, limit=int(batch_size), rank_alone=True,
                         drafter=drafter, cache_len=cache_len)
    raise SimtreeError(
        f"one {mem.deployment} rank of {mem.model} run alone does not fit {mem.machine.name} at batch {mem.batch_size}: "
        f"the rank holds all {mem.rank_batch} sequences (not ceil(b / {mem.deployment.dp}) as in the deployment), "
        f"{mem.parts()}, {_over(mem)}; " + (f"at most batch {most} fits" if most else "no batch fits"))


# ---- which expert-parallel degrees fit (docs/deployments.md's table) -----------------------------
FIT_DOC_START, FIT_DOC_END = "<!-- ep-fit:start -->", "<!-- ep-fit:end -->"
_FIT_DOC = dict(model="deepseek-v4-flash", machine="h200", context_lens=(4096, 32768), degrees=(1, 2, 4, 8, 16, 32))


def largest_batch(model: str | ModelShape, deployment, machine: str | Machine, context_len: int,
                  limit: int = 1 << 14, rank_alone: bool = False, drafter=None, cache_len: int | None = None) -> int:
    """The largest batch (up to ``limit``) whose state fits beside the rank's weights; 0 if none
    (``rank_alone``, ``drafter``, ``cache_len``: as :func:`rank_memory`)."""
    fits = lambda b: rank_memory(model, deployment, machine, b, context_len, rank_alone, drafter,  # noqa: E731
                                 cache_len).fits
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
    return (f"{shape.name} on {m.name} ({m.describe()} usable; experts "
            f"{shape.mlp.get('expert_dtype', 'bf16')}, attention linears "
            f"{runtime_attn_proj(shape.v4) if shape.family == 'v4' else 'bf16'}):\n\n" + "\n".join(lines) + "\n")


def write_fit_doc(path: str | Path, write: bool = True) -> bool:
    """Rewrite the table between FIT_DOC_START and FIT_DOC_END in ``path`` from :func:`ep_fit_table`;
    True if it was current already."""
    return rewrite_marked_block(path, FIT_DOC_START, FIT_DOC_END, ep_fit_table(**_FIT_DOC), write)


if __name__ == "__main__":     # python -m simtree.deploy.memory [docs/deployments.md]: rewrite its table
    doc = sys.argv[1] if len(sys.argv) > 1 else "docs/deployments.md"
    print(f"{doc}: {'current' if write_fit_doc(doc) else 'table rewritten'}")
