"""Monotone latency surfaces f(x, y, z) (convex in x unless they say otherwise) and their cvxpy fits.

Axes (the cost models in :mod:`simtree.costmodel` name them):

    verify  x = nodes_per_seq n, y = context_len l, z = batch_size b
    draft   x = topk k,          y = num_steps s,   z = batch_size b

Every surface is non-decreasing in x, y and z over the whole positive orthant (between,
beyond and below the measured grid), by construction of its form plus the constraints of its
fit; and convex in x, except the forms "moe" and "moe_grid" (MoE expert saturation), which
are concave where the experts saturate and say so: ``surface.convex_in_x`` is False and
``surface.nonconvex_reason`` gives the reason.
"""
from simtree.costfit.forms import (BasisSurface, GridSurface, MoEGridSurface, MoESurface,
                                   ScaledVerifyDraft, surface_from_dict)
from simtree.costfit.fitting import FitResult, fit_surface

__all__ = ["BasisSurface", "GridSurface", "MoESurface", "MoEGridSurface", "ScaledVerifyDraft",
           "surface_from_dict", "FitResult", "fit_surface"]
