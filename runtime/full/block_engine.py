"""Rounds drafted by a block drafter on the full runtime: DFlash-style block marginals, a
TfM-style adapter's tree, DSpark's chain with its confidence-scheduled verify.

    rs = round_shape(PolicySpec.from_dict("block", {"budget": 8, "block_len": 7}))
    engine = make_engine(model, rs, batch_size=4, max_len=1024)     # a BlockEngine here
    engine.prefill(prompts)
    engine.run(max_new_tokens=64)

One round, every stage on the device in static shapes (:class:`.engine.FullEngine`'s otherwise):

    draft    the drafter's one backbone forward (:class:`.block_drafters.DrafterRound`): the
             context rows the last round accepted - the target's outputs at the tapped layers
             (:func:`feature_layers`) along its accepted path - are committed to the drafter's
             caches, and the block (the root, then mask rows) gives per position
               block   top-K marginals; the best-first tree over them, built sort-based
               tfm     the adapter's best-first tree over its conditionals, ``width`` a step
               dspark  the Markov head's chain and the confidence head; each sequence verifies
                       the prefix whose predicted survival (the confidences' product) clears the
                       policy's threshold, or, without one, the prefixes batch_alloc's rule
                       takes over the batch's survivals (:mod:`.allocation`: the m most likely
                       positions, m maximising the round's rate - the threshold rises with load);
                       the rest of the chain stays in the tree, never accepted (``valid`` False)
             - everything after the backbone is ``kernels.layers.drafters.draft_round``, the
             function the profiler's drafter stages time
    verify   the target over the trees, its tapped features kept; the accepted path's rows
             become the next draft's context (no catch-up stage: the next draft commits them)
    commit   the target's accepted path

The drafter shares the target's embedding and LM head.  Replays score the marginals (block,
dspark) and the adapter's ranked children (tfm: ``DraftScores.rescore_at``, the tree then the
planner's best-first over the level's draft table) by the acceptance model (``DraftScores``);
a dspark replay's survival is its level's probability of the chain's top-1 (a calibrated
confidence head).  Each round's confidences and verified prefix stay on the device
(``confidence``, ``verified_len``), and a traced engine's (``trace_topk`` > 0) marginals too
(``marginal_lp``, ``marginal_ids``): ``last_round`` brings them to the host with the tree, and
:mod:`.round_trace` turns a round into trace records after it (``generate(..., trace=)``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from simtree.drafters import PUBLIC, own_block_len
from simtree.errors import SimtreeError
from simtree.kernels.layers.drafters import DraftShape, backbone_forward, draft_round, threshold_keep

from .allocation import drafter_cost
from .block_drafters import DrafterRound
from .drafting import MARGINAL_TOPK, RoundShape
from .engine import FullEngine

__all__ = ["BlockEngine", "make_engine", "check_block_len", "feature_layers", "FAMILY_FIELDS", "trained_drafter",
           "drafter_note"]

# drafter sizes of one family only (``sizes`` may name them for every family: the others' are dropped)
FAMILY_FIELDS = {"tfm": ("cand_k", "adapter_dim"), "dspark": ("markov_rank",)}


def feature_layers(n_layers: int, count: int = PUBLIC["target_layers"]) -> tuple[int, ...]:
    """The target layers a block drafter reads (DFlash's spread: ``count`` layers evenly from
    layer 1 to layer n - 3; every layer where the model has no more than ``count``)."""
    if n_layers <= count:
        return tuple(range(n_layers))
    if count == 1:
        return (n_layers // 2,)
    start, end = 1, max(n_layers - 3, count)
    return tuple(sorted({round(start + i * (end - start) / (count - 1)) for i in range(count)}))


def trained_drafter(model, family: str):
    """(sizes, weights) of the trained ``family`` drafter in the model's checkpoint folder
    (``MODEL/drafters/<family>``, runtime/drafter_model.py), or None where there is none; one
    line for one trained on other target layers than the model's :func:`feature_layers`."""
    root = getattr(model, "drafters_dir", None)
    if root is None or not (Path(root) / family / "config.json").is_file():
        return None
    from simtree.runtime.drafter_model import read_drafter
    return read_drafter(Path(root) / family, family, taps=feature_layers(len(model.kinds)))


def drafter_note(model, family: str) -> str | None:
    """One line where a checkpoint's block drafter is drawn at random (no trained one beside it)."""
    root = getattr(model, "drafters_dir", None)
    if root is None or (Path(root) / family / "config.json").is_file():
        return None
    return (f"{model.shape.name} has no trained {family} drafter ({Path(root) / family}): it drafts with random "
            "weights (acceptance means nothing; the output stays lossless)")


def make_engine(model, rs: RoundShape, batch_size: int, max_len: int, source=None, graphs=None, costs=None,
                shapes=(), trace_topk: int = 0, **drafter):
    """The engine of round shape ``rs``: a :class:`BlockEngine` for the block drafters, else a
    FullEngine (``shapes``, ``trace_topk``: its); ``drafter``: the BlockEngine's ``sizes`` / ``seed``."""
    if rs.block_drafter:
        if any(s != rs for s in shapes):
            raise SimtreeError(f"{rs.name}: a block drafter's engine runs its own round shape alone")
        return BlockEngine(model, rs, batch_size, max_len, source, graphs, costs, trace_topk=trace_topk, **drafter)
    return FullEngine(model, rs, batch_size, max_len, source, graphs, costs, shapes=shapes, trace_topk=trace_topk)


def check_block_len(rs: RoundShape, costs=None) -> None:
    """A block length the drafter drafts (its own block at most), and a bundle with its cost
    where one is given: else one line."""
    own = own_block_len(rs.drafter)
    if not 1 <= rs.num_steps <= own:
        raise SimtreeError(f"block length {rs.num_steps} is beyond the {rs.drafter} drafter's {own} positions")
    if costs is not None:
        drafter_cost(costs, rs.drafter).check_block_len(rs.num_steps)


class BlockEngine(FullEngine):
    def __init__(self, model, rs: RoundShape, batch_size: int, max_len: int, source=None, graphs=None, costs=None,
                 sizes: dict | None = None, seed: int = 0, trace_topk: int = 0):
        """``sizes``: drafter fields other than the public ones (tests: tiny drafters; another
        family's fields are ignored); without them a checkpoint's trained drafter
        (:func:`trained_drafter`) is loaded where there is one; ``trace_topk`` > 0: a traced engine
        (FullEngine's), whose rounds keep their marginals for ``last_round``."""
        if not rs.block_drafter:
            raise SimtreeError(f"{rs.name} is not drafted by a block drafter")
        check_block_len(rs, costs)
        super().__init__(model, rs, batch_size, max_len, source, graphs, costs, trace_topk=trace_topk)
        taps = feature_layers(len(model.kinds))
        self.verify_kw = {"taps": taps}
        others = {f for fam, fields in FAMILY_FIELDS.items() if fam != rs.drafter for f in fields}
        trained = trained_drafter(model, rs.drafter) if sizes is None else None
        weights = None
        if trained is not None:
            sizes, weights = trained
            if sizes.get("target_layers") != len(taps) or rs.num_steps > sizes.get("block_len", 0):
                raise SimtreeError(f"the trained {rs.drafter} drafter reads {sizes.get('target_layers')} target layers "
                                   f"and drafts {sizes.get('block_len')} positions; this run needs {len(taps)} layers "
                                   f"and {rs.num_steps} positions")
        sizes = {"target_layers": len(taps), **{k: v for k, v in (sizes or {}).items() if k not in others},
                 "block_len": rs.num_steps}
        B, L, dev = self.B, rs.num_steps, self.device
        self.drafter = DrafterRound(model.shape, rs.drafter, batch=B, max_len=max_len, device=dev, dtype=model.dtype,
                                    seed=seed, ends={"embed": model.w["embed"], "lm_head": model.w["lm_head"]},
                                    weights=weights, **sizes)
        K = MARGINAL_TOPK
        self.marginal_ids = torch.zeros(B, L, K, dtype=torch.int64, device=dev)
        self.marginal_lp = torch.zeros(B, L, K, dtype=torch.float32, device=dev)
        self.confidence = torch.zeros(B, L, dtype=torch.float32, device=dev)
        self.verified_len = torch.zeros(B, dtype=torch.int64, device=dev)
        self._prompt_feats = None
        self._sync_lengths = False

    # ---- stages ------------------------------------------------------------------------------
    def _stages(self) -> list:
        if self.rs.plain:
            return super()._stages()
        return [("draft", self._draft), ("verify", self._verify), ("commit", self._commit)]

    def _draft(self) -> None:
        rs, d = self.rs, self.drafter
        scores = getattr(self.source, "scores", None)
        if scores is not None:
            scores.draw(self.B)
        keep = None
        if rs.drafter == "dspark":   # the prefix that clears the threshold, or the schedule's
            keep = threshold_keep(rs.threshold) if rs.threshold is not None else \
                (lambda surv: self.alloc.allocate(surv, self.st.lengths.double().mean()))
        out = draft_round(rs.drafter, d.w, d.cfg, d.hidden(self.roots), self.roots, self.tree,
                          DraftShape(rs.tree_nodes, rs.width, MARGINAL_TOPK), keep=keep,
                          rescore=None if scores is None else scores.rescore_at)
        if out.confidence is not None:
            self.confidence.copy_(out.confidence)
            self.verified_len.copy_(out.verified_len)
        if self.traced and out.lp is not None:     # for last_round
            self.marginal_ids.copy_(out.ids)
            self.marginal_lp.copy_(out.lp)

    def _verify(self) -> None:
        super()._verify()
        feats = self._pend.features
        B, P = self.B, self.rs.path_rows
        feats = feats.view(B, self.rs.nodes, -1)
        self.drafter.feats.copy_(feats.gather(1, self._path[..., None].expand(B, P, feats.shape[-1])))
        self.drafter.n_new.copy_(self._acc_len + 1)

    def _round_tensors(self) -> dict:
        """FullEngine's, with the drafter's inputs to the acceptance model that ``last_round``
        reads: the top-K marginals' log-probs and ids [B, L, K] (block, dspark: its
        ``marginals``), ``confidence`` [B, L] and ``verified_len`` [B] (dspark)."""
        out = super()._round_tensors()
        if self.rs.plain:     # a plain round: the root alone, no drafter inputs
            return out
        d = self.rs.drafter
        if d in ("block", "dspark"):
            out["marginal_lp"], out["marginal_ids"] = self.marginal_lp, self.marginal_ids
        if d == "dspark":
            out["confidence"], out["verified_len"] = self.confidence, self.verified_len
        return out

    # ---- set-up ------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.drafter.state.lengths.zero_()
        self.drafter.n_new.zero_()

    def fill_context(self, context_len: int, seed: int = 0) -> None:
        """As FullEngine's; the drafter's context as long as the target's (its rows as they are:
        the work does not depend on them)."""
        self._sync_lengths = True
        super().fill_context(context_len, seed)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> None:
        """As FullEngine's; the prompt's tapped features become the drafter's context (all but
        its last piece committed here, the last by the first round's draft)."""
        if self._sync_lengths:
            self.drafter.state.lengths.copy_(self.st.lengths)
            self._sync_lengths = False
        self._prompt_feats = [[] for _ in range(self.B)]
        try:
            super().prefill(prompts)
            self._feed_context([torch.cat(f) for f in self._prompt_feats])
        finally:
            self._prompt_feats = None

    def _prefill_target(self, part):
        rows, last = super()._prefill_target(part)
        feats = self._pend.features.view(self.B, max(len(x) for x in part), -1)
        for b, x in enumerate(part):
            self._prompt_feats[b].append(feats[b, :len(x)])
        return rows, last

    def _feed_context(self, feats: list[torch.Tensor]) -> None:
        d, A, dev = self.drafter, self.rs.path_rows, self.device
        T = [f.shape[0] for f in feats]
        last = [(t - 1) % A + 1 for t in T]
        full = [(t - r) // A for t, r in zip(T, last)]
        width = feats[0].shape[-1]
        for k in range(max(full)):
            buf = torch.zeros(self.B, A, width, dtype=d.feats.dtype, device=dev)
            n = torch.zeros(self.B, dtype=torch.int64, device=dev)
            for b, f in enumerate(feats):
                if k < full[b]:
                    buf[b] = f[k * A:(k + 1) * A]
                    n[b] = A
            backbone_forward(d.w, d.cfg, d.state, d.rope, buf, n, self.roots)
        d.feats.zero_()
        for b, f in enumerate(feats):
            d.feats[b, :last[b]] = f[T[b] - last[b]:]
        d.n_new.copy_(torch.as_tensor(last, device=dev))

