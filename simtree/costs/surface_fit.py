"""Fit the surface forms as convex programs (cvxpy) and keep the best held-out one.

Loss: Huber of the relative residual r_i = f(p_i) / y_i - 1 (threshold ``huber_rel``):
quadratic within timing noise, linear beyond, so a few outlier timings do not bend the fit.
Both forms are linear in their parameters, so the loss is convex and every shape constraint
(convex and non-decreasing in x, non-decreasing in y and z) is a linear inequality: the fit
is the best convex, monotone approximation of the data, and where the data themselves are not
convex (a tile-size step) the largest residuals are reported, not hidden.

The forms "moe" and "moe_grid" (MoE models only: ``moe=(n_experts, experts_per_token)``) add
the fixed feature touched(T) / E (the experts T tokens touch under uniform routing,
``simtree.costs.forms.touched_experts``) with a coefficient >= 0 to the basis / grid form: still a
convex program, but the surface is concave in x where the experts saturate. They compete on
held-out error like the others; when one is kept the result says so (``convex_in_x`` False
and a note), never silently.

The form "grid_lin" is the grid form with a different prior for the cells the data do not
fix (held-out or never measured): instead of only the least curvature in x, an L1 penalty on
the curvature in y makes the surface piecewise linear in y with few kinks (y = context length
for C_v: KV / state reads grow linearly with l; y = draft steps for C_d: s sequential steps),
and a smaller curvature-in-x weight keeps the bias on measured cells below timing noise. Same
shape constraints as "grid" (convex, monotone), same GridSurface; it competes on held-out error.

The form "moe_grid_free" (MoE models only) is "moe_grid" without the convexity-in-x constraint on
the grid values: they stay non-decreasing in x, y and z (and the extrapolating increments
non-decreasing), and the cells without data take the least |curvature| in x (L1, the grid_lin
weight: piecewise linear in x between measured node counts).  A MoE surface is not convex in x
anyway, and a measured MoE verify step is not convex in n either (GEMM M-tile steps, expert
saturation, the attention kernel's row padding): a convex grid misses such a profile by several
percent at its own measured points, a free one passes within timing noise.  Its surface carries
``grid_convex = False`` and says so in ``nonconvex_reason``; it competes on held-out error, and
is kept only where its held-out median + p90 is ``RELAX_MIN_GAIN`` below moe_grid's (a form with
fewer constraints must earn them: on a tie the constrained, convex-cell grid stays).

The form "grid_mono" is the same relaxation for a dense surface whose x axis is the batch size
(plain decoding's curve, n = 1, over x = batch, y = context: ``profile_fit``'s decode split): the
grid values non-decreasing in every axis, not convex in batch, the L1 least-|curvature| prior of
moe_grid_free for cells without data, so a measured staircase in batch (kernel choices: a step
from batch 4 to 8 after a flat 2 -> 4) is followed instead of being averaged by a convex curve.
Between profiled batch sizes the surface is linear, beyond the largest it continues with the last
slope, below the smallest it holds (monotone everywhere).  It is refused where x is anything else
(n and top-k stay convex), and kept only where its held-out median + p90 is ``RELAX_MIN_GAIN``
below the better of grid's and grid_lin's.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from simtree.costs.forms import MOE_FORMS, BasisSurface, GridSurface, MoEGridSurface, MoESurface, expert_feature
from simtree.errors import SimtreeError

__all__ = ["FitResult", "fit_surface", "aggregate_points", "error_stats", "MOE_FORMS", "GRID_FORMS", "BATCH_X_FORMS"]

MAX_KNOTS = 10
GRID_FORMS = ("grid", "grid_lin", "per_bin", "moe_grid", "moe_grid_free", "grid_mono")
# forms not convex in x that only a surface over x = batch size takes (convex in n and top-k stays)
BATCH_X_FORMS = ("grid_mono",)
BATCH_AXIS = "batch_size"
# Regularisation of the grid forms (u = values / median latency): "grid", "per_bin" and
# "moe_grid" use the x-curvature weight only; "grid_lin" the pair below (y-linearity 10x the
# x-curvature, both small beside the data term; see the module doc); "moe_grid_free" the
# grid_lin x-curvature weight, as an L1 prior (its values are not constrained convex in x).
GRID_CURVATURE_WEIGHT = 1e-3
# a form that drops a constraint of others (form -> the constrained ones) is kept only when its
# held-out median + p90 is this fraction below the best of the constrained forms'
RELAXES = {"moe_grid_free": ("moe_grid",), "grid_mono": ("grid", "grid_lin")}
RELAX_MIN_GAIN = 0.10
GRID_LIN_CURVATURE_WEIGHT = 1e-4
GRID_LIN_Y_LINEAR_WEIGHT = 1e-3


@dataclass
class FitResult:
    """The kept surface, its form's name and the evaluation of every form tried."""

    surface: object
    form: str
    heldout: dict            # form -> {"median", "p90", "mean", "max", "folds"}
    in_sample: dict          # error stats of the kept surface on all points
    worst: list              # the largest in-sample residuals of the kept surface
    num_points: int
    notes: list = field(default_factory=list)
    worst_heldout: list = field(default_factory=list)   # the kept form's largest k-fold residuals
    points: tuple | None = None         # (x, y, z, latency) of the distinct points fitted
    heldout_pred: np.ndarray | None = None   # the kept form's k-fold prediction at each point
    fold_of: np.ndarray | None = None        # each point's fold
    fold_pred: np.ndarray | None = None      # [k, points]: the kept form's fold surfaces at every point

    @property
    def convex_in_x(self) -> bool:
        return bool(getattr(self.surface, "convex_in_x", True))


def error_stats(pred: np.ndarray, y: np.ndarray) -> dict:
    rel = np.abs(np.asarray(pred) / y - 1.0)
    return {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)),
            "mean": float(np.mean(rel)), "max": float(np.max(rel))}


def aggregate_points(x, y, z, latency):
    """Median latency per distinct (x, y, z); returns arrays x, y, z, latency, count."""
    pts = np.stack([np.asarray(a, dtype=float) for a in (x, y, z)], axis=1)
    lat = np.asarray(latency, dtype=float)
    keys, inv = np.unique(pts, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    med = np.array([np.median(lat[inv == i]) for i in range(len(keys))])
    count = np.bincount(inv, minlength=len(keys))
    return keys[:, 0], keys[:, 1], keys[:, 2], med, count


def _solve(problem: cp.Problem, what: str) -> None:
    last = None
    for solver in ("CLARABEL", "SCS"):
        try:
            with warnings.catch_warnings():   # an inaccurate solve is accepted below: no stray warning
                warnings.filterwarnings("ignore", message="Solution may be inaccurate")
                problem.solve(solver=solver)
        except (cp.error.SolverError, ValueError) as exc:
            last = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            continue
        if problem.status in ("optimal", "optimal_inaccurate"):
            return
        last = problem.status
    raise SimtreeError(f"{what}: convex fit failed ({last})")


def choose_knots(tokens: np.ndarray) -> list[float]:
    """Hinge positions: distinct token counts strictly inside the measured range, <= MAX_KNOTS
    of them spread evenly in log scale (the knee sits somewhere in between)."""
    u = np.unique(tokens)
    inner = u[1:-1]
    if len(inner) > MAX_KNOTS:
        pick = np.unique(np.round(np.linspace(0, len(inner) - 1, MAX_KNOTS)).astype(int))
        inner = inner[pick]
    return [float(t) for t in inner]


def _moe(moe) -> tuple[int, int, str]:
    """(E, k_e, routing) of ``moe=(E, k_e)`` (uniform routing) or ``(E, k_e, routing)``."""
    E, k, *rest = moe
    return int(E), int(k), (rest[0] if rest else "uniform")


def fit_basis(x, y, z, lat, kind: str, axis_names, valid_range, huber_rel: float,
              moe: tuple | None = None) -> BasisSurface:
    """The basis form; with ``moe=(E, k_e[, routing])`` the moe form (one more column, the
    expert term)."""
    knots = choose_knots(x * z)
    phi = BasisSurface.features(kind, knots, x, y, z)
    if moe is not None:
        E, k, routing = _moe(moe)
        phi = np.column_stack([phi, expert_feature(kind, E, k, x, y, z, routing)])
    scale = np.max(np.abs(phi), axis=0)
    scale[scale == 0] = 1.0
    a = (phi / scale) / lat[:, None]          # r = a @ theta - 1
    theta = cp.Variable(phi.shape[1], nonneg=True)
    prob = cp.Problem(cp.Minimize(cp.sum(cp.huber(a @ theta - 1.0, huber_rel)) / len(lat)))
    _solve(prob, f"{kind} {'moe' if moe else 'basis'} form")
    coef = np.maximum(np.asarray(theta.value, dtype=float), 0.0) / scale
    if moe is not None:
        return MoESurface(kind, knots, coef[:-1], coef[-1], E, k, axis_names, valid_range, routing)
    return BasisSurface(kind, knots, coef, axis_names, valid_range)


def _diff(n: int) -> sp.csr_matrix:
    """First difference operator [(n-1), n]."""
    return sp.diags([-np.ones(n - 1), np.ones(n - 1)], [0, 1], shape=(n - 1, n), format="csr")


def _slope_change(axis: np.ndarray) -> sp.csr_matrix:
    """Rows (slope_{i+1} - slope_i) * (dx_i + dx_{i+1}) >= 0 <=> convex on a non-uniform grid."""
    n = len(axis)
    if n < 3:
        return sp.csr_matrix((0, n))
    dx = np.diff(np.asarray(axis, dtype=float))
    slopes = sp.diags(1.0 / dx) @ _diff(n)
    return sp.diags(dx[:-1] + dx[1:]) @ _diff(n - 1) @ slopes


def _pad_axis(vals: np.ndarray) -> tuple[np.ndarray, bool]:
    """A grid axis needs two values; a single measured value gets a flat phantom neighbour."""
    if len(vals) >= 2:
        return vals, False
    return np.array([vals[0], vals[0] + max(1.0, abs(vals[0]))]), True


def fit_grid(x, y, z, lat, axis_names, valid_range, huber_rel: float,
             curvature_weight: float = GRID_CURVATURE_WEIGHT, coupled: bool = True,
             moe: tuple[int, int] | None = None, kind: str = "verify",
             y_linear_weight: float = 0.0, convex_x: bool = True) -> GridSurface:
    """coupled=False drops every constraint across y and z: one convex curve in x per
    (y, z) bin, interpolated linearly between bins (the public practice, kept as a reference
    to compare against; it is not monotone in y or z in general). ``moe=(E, k_e)``: the
    moe_grid form, one more variable alpha >= 0 on the fixed expert feature of ``kind``.
    ``y_linear_weight`` > 0 (form grid_lin): also penalise |curvature in y| (L1), so cells
    without data follow the piecewise-linear continuation in y of their (x, z) column.
    ``convex_x=False`` (forms moe_grid_free and grid_mono): the values are not constrained convex
    in x, only monotone; the curvature penalty becomes L1 (|curvature|), the prior of empty cells."""
    if not convex_x and moe is None and axis_names[0] != BATCH_AXIS:
        raise SimtreeError(f"a dense grid not convex in x is fitted only over x = {BATCH_AXIS} (grid_mono): "
                           f"{axis_names[0]} must stay convex")
    xs = np.unique(x)
    (ys, flat_y), (zs, flat_z) = _pad_axis(np.unique(y)), _pad_axis(np.unique(z))
    nx, ny, nz = len(xs), len(ys), len(zs)
    ix, iy, iz = (np.searchsorted(ax, q) for ax, q in ((xs, x), (ys, y), (zs, z)))
    cell = (iz * ny + iy) * nx + ix
    size = nx * ny * nz
    unit = float(np.median(lat))                # solve for V / unit: well scaled
    u = cp.Variable(size, nonneg=True)
    pick = sp.csr_matrix((unit / lat, (np.arange(len(lat)), cell)), shape=(len(lat), size))

    eye = lambda n: sp.identity(n, format="csr")  # noqa: E731
    dx, cx = _diff(nx), _slope_change(xs)
    last_y = sp.csr_matrix(([-1.0, 1.0], ([0, 0], [ny - 2, ny - 1])), shape=(1, ny))
    last_z = sp.csr_matrix(([-1.0, 1.0], ([0, 0], [nz - 2, nz - 1])), shape=(1, nz))
    inc_y = sp.kron(eye(nz), sp.kron(last_y, eye(nx)))   # [nz*nx, size] last y-increment
    inc_z = sp.kron(last_z, eye(ny * nx))               # [ny*nx, size] last z-increment
    curv = sp.kron(eye(nz * ny), cx)
    inc_x = sp.vstack([dx, cx]) if convex_x else dx
    rows = [
        sp.kron(eye(nz * ny), dx), *([curv] if convex_x else []),   # x-slices non-decreasing, convex
        sp.kron(eye(nz), sp.kron(_diff(ny), eye(nx))),        # non-decreasing in y
        sp.kron(_diff(nz), eye(ny * nx)),                     # non-decreasing in z
        sp.kron(eye(nz), inc_x) @ inc_y,                      # y-extrapolation monotone (convex) in x
        sp.kron(eye(ny), inc_x) @ inc_z,                      # z-extrapolation monotone (convex) in x
        sp.kron(_diff(nz), eye(nx)) @ inc_y,                  # ... and monotone in z beyond y_max
        sp.kron(_diff(ny), eye(nx)) @ inc_z,                  # ... and monotone in y beyond z_max
    ]
    if not convex_x:   # beyond x_max the last x-slope continues: it must not fall along y or z
        last_x = sp.csr_matrix(([-1.0, 1.0], ([0, 0], [nx - 2, nx - 1])), shape=(1, nx))
        inc_x_last = sp.kron(eye(nz * ny), last_x)                     # [nz*ny, size]
        rows += [sp.kron(eye(nz), _diff(ny)) @ inc_x_last, sp.kron(_diff(nz), eye(ny)) @ inc_x_last]
    ineq = sp.vstack(rows if coupled else rows[:2 if convex_x else 1]).tocsr()
    cons = [ineq @ u >= 0]
    if flat_y:
        cons.append(inc_y @ u == 0)
    if flat_z:
        cons.append(inc_z @ u == 0)
    # A small curvature penalty picks the least-curved values for cells without data.
    # (no curvature rows where the x grid has fewer than 3 points: cvxpy before 1.7 rejects an empty matrix)
    reg = (curvature_weight * (cp.sum(curv @ u) if convex_x else cp.norm1(curv @ u)) / (nz * ny)
           if curv.shape[0] else cp.Constant(0.0))
    if y_linear_weight > 0 and ny >= 3:
        # ... and, for grid_lin, the values closest to piecewise linear in y (L1: few kinks).
        # Not a constraint: the surface need not be linear (or convex) in y.
        curv_y = sp.kron(eye(nz), sp.kron(_slope_change(ys), eye(nx)))
        reg = reg + y_linear_weight * cp.norm1(curv_y @ u) / (nz * nx)
    fitted = pick @ u
    if moe is not None:
        alpha = cp.Variable(nonneg=True)
        E, k, routing = _moe(moe)
        fitted = fitted + alpha * (expert_feature(kind, E, k, x, y, z, routing) * unit / lat)
    loss = cp.sum(cp.huber(fitted - 1.0, huber_rel)) / len(lat)
    _solve(cp.Problem(cp.Minimize(loss + reg), cons),
           ("moe_grid form" if convex_x else "moe_grid_free form") if moe else "grid form")
    values = np.maximum(np.asarray(u.value, dtype=float), 0.0).reshape(nz, ny, nx) * unit
    if flat_y:   # phantom neighbours equal their measured slice exactly, not to solver tolerance
        values[:, 1, :] = values[:, 0, :]
    if flat_z:
        values[1] = values[0]
    if coupled:
        values = _project_monotone(values)
    if not convex_x and moe is None:   # grid_mono: exact monotonicity along x too (solver round-off)
        values = np.maximum.accumulate(values, axis=2)
    if moe is not None:
        return MoEGridSurface(kind, xs, ys, zs, values, max(float(alpha.value), 0.0) * unit, E, k,
                              axis_names, valid_range, routing, grid_convex=convex_x)
    return GridSurface(xs, ys, zs, values, axis_names, valid_range, grid_convex=convex_x)


def _project_monotone(v: np.ndarray) -> np.ndarray:
    """Remove solver round-off (~1e-9 relative) that would break exact monotonicity along y, z.

    Convexity in x is left as solved: its violations are at round-off level and the tests
    check it with a tolerance."""
    v = np.maximum.accumulate(v, axis=0)
    return np.maximum.accumulate(v, axis=1)


def _score(err: dict) -> str:
    return f"{100 * (err['median'] + err['p90']):.1f}%"


def _fit_form(form, x, y, z, lat, kind, axis_names, valid_range, huber_rel, moe=None):
    if form in ("basis", "moe"):
        return fit_basis(x, y, z, lat, kind, axis_names, valid_range, huber_rel,
                         moe=moe if form == "moe" else None)
    if form == "grid_lin":
        return fit_grid(x, y, z, lat, axis_names, valid_range, huber_rel,
                        curvature_weight=GRID_LIN_CURVATURE_WEIGHT,
                        y_linear_weight=GRID_LIN_Y_LINEAR_WEIGHT, kind=kind)
    if form in ("moe_grid_free", "grid_mono"):
        return fit_grid(x, y, z, lat, axis_names, valid_range, huber_rel, curvature_weight=GRID_LIN_CURVATURE_WEIGHT,
                        moe=moe if form == "moe_grid_free" else None, kind=kind, convex_x=False)
    if form in GRID_FORMS:
        return fit_grid(x, y, z, lat, axis_names, valid_range, huber_rel, coupled=form != "per_bin",
                        moe=moe if form == "moe_grid" else None, kind=kind)
    raise SimtreeError(f"unknown model form {form!r} (basis, grid, grid_lin, grid_mono, moe, moe_grid, "
                       "moe_grid_free or per_bin)")


def monotone_violations(surface, valid_range: dict, axis_names) -> float:
    """Fraction of neighbouring pairs on a dense in-range grid where f decreases along y or z
    (0 for the kept forms by construction; the per-bin reference usually is not 0)."""
    axes = [np.linspace(*valid_range[n], 24) for n in axis_names]
    v = surface.predict(axes[0][:, None, None], axes[1][None, :, None], axes[2][None, None, :])
    tol = 1e-9 * np.abs(v).max()
    bad = (np.diff(v, axis=1) < -tol).sum() + (np.diff(v, axis=2) < -tol).sum()
    return float(bad / (np.diff(v, axis=1).size + np.diff(v, axis=2).size))


def fit_surface(x, y, z, latency, kind: str, axis_names=("x", "y", "z"),
                forms=("basis", "grid", "grid_lin"), folds: int = 5, seed: int = 0,
                huber_rel: float = 0.05, what: str = "cost model", worst_k: int = 5,
                on_fit=None, reference_forms=(), moe: tuple[int, int] | None = None,
                fold_key=None) -> FitResult:
    """Fit every form, score it by k-fold held-out relative error, refit the best on all points.

    x, y, z, latency: 1-D arrays of equal length (latency in us, > 0). Points with equal
    (x, y, z) are merged by their median. Refuses (SimtreeError) fewer than 4 distinct points
    or a single x value: a curve in x cannot be fitted from one value. ``on_fit()`` is called
    after every solve ((len(forms) + len(reference_forms)) * (folds + 1) at most) to drive a
    progress bar. ``reference_forms`` (e.g. "per_bin") are scored and reported, never kept.
    ``moe=(n_experts, experts_per_token)`` of an MoE model enables the forms "moe" and
    "moe_grid"; asking for them without it is refused (a dense model never gets a form not convex in
    n).  The forms :data:`BATCH_X_FORMS` (grid_mono) are refused unless x is the batch size.
    ``fold_key(x, y, z)`` (of the merged points) gives each point a key; points of equal key are held
    out in the same fold (a point whose latency copies another's, e.g. a padded verify cell's, must
    not be predicted by a surface trained on its twin); None: every point a fold key of its own.
    """
    if moe is None and set(forms) & set(MOE_FORMS):
        raise SimtreeError(f"{what}: forms {', '.join(MOE_FORMS)} need an MoE model's "
                           "(n_experts, experts_per_token)")
    if axis_names[0] != BATCH_AXIS and set(forms) & set(BATCH_X_FORMS):
        raise SimtreeError(f"{what}: form {', '.join(BATCH_X_FORMS)} is not convex in x; only a surface over "
                           f"x = {BATCH_AXIS} takes it ({axis_names[0]} must stay convex)")
    x, y, z, lat, _ = aggregate_points(x, y, z, latency)
    if not (np.all(np.isfinite(lat)) and np.all(lat > 0)):
        raise SimtreeError(f"{what}: latencies must be finite and > 0")
    name_x = axis_names[0]
    if len(np.unique(x)) < 2:
        raise SimtreeError(f"{what}: only one {name_x} value ({x[0]:g}); need at least 2 to fit a curve")
    if len(lat) < 4:
        raise SimtreeError(f"{what}: only {len(lat)} distinct points; need at least 4")
    valid_range = {n: [float(a.min()), float(a.max())] for n, a in zip(axis_names, (x, y, z))}
    group = np.arange(len(lat))
    if fold_key is not None:     # group ids by first appearance: all keys distinct gives the folds of no key
        first: dict = {}
        group = np.array([first.setdefault(key, len(first)) for key in fold_key(x, y, z)], dtype=int)
    groups = int(group.max()) + 1
    k = int(min(folds, groups))
    fold_of = (np.random.default_rng(seed).permutation(groups) % k)[group]
    heldout, notes, preds, fold_preds = {}, [], {}, {}
    if folds > groups:
        notes.append(f"{folds} folds asked for {groups} distinct points: {k} (leave-one-out)")
    for form in (*forms, *reference_forms):
        pred, at_all = np.empty_like(lat), np.empty((k, len(lat)))
        try:
            for f in range(k):
                tr, te = fold_of != f, fold_of == f
                if len(np.unique(x[tr])) < 2:
                    raise SimtreeError("a fold left a single x value")
                s = _fit_form(form, x[tr], y[tr], z[tr], lat[tr], kind, axis_names, valid_range,
                              huber_rel, moe)
                at_all[f] = s.predict(x, y, z)       # every point (measured-cell corrections' held-out path)
                pred[te] = at_all[f][te]
                if on_fit is not None:
                    on_fit()
        except SimtreeError as exc:
            notes.append(f"form {form} skipped: {exc}")
            continue
        heldout[form] = {**error_stats(pred, lat), "folds": k}
        preds[form], fold_preds[form] = pred, at_all
        if form in reference_forms and form not in forms:
            ref = _fit_form(form, x, y, z, lat, kind, axis_names, valid_range, huber_rel)
            heldout[form].update(reference=True, monotone_violations=monotone_violations(
                ref, valid_range, axis_names))
            if on_fit is not None:
                on_fit()
    candidates = [f for f in forms if f in heldout]
    if not candidates:
        raise SimtreeError(f"{what}: no model form could be fitted ({'; '.join(notes)})")
    # Keep the form with the lower held-out error (median + p90: typical and tail); a form that
    # relaxes another's constraints must beat it by RELAX_MIN_GAIN (a tie keeps the constrained one).
    score = lambda f: heldout[f]["median"] + heldout[f]["p90"]  # noqa: E731
    best = min(candidates, key=score)
    strict = [f for f in RELAXES.get(best, ()) if f in heldout]
    if strict:
        ref = min(strict, key=score)
        if score(best) > (1 - RELAX_MIN_GAIN) * score(ref):
            notes.append(f"form {best} not kept: held-out median+p90 {_score(heldout[best])} is not "
                         f"{RELAX_MIN_GAIN:.0%} below {ref}'s {_score(heldout[ref])}, whose constraints it relaxes")
            best = min((f for f in candidates if f != best), key=score)
    surface = _fit_form(best, x, y, z, lat, kind, axis_names, valid_range, huber_rel, moe)
    if not getattr(surface, "convex_in_x", True):
        others = ", ".join(f"{f} {_score(heldout[f])}" for f in candidates if f != best)
        vs = f" (held-out median+p90 {_score(heldout[best])} vs {others})" if others else ""
        experts = f", E={moe[0]}, k={moe[1]}" if moe is not None else ""
        notes.append(f"kept form {best}: NOT convex in {name_x} ({surface.nonconvex_reason}{experts}){vs}; "
                     f"a search over {name_x} must take the global argmax, not the first stop")
    if on_fit is not None:
        on_fit()
    fitted = np.asarray(surface.predict(x, y, z), dtype=float)
    worst = _worst(x, y, z, lat, fitted, axis_names, worst_k, "fitted_us")
    worst_heldout = _worst(x, y, z, lat, preds[best], axis_names, worst_k, "heldout_us")
    return FitResult(surface, best, heldout, error_stats(fitted, lat), worst, len(lat), notes,
                     worst_heldout, (x, y, z, lat), preds[best], fold_of, fold_preds[best])


def _worst(x, y, z, lat, pred, axis_names, worst_k: int, label: str) -> list:
    """The ``worst_k`` largest relative residuals pred / lat - 1, as rows for a table."""
    rel = pred / lat - 1.0
    order = np.argsort(-np.abs(rel), kind="stable")[:worst_k]
    return [{axis_names[0]: float(x[i]), axis_names[1]: float(y[i]), axis_names[2]: float(z[i]),
             "measured_us": float(lat[i]), label: float(pred[i]), "rel_err": float(rel[i])}
            for i in order]
