"""Acceptance: how likely the target accepts each drafted node.  An :class:`AcceptanceModel`
(per depth and sibling rank, in levels of drafter confidence) is fitted from traces or taken
from a preset (:mod:`.model`; a :class:`Workload` adds prompt and output lengths); :mod:`.phi`
computes a tree's expected accepted length Phi(T) and samples accepted lengths.  numpy only.
"""
from simtree.acceptance.model import (PRESETS, AcceptanceModel, Workload, calibrate_linear, fit_marginals,
                                      fit_positional, get_workload, read_traces)
from simtree.acceptance.phi import expected_accepted, expected_accepted_positional, sample_accepted_length

__all__ = ["AcceptanceModel", "Workload", "PRESETS", "calibrate_linear", "fit_positional", "fit_marginals",
           "read_traces", "get_workload", "expected_accepted", "expected_accepted_positional",
           "sample_accepted_length"]
