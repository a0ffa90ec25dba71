"""Convex, monotone latency surfaces f(x, y, z) and their cvxpy fits.

Axes (the cost models in :mod:`simtree.costmodel` name them):

    verify  x = nodes_per_seq n, y = context_len l, z = batch_size b
    draft   x = topk k,          y = num_steps s,   z = batch_size b

Every surface is convex and non-decreasing in x, and non-decreasing in y and z, over the
whole positive orthant (between, beyond and below the measured grid), by construction of
its form plus the constraints of its fit.
"""
from simtree.costfit.forms import BasisSurface, GridSurface, ScaledVerifyDraft, surface_from_dict
from simtree.costfit.fitting import FitResult, fit_surface

__all__ = ["BasisSurface", "GridSurface", "ScaledVerifyDraft", "surface_from_dict",
           "FitResult", "fit_surface"]
