"""The launch variants the GDN floor benchmark (``gdn_floor.py``) checks and times beside the
rule's launch (issue 45; docs/kernels/gdn_floor.md says what each is aimed at): each names
the switches it changes, the rows (kernels) it times and the shapes it is timed at.

    default      the rule's launches: the six rows of the first floor run
    round        the commit deferred with no commit launch (``GDNPendingRound``): the walk
                 folds the round before from its own buffers; the commit stage is a memset
    stream       the K-streamed verify of trees of one sub-chunk (``VerifyLaunch(stream=1)``):
                 the state read in 32-row pieces, pipelined, never a whole tile in registers
                 (4 warps, block_v 64; stream_bv32: block_v 32), the round folded piece by
                 piece as it streams; the commit at the rule's launch
    bv64/32/16   the value dimension split over 2 / 4 / 8 programs per (sequence, value head)
                 where the rule runs one or two (batch <= 4: 48-192 programs on 132 SMs;
                 at 16-64 sequences of <= 32 nodes the rule's 2-warp programs each hold a
                 whole [128, 128] state tile); bv64_w4 the same at 4 warps, bv32_w2 and
                 bv16_w2 at 2 warps (batch 1: the shortest chain of loads per program); no
                 register cap (the rule's 168 at 16 sequences of 17-32 nodes spills a fold
                 held in registers: gdn_floor_registers.py)
    triton_walk  the Triton walk where the rule takes the CUDA walk (does the CUDA walk's
                 fold cost the deferred pair its gain?)
    fold_*       the standalone fold's launch: V block, state rows per piece, warps

A variant is timed only where it changes the launch, at the nodes it names (the standalone
folds do not depend on the round's nodes); every timed variant is checked on the GPU first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

ALL_N = (1, 2, 4, 8, 16, 32, 64, 128)
PAIRS = ("gdn_verify+commit", "gdn_verify_fold+defer", "gdn_verify_fold+arm")


@dataclass(frozen=True)
class Variant:
    """verify / commit: ``VerifyLaunch`` / ``CommitLaunch`` switches over the rule's; fold /
    defer: ``FoldLaunch`` switches of the standalone folds / the deferred commit.  kernels: the
    rows it times; batches / nodes: where (empty: everywhere); cuda_walk_only: only where the
    rule takes the CUDA walk."""
    name: str
    kernels: tuple
    verify: dict = field(default_factory=dict)
    commit: dict = field(default_factory=dict)
    fold: dict = field(default_factory=dict)
    defer: dict = field(default_factory=dict)
    batches: tuple = ()
    nodes: tuple = ()
    cuda_walk_only: bool = False
    node_rows: dict = field(default_factory=dict)   # kernel -> the nodes it is timed at

    def kernels_at(self, b: int, n: int, cuda_walk: bool) -> tuple:
        """The rows this variant times at shape (b, n) (``cuda_walk``: the rule takes the CUDA
        walk there)."""
        if (self.batches and b not in self.batches) or (self.nodes and n not in self.nodes) \
                or (self.cuda_walk_only and not cuda_walk):
            return ()
        return tuple(k for k in self.kernels if n in self.node_rows.get(k, ALL_N))


SMALL_N = (1, 4, 16, 64)
# the order the benchmark times them in after default and round: most promising first (the
# streamed verify, not measured yet, first: it is aimed at the target shapes themselves)
STREAM_BATCHES, STREAM_N = (1, 4, 16, 64), (1, 4, 16, 32)
VARIANTS = (
    Variant("default", ("gdn_verify+commit", "gdn_verify_fold+defer", "gdn_verify", "gdn_commit",
                        "gdn_defer_commit", "gdn_fold_pending"),
            node_rows={"gdn_fold_pending": (1, 16, 128)}),
    Variant("round", ("gdn_verify_fold+arm", "gdn_fold_round", "gdn_arm"),
            node_rows={"gdn_fold_round": (1,), "gdn_arm": (1,)}),
    Variant("stream", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(stream=1, block_v=64), batches=STREAM_BATCHES, nodes=STREAM_N),
    Variant("stream_bv32", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(stream=1, block_v=32), batches=STREAM_BATCHES, nodes=STREAM_N),
    Variant("bv64_w4", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(block_v=64, num_warps=4, max_registers=0), batches=(16, 64),
            nodes=(1, 4, 16)),
    Variant("bv32", ("gdn_verify+commit", "gdn_verify_fold+arm", "gdn_commit"),
            verify=dict(block_v=32), commit=dict(block_v=32), batches=(1, 4), nodes=SMALL_N,
            node_rows={"gdn_commit": (1,)}),
    Variant("bv16", ("gdn_verify+commit", "gdn_verify_fold+arm"), verify=dict(block_v=16),
            commit=dict(block_v=16), batches=(1, 4), nodes=SMALL_N),
    Variant("bv64", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(block_v=64, max_registers=0), batches=(4, 16, 64), nodes=(1, 4, 16, 32)),
    Variant("triton_walk", ("gdn_verify", "gdn_verify_fold+defer"),
            verify=dict(cuda_walk=0, kside_cuda=0, l2_prefetch=0), cuda_walk_only=True),
    Variant("bv32_w2", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(block_v=32, num_warps=2), commit=dict(block_v=32, num_warps=2),
            batches=(1,), nodes=(1, 4, 16)),
    Variant("bv16_w2", ("gdn_verify+commit", "gdn_verify_fold+arm"),
            verify=dict(block_v=16, num_warps=2), commit=dict(block_v=16, num_warps=2),
            batches=(1,), nodes=(1, 4, 16)),
    Variant("fold_bk32", ("gdn_fold_pending",), fold=dict(block_k=32), nodes=(1,)),
    Variant("fold_bv32", ("gdn_fold_pending",), fold=dict(block_v=32), nodes=(1,)),
    Variant("fold_bv128_bk32", ("gdn_fold_pending",), fold=dict(block_v=128, block_k=32),
            nodes=(1,)),
)


def variants(names: str | None) -> tuple:
    """The variants named (comma-separated; None / "all": every one), in VARIANTS' order."""
    if not names or names == "all":
        return VARIANTS
    want = set(names.split(","))
    unknown = want - {v.name for v in VARIANTS}
    if unknown:
        raise SystemExit(f"error: unknown variant(s) {', '.join(sorted(unknown))}: one of "
                         f"{', '.join(v.name for v in VARIANTS)}")
    return tuple(v for v in VARIANTS if v.name in want)
