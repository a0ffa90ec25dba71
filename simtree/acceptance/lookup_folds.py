"""Whether the context lookup helps a drafter's calibration, checked on the calibrating runs alone.

The lookup (:func:`simtree.acceptance.transfer.context_match`) carries what the drafter's own
probability may not: a target that repeats its context.  Whether it helps predict a workload's
acceptance can be checked on the calibrating runs themselves: their sequences are cut into
``folds``; each fold's linear runs are predicted from a calibration on the other folds, applied
to the fold's drafting pass (:func:`simtree.acceptance.transfer.transfer_model`), with and
without the lookup (:func:`lookup_cv`).  No outcome of the runs being predicted enters.  The
out-of-sample table reports it beside its calibrations (docs/acceptance.md, section 5: tried as
a rule choosing the lookup per workload, it did no better than reading the lookup everywhere).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from simtree.acceptance.fit import fit_calibration
from simtree.acceptance.predict import accepted_per_round
from simtree.acceptance.traces import TraceRecord
from simtree.acceptance.transfer import DrafterConfidences, transfer_model
from simtree.errors import SimtreeError

__all__ = ["lookup_cv", "FOLDS"]

FOLDS = 4


def _subset(drafts: DrafterConfidences, keep: np.ndarray) -> DrafterConfidences:
    return DrafterConfidences(drafts.workload, drafts.seq[keep], drafts.position[keep], drafts.probs[keep],
                              drafts.context_len[keep], None if drafts.context_match is None
                              else drafts.context_match[keep])


def lookup_cv(records: Sequence[TraceRecord], drafts: DrafterConfidences, folds: int = FOLDS) -> dict:
    """{False: [|log(predicted / measured)|], True: [...]}: one entry per fold and linear budget of
    ``records`` (linear runs with the drafter's top-K and the lookup's ranks, every sequence
    ``seq`` of ``drafts``, the same prompts' drafting pass), predicted from a calibration on the
    other folds without / with the lookup.  Fold f holds the sequences with seq % folds == f."""
    records = [r for r in records if r.mode == "linear" and r.topk_tokens is not None and r.seq is not None]
    if drafts.context_match is None or not records or any(r.context_match is None for r in records):
        raise SimtreeError("the lookup's cross-validation needs linear runs and a drafting pass with the lookup's ranks")
    seqs = np.unique(drafts.seq)
    folds = min(folds, seqs.size)
    if folds < 2:
        raise SimtreeError("the lookup's cross-validation needs at least 2 sequences")
    fold_of = {int(s): i % folds for i, s in enumerate(seqs)}
    budgets = sorted({r.tree.num_nodes for r in records})
    errs = {False: [], True: []}
    for f in range(folds):
        train = [r for r in records if fold_of.get(r.seq) != f]
        held = _subset(drafts, np.array([fold_of[int(s)] == f for s in drafts.seq]))
        for context in (False, True):
            model = transfer_model(fit_calibration(train, context=context), held)
            for b in budgets:
                got = [r.num_accepted + 1 for r in records if fold_of.get(r.seq) == f and r.tree.num_nodes == b]
                if got:
                    pred = accepted_per_round(model, "linear", {"budget": b})
                    errs[context].append(abs(float(np.log(pred / np.mean(got)))))
    return errs

