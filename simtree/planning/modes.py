"""Speculation modes and their parameters: one frozen dataclass per mode, validated on
construction.  A :class:`PolicySpec` is what the simulator, the planner and the runtime take.

    NoneParams()                                        plain decoding, nothing drafted
    LinearParams(budget)                                a chain of D = budget nodes (root included)
    EagleParams(num_steps, topk, budget)                s steps of top-k, pruned to the best D nodes
    BestFirstParams(budget, draft_depth, width=1)       best-first tree over draft_depth positions
    CostAwareParams(max_budget, draft_depth)            per-round budget: grow while throughput rises
    BatchAllocParams(max_budget_per_seq, draft_depth)   nodes allocated across the batch's requests
    BlockParams(budget, block_len)                      best-first tree from a block drafter's marginals
    TfmParams(budget, width, block_len)                 best-first tree over a TfM adapter's conditionals
    DSparkParams(block_len, threshold=None)             DSpark chain, its confident prefix verified

In the policy file (:mod:`simtree.planning.policy_file`) a policy is ``"mode"`` plus a
``"params"`` object with these field names (:meth:`PolicySpec.from_dict` /
:meth:`PolicySpec.to_dict`); ``draft_depth`` (positions of top-K marginals the drafter
produces) may be left out there and defaults to min(3, budget - 1), ``width`` to 1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Mapping

from simtree.acceptance.mixture import MARGINAL_MODES   # drafted as draft_depth positions
from simtree.errors import SimtreeError, check_whole
from simtree.trees.builders import eagle_max_nodes

__all__ = ["MODES", "RUNTIME_MODES", "TREE_MODES", "MARGINAL_MODES", "ADAPTIVE_MODES", "BLOCK_DRAFTER_MODES",
           "MAX_BATCH_SIZE", "DEFAULT_DRAFT_DEPTH", "PolicySpec", "NoneParams", "LinearParams", "EagleParams",
           "BestFirstParams", "CostAwareParams", "BatchAllocParams", "BlockParams", "TfmParams", "DSparkParams",
           "default_draft_depth", "check_batch_size", "params_from_flags"]

MODES = ("none", "linear", "eagle", "best_first", "cost_aware", "batch_alloc", "block", "tfm", "dspark")
TREE_MODES = ("eagle", "best_first", "cost_aware", "batch_alloc", "block", "tfm")   # the rest verify a chain
BLOCK_DRAFTER_MODES = ("block", "tfm", "dspark")   # drafted by a block drafter (simtree.drafters), not the MTP layer
ADAPTIVE_MODES = ("cost_aware", "batch_alloc")                       # a budget decided every round
# the modes `simtree run` builds, the full-scale runtime on the device included (runtime/full/drafting.py):
# every mode a plan may name (tests/test_capture_safe.py runs a round of each)
RUNTIME_MODES = MODES
DEFAULT_DRAFT_DEPTH = 3  # the public V4 MTP recipe drafts 3 steps
# Largest batch size simulated or planned: far beyond any serving batch, small enough that token
# counts stay exact in float64 / int64 arithmetic.
MAX_BATCH_SIZE = 1_000_000


def check_batch_size(batch_size, what: str = "batch size") -> int:
    """``batch_size`` as an int in [1, MAX_BATCH_SIZE]; a one-line SimtreeError otherwise."""
    return check_whole(batch_size, what, 1, MAX_BATCH_SIZE)


def default_draft_depth(budget: int) -> int:
    """Drafted positions of a marginal mode whose policy names none: DEFAULT_DRAFT_DEPTH, at
    most budget - 1 (a tree of D nodes is at most D - 1 deep), at least 1."""
    return max(1, min(DEFAULT_DRAFT_DEPTH, budget - 1))


@dataclass(frozen=True)
class PolicySpec:
    """One speculation policy: a mode (the subclass) and its parameters (its fields, each a
    count >= 1).  Build one with a subclass, or from the policy file's form with
    :meth:`from_dict`."""

    mode: ClassVar[str]

    def __post_init__(self) -> None:
        if type(self) is PolicySpec:
            raise SimtreeError("PolicySpec is abstract: use NoneParams, LinearParams, EagleParams, ...")
        for f in dataclasses.fields(self):   # every parameter is a count >= 1 (but a confidence threshold)
            if f.name == "threshold":
                continue
            value = check_whole(getattr(self, f.name), f"parameter {f.name} of mode {self.mode!r}", 1)
            object.__setattr__(self, f.name, value)

    @property
    def name(self) -> str:
        """The policy's name in candidates.csv and reports, e.g. ``eagle_s4_k2_d5``."""
        raise NotImplementedError

    @property
    def fixed_budget(self) -> int | None:
        """Verify budget of every round (nodes per sequence, root included); None for the
        adaptive modes, whose budget changes by round."""
        raise NotImplementedError

    @property
    def max_nodes(self) -> int:
        """The most nodes a sequence's tree can have in one round (root included)."""
        raise NotImplementedError

    @property
    def tree_on(self) -> bool:
        """True for the modes that verify a tree (not a chain or nothing)."""
        return self.mode in TREE_MODES

    def draft_shape(self) -> tuple[int, int]:
        """(num_steps, topk) fed to the draft cost model; (0, 0) = nothing drafted."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """The ``params`` object of the policy file (keys sorted)."""
        return dict(sorted(dataclasses.asdict(self).items()))

    @staticmethod
    def from_dict(mode: str, params: Mapping | None = None) -> "PolicySpec":
        """The policy of ``mode`` from its ``params`` object (the policy file's form): a
        one-line SimtreeError for an unknown mode, a missing or unknown parameter, or a value
        that is not a count >= 1.  Marginal modes without ``draft_depth`` get
        :func:`default_draft_depth`."""
        if mode not in _BY_MODE:
            raise SimtreeError(f"unknown policy mode {mode!r}: use one of {', '.join(MODES)}")
        params = {} if params is None else params
        if not isinstance(params, Mapping):
            raise SimtreeError(f"params of mode {mode!r} must be an object, got {type(params).__name__}")
        cls = _BY_MODE[mode]
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        unknown = [k for k in params if k not in names]
        if unknown:
            raise SimtreeError(f"mode {mode!r} has no parameter {unknown[0]!r} (its parameters: "
                               f"{', '.join(names) or 'none'})")
        given = dict(params)
        size = names[0] if names else None   # budget, max_budget or max_budget_per_seq
        if "draft_depth" in names and "draft_depth" not in given and size in given:
            given["draft_depth"] = default_draft_depth(check_whole(given[size], f"parameter {size} of mode "
                                                                                f"{mode!r}", 1))
        for f in fields:
            if f.name not in given and f.default is dataclasses.MISSING:
                raise SimtreeError(f"mode {mode!r} needs the parameter {f.name!r}")
        return cls(**given)


class _Budgeted:
    """Modes that verify the same ``budget`` nodes every round."""

    @property
    def fixed_budget(self) -> int:
        return self.budget

    @property
    def max_nodes(self) -> int:
        return self.budget


@dataclass(frozen=True)
class NoneParams(PolicySpec):
    """Plain decoding: the root alone, nothing drafted."""

    mode: ClassVar[str] = "none"

    @property
    def name(self) -> str:
        return "none"

    @property
    def fixed_budget(self) -> int:
        return 1

    @property
    def max_nodes(self) -> int:
        return 1

    def draft_shape(self) -> tuple[int, int]:
        return 0, 0


@dataclass(frozen=True)
class LinearParams(_Budgeted, PolicySpec):
    """A chain of ``budget`` nodes (root included): budget - 1 drafted tokens, top-1."""

    mode: ClassVar[str] = "linear"
    budget: int

    @property
    def name(self) -> str:
        return f"linear_d{self.budget}"

    def draft_shape(self) -> tuple[int, int]:
        return self.budget - 1, 1


@dataclass(frozen=True)
class EagleParams(_Budgeted, PolicySpec):
    """EAGLE-style: ``num_steps`` draft steps of top-``topk``, expanded by cumulative draft
    score and pruned to the best ``budget`` nodes (root included)."""

    mode: ClassVar[str] = "eagle"
    num_steps: int
    topk: int
    budget: int

    def __post_init__(self) -> None:
        super().__post_init__()
        most = eagle_max_nodes(self.num_steps, self.topk)
        if self.budget > most:
            raise SimtreeError(f"eagle budget {self.budget} exceeds the {most} nodes that {self.num_steps} "
                               f"steps of top-{self.topk} generate")

    @property
    def name(self) -> str:
        return f"eagle_s{self.num_steps}_k{self.topk}_d{self.budget}"

    def draft_shape(self) -> tuple[int, int]:
        return self.num_steps, self.topk


@dataclass(frozen=True)
class BestFirstParams(_Budgeted, PolicySpec):
    """Best-first (DDTree) over the drafter's top-K marginals at ``draft_depth`` positions,
    ``budget`` nodes (root included), popping ``width`` nodes of the heap per step."""

    mode: ClassVar[str] = "best_first"
    budget: int
    draft_depth: int
    width: int = 1

    @property
    def name(self) -> str:
        return f"best_first_d{self.budget}_w{self.width}_p{self.draft_depth}"

    def draft_shape(self) -> tuple[int, int]:
        return self.draft_depth, 1


class _Adaptive:
    """Modes whose budget is decided every round (ADAPTIVE_MODES), up to ``max_nodes`` a sequence
    (the field ``max_field``, named in the policy file as each mode's rule reads it), over the
    drafter's marginals at ``draft_depth`` positions."""

    max_field: ClassVar[str]

    @property
    def name(self) -> str:
        return f"{self.mode}_max{self.max_nodes}_p{self.draft_depth}"

    @property
    def fixed_budget(self) -> None:
        return None

    @property
    def max_nodes(self) -> int:
        return getattr(self, self.max_field)

    def draft_shape(self) -> tuple[int, int]:
        return self.draft_depth, 1


@dataclass(frozen=True)
class CostAwareParams(_Adaptive, PolicySpec):
    """Cost-aware stop (CaDDTree): each round, grow best-first while predicted throughput
    rises, up to ``max_budget`` nodes; marginals at ``draft_depth`` positions."""

    mode: ClassVar[str] = "cost_aware"
    max_field: ClassVar[str] = "max_budget"
    max_budget: int
    draft_depth: int


@dataclass(frozen=True)
class BatchAllocParams(_Adaptive, PolicySpec):
    """Batch-level allocation (DSpark-style): each round, the batch's candidate nodes by
    survival probability while throughput rises, up to ``max_budget_per_seq`` per sequence;
    marginals at ``draft_depth`` positions."""

    mode: ClassVar[str] = "batch_alloc"
    max_field: ClassVar[str] = "max_budget_per_seq"
    max_budget_per_seq: int
    draft_depth: int


@dataclass(frozen=True)
class BlockParams(_Budgeted, PolicySpec):
    """A block drafter (DFlash-style): one forward proposes ``block_len`` positions as independent
    marginals; the best-first tree of ``budget`` nodes (root included) over their top-K."""

    mode: ClassVar[str] = "block"
    budget: int
    block_len: int = 7

    @property
    def name(self) -> str:
        return f"block_d{self.budget}_p{self.block_len}"

    def draft_shape(self) -> tuple[int, int]:
        return self.block_len, 1


@dataclass(frozen=True)
class TfmParams(_Budgeted, PolicySpec):
    """The block drafter plus a TfM-style adapter over each position's top candidates: the
    best-first tree of ``budget`` nodes over its conditionals, ``width`` expansions a step."""

    mode: ClassVar[str] = "tfm"
    budget: int
    width: int = 1
    block_len: int = 7

    @property
    def name(self) -> str:
        return f"tfm_d{self.budget}_w{self.width}_p{self.block_len}"

    def draft_shape(self) -> tuple[int, int]:
        return self.block_len, self.width


@dataclass(frozen=True)
class DSparkParams(PolicySpec):
    """DSpark-style: a chain of ``block_len`` tokens from the block backbone and its Markov
    head; each sequence verifies the prefix whose predicted survival (the confidence head's
    cumulative product) clears ``threshold`` in [0, 1], or, without one, the batch's prefixes
    the load schedule picks each round (the m most likely positions, m maximising the round's
    rate: the threshold rises with the load)."""

    mode: ClassVar[str] = "dspark"
    block_len: int = 7
    threshold: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.threshold is not None:
            from simtree.acceptance.confidence_head import check_threshold
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
                raise SimtreeError(f"confidence threshold {self.threshold!r} is not a number in [0, 1]")
            object.__setattr__(self, "threshold", check_threshold(self.threshold))

    @property
    def name(self) -> str:
        tail = "sched" if self.threshold is None else f"t{self.threshold:g}"
        return f"dspark_p{self.block_len}_{tail}"

    @property
    def fixed_budget(self) -> int | None:
        return None

    @property
    def max_nodes(self) -> int:
        return self.block_len + 1

    def draft_shape(self) -> tuple[int, int]:
        return self.block_len, 1

    def to_dict(self) -> dict:
        out = super().to_dict()
        if self.threshold is None:
            out.pop("threshold")
        return out


_BY_MODE = {cls.mode: cls for cls in (NoneParams, LinearParams, EagleParams, BestFirstParams, CostAwareParams,
                                      BatchAllocParams, BlockParams, TfmParams, DSparkParams)}


EAGLE_FLAG_DEFAULTS = {"steps": 3, "topk": 2}   # eagle's --steps, --topk when not given (the CLI's help says them)


def params_from_flags(mode: str, steps: int | None, topk: int | None, budget: int, width: int = 1,
                      draft_depth: int | None = None) -> PolicySpec:
    """The policy that the command-line flags of `simtree simulate` / `simtree run` select
    (--budget is the max budget of the adaptive modes; --draft-depth the block drafters' block
    length; DSpark's fixed threshold comes from a policy file, the flags give its schedule)."""
    params = {"none": {}, "linear": {"budget": budget},
              "eagle": {"num_steps": EAGLE_FLAG_DEFAULTS["steps"] if steps is None else steps,
                        "topk": EAGLE_FLAG_DEFAULTS["topk"] if topk is None else topk, "budget": budget},
              "best_first": {"budget": budget, "width": width},
              "cost_aware": {"max_budget": budget}, "batch_alloc": {"max_budget_per_seq": budget},
              "block": {"budget": budget}, "tfm": {"budget": budget, "width": width}, "dspark": {}}
    if mode not in params:
        raise SimtreeError(f"unknown policy mode {mode!r}: use one of {', '.join(MODES)}")
    if mode != "eagle" and (steps, topk) != (None, None):   # None: not given (EAGLE_FLAG_DEFAULTS for eagle)
        given = ", ".join(f for f, v in (("--steps", steps), ("--topk", topk)) if v is not None)
        raise SimtreeError(f"{given} applies to eagle, not to mode {mode!r}")
    p = params[mode]
    if width != 1 and "width" not in p:   # 1 is the flag's default: any other value was asked for
        raise SimtreeError(f"--width applies to {', '.join(m for m, q in params.items() if 'width' in q)}, "
                           f"not to mode {mode!r}")
    if mode in BLOCK_DRAFTER_MODES:      # --draft-depth: the block length (a threshold: a policy file)
        if draft_depth is not None:
            p["block_len"] = draft_depth
        return PolicySpec.from_dict(mode, p)
    if draft_depth is not None:
        if mode not in MARGINAL_MODES:
            raise SimtreeError(f"--draft-depth applies to {', '.join(MARGINAL_MODES)}, not to mode {mode!r}"
                               + (" (eagle drafts --steps levels)" if mode == "eagle" else ""))
        p["draft_depth"] = draft_depth
    return PolicySpec.from_dict(mode, p)
