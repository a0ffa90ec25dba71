"""``simtree fit``'s library side: profile table -> CostBundle (+ evaluation, + PNG).

Verify rows: the chosen stage (default ``model_verify_step`` when the table has it, else the
only non-draft stage, else ``stage=`` must name one), one model, one deployment (the rank the
rows timed: ``deployment=`` picks one when the table holds several), one device, one variant
(``composed`` preferred for model_verify_step when several). Rows that differ only in
tree_shape (linear vs tree at the same n) are merged by their median: the cost model is a
function of (n, l, b) only.  Composed rows that repeat, to the last digit of median, p10 and
p90, the row of the same (b, n, tree shape) at a shorter context are not measurements at their
context: the composition (``profiler/compose.py``) holds a piece measured at fewer context
lengths at its longest one's value (clamped), so they are dropped before the fit, with a note
(``_drop_context_copies``); the grid forms fill those cells from their neighbours.
C_v is fitted on the lower envelope in n (:mod:`simtree.costs.verify_pad`): a (b, n) whose
measured verify costs at least ``pad_min_saving`` more than a larger n' at every context it was
timed at (n' timed at each) takes the latency of n', since the runtime pads such a round to n'
nodes at any context; the pad map is kept
in the bundle as ``verify.info["verify_pad"]`` (absent where nothing pads; ``verify_pad=False``
fits the rows as measured).  Then the measured (b, n >= 2) cells the chosen C_v misses by at least
``cells_min_excess`` on one side at every context are corrected by the measured - fitted
difference nearest 0, added at every context (:mod:`simtree.costs.verify_cells`,
``verify.info["verify_cells"]`` with the held-out error of the corrected C_v, each held-out point
corrected from the training folds only, and the folds holding a padded cell out with its pad
target at each (b, l); ``verify_cells=False`` keeps the surface alone).

Draft rows: ``draft_step`` of the same model and device, axes (topk, num_steps, batch);
their context lengths are merged by median (C_d takes no l). Without draft rows the fit
refuses unless ``draft_from_verify``: then C_d(s, k, b) = fraction * s * C_v(k, l_med, b),
an assumption recorded in the bundle (see :class:`simtree.costs.forms.ScaledVerifyDraft`).

Forms: ``forms=None`` ("auto") tries basis, grid and grid_lin (the grid with a
piecewise-linear-in-l prior for cells without data), plus moe and moe_grid when the model is
an MoE in the registry (:func:`simtree.models.get_model`; the n_experts, experts_per_token of
the rank's shape: 32 of 256 experts at ep=8).
Those two are monotone but not convex in n (expert saturation); when one wins held-out the
model info says ``convex_in_n: false`` with the reason, and a note says so.  Plain decoding's own
curve (the decode split: n = 1 over x = batch size) also tries ``DECODE_FORMS`` under "auto":
grid_mono, monotone but not convex in batch (a runtime whose decode step changes kernels between
batch sizes is a staircase in batch), kept only where it predicts held-out points better
(:data:`simtree.costs.surface_fit.RELAXES`); the decode record and a note name it when kept.
"""
from __future__ import annotations

import os
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from simtree.costs.surface_fit import FitResult, fit_surface
from simtree.costs.tile_fit import choose_tile_rows, with_tile_rows
from simtree.costs.tiles import TILE_NONCONVEX_REASON
from simtree.costs.forms import MOE_ROUTINGS, ScaledVerifyDraft, check_draft_fraction
from simtree.costs.surface_fit import BATCH_X_FORMS, MOE_FORMS, error_stats
from simtree.costs.forms import DecodeSplitSurface
from simtree.costs.model import DRAFT_AXES, DRAFTER_STAGE, VERIFY_AXES, CostBundle, DraftCostModel, VerifyCostModel
from simtree.costs.drafter_fit import fit_drafters
from simtree.costs.verify_cells import (CELLS_KEY, CELLS_MIN_EXCESS, cell_corrections, check_min_excess,
                                        heldout_corrected)
from simtree.costs.verify_pad import (PAD_KEY, PAD_MIN_SAVING, check_min_saving, envelope_rows, pad_map,
                                      padded_nodes)
from simtree.parallel import DEFAULT_DEPLOYMENT, parse_deployment
from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.costs.profile_table import load_profile, profile_hash, read_meta

__all__ = ["FitReport", "fit_profile", "check_fit_options", "plot_fit", "bench_predict", "moe_shape", "DRAFT_STAGE",
           "DEFAULT_VERIFY_STAGE", "AUTO_FORMS", "DECODE_FORMS"]

DRAFT_STAGE = "draft_step"
DEFAULT_VERIFY_STAGE = "model_verify_step"
AUTO_FORMS = ("basis", "grid", "grid_lin")   # + MOE_FORMS for an MoE model
DECODE_FORMS = BATCH_X_FORMS   # + these for plain decoding's curve over batch (the decode split)
# stages whose cost includes the MLP, where an MoE model's experts are read (the attention
# cores and projections have none)
EXPERT_STAGES = (DEFAULT_VERIFY_STAGE, "stack_verify_step", "mlp_step")


def profile_moe_routing(path, table: pd.DataFrame | None = None) -> str:
    """How a profile table's MoE layers routed: its sidecar's ``moe_routing``; for a sidecar that
    predates the record, ``balanced`` where the profiler's own MoE piece was timed (``mlp_step``
    rows of another variant than ``layers``: it timed min(T k, E) experts then), else ``uniform``
    (the full runtime's layers, ``layers`` rows, and its rank profiles, which have no sidecar:
    a softmax gate routes)."""
    meta = read_meta(path)
    if "moe_routing" in meta:
        return str(meta["moe_routing"])
    if not meta:
        return "uniform"
    table = load_profile(path) if table is None else table
    mlp = table.loc[table["stage"] == "mlp_step", "variant"]
    return "balanced" if (mlp != "layers").any() else "uniform"


def moe_shape(model: str, deployment: str | None = None) -> tuple[int, int] | None:
    """(n_experts, experts_per_token) of a registry model with an MoE MLP, of one rank of
    ``deployment`` (its local experts); None for a dense model or a name the registry does not
    know (then no MoE form is tried)."""
    try:
        mlp = get_model(model).shard(deployment or DEFAULT_DEPLOYMENT).mlp
    except SimtreeError:
        return None
    if mlp.get("kind") != "moe":
        return None
    return int(mlp["n_experts"]), int(mlp["experts_per_token"])


MISFIT_P90 = 0.10   # a kept form whose in-sample p90 relative error exceeds this is reported as missing its profile


@dataclass
class FitReport:
    bundle: CostBundle
    verify: FitResult
    draft: FitResult | None          # None when the draft model was assumed from verify
    verify_rows: pd.DataFrame
    draft_rows: pd.DataFrame | None
    notes: list = field(default_factory=list)

    def misfit_warnings(self) -> list[str]:
        """One line per cost model whose kept form misses its own profile: in-sample p90 error
        above :data:`MISFIT_P90` (the measured cost is not convex / monotone where the form must
        be, e.g. a staircase of kernel choices), with its worst point; every prediction near
        such points carries that error."""
        out = []
        for name, res in (("C_v", self.verify), ("C_d", self.draft)):
            if res is None or res.in_sample["p90"] <= MISFIT_P90:
                continue
            line = (f"{name} ({res.form}) misses its own profile: in-sample p90 {100 * res.in_sample['p90']:.0f}%, "
                    f"max {100 * res.in_sample['max']:.0f}% over {res.num_points} points")
            if res.worst:
                w = res.worst[0]
                at = ", ".join(f"{k}={v:g}" for k, v in w.items() if k not in ("measured_us", "fitted_us", "rel_err"))
                line += f"; worst at {at}: fitted {w['fitted_us']:.0f} us, measured {w['measured_us']:.0f} us"
            out.append(line + "; predictions near those points are off by as much (time more points there, "
                              "or read them as rough)")
        split = self.bundle.verify.info.get("decode_split") or {}
        decode = (split.get("decode_fit_error") or {}).get("in_sample") if split.get("kept") else None
        if decode is not None and decode["p90"] > MISFIT_P90:
            out.append(f"C_v of plain decoding (n = 1, {split['decode_form']}) misses its own profile: in-sample p90 "
                       f"{100 * decode['p90']:.0f}%, max {100 * decode['max']:.0f}%; plain steps are priced off by as much")
        return out

    def summary(self) -> dict:
        """JSON-able evaluation (what ``simtree fit --json`` prints)."""
        out = {"meta": self.bundle.meta, "notes": self.notes, "warnings": self.misfit_warnings()}
        for name, model in (("verify", self.bundle.verify), ("draft", self.bundle.draft)):
            out[name] = {k: v for k, v in model.info.items() if k != "source"}
        for fam, model in self.bundle.drafters.items():
            out.setdefault("drafters", {})[fam] = {k: v for k, v in model.info.items() if k != "source"}
        return out


def _pick(df: pd.DataFrame, column: str, value: str | None, what: str,
          prefer: str | None = None, notes: list | None = None) -> pd.DataFrame:
    """Keep rows with column == value; with no value the column must hold one value."""
    if value is not None:
        kept = df[df[column] == value]
        if kept.empty:
            raise SimtreeError(f"no {what} rows with {column}={value!r} (have: "
                               f"{', '.join(sorted(df[column].unique()))})")
        return kept
    values = sorted(df[column].unique())
    if len(values) == 1:
        return df
    if prefer in values:
        if notes is not None:
            notes.append(f"{what}: several {column}s ({', '.join(values)}); using {prefer}")
        return df[df[column] == prefer]
    label = "mixed devices in one fit" if column == "device" else f"several {column}s"
    raise SimtreeError(f"{what}: {label}: {', '.join(values)} (choose one with --{column})")


def _choose_verify_stage(df: pd.DataFrame, stage: str | None, notes: list) -> str:
    stages = sorted(s for s in df["stage"].unique() if not str(s).startswith("comm_"))   # collectives: their own fit
    if stage is not None:
        if stage == DRAFT_STAGE:
            raise SimtreeError(f"{DRAFT_STAGE} rows are C_d's (fitted beside C_v); --stage picks the "
                               "verify stage")
        if stage not in stages:
            raise SimtreeError(f"no rows with stage={stage!r} (have: {', '.join(stages)})")
        return stage
    if DEFAULT_VERIFY_STAGE in stages:
        return DEFAULT_VERIFY_STAGE
    others = [s for s in stages if s != DRAFT_STAGE and s not in DRAFTER_STAGE.values()]
    if len(others) == 1:
        notes.append(f"no {DEFAULT_VERIFY_STAGE} rows; fitting C_v to stage {others[0]}")
        return others[0]
    raise SimtreeError(f"no {DEFAULT_VERIFY_STAGE} rows; choose the verify stage with --stage "
                       f"(have: {', '.join(stages) or 'none'})")


COPY_KEY = ("latency_us_median", "latency_us_p10", "latency_us_p90")


def _drop_context_copies(rows: pd.DataFrame, what: str, notes: list) -> pd.DataFrame:
    """The composed rows without those that copy a shorter context's row of the same (b, n,
    tree shape) in all of ``COPY_KEY`` (a clamped composition, see the module doc); other
    variants are measured whole and kept as they are."""
    composed = rows["variant"] == "composed"
    if not composed.any():
        return rows
    ordered = rows[composed].sort_values("context_len", kind="stable")
    copies = ordered.duplicated(subset=["batch_size", "nodes_per_seq", "tree_shape", *COPY_KEY])
    if not copies.any():
        return rows
    dropped = ordered[copies]
    cells = sorted({(int(r.context_len), int(r.nodes_per_seq)) for r in dropped.itertuples()})
    by_l: dict[int, list[int]] = {}
    for l, n in cells:
        by_l.setdefault(l, []).append(n)
    where = "; ".join(f"l={l}: n={','.join(map(str, ns))}" for l, ns in by_l.items())
    notes.append(f"{what}: {len(dropped)} composed rows repeat a shorter context's row exactly (a piece "
                 f"clamped beyond its measured contexts, not a measurement at l) and are left out ({where})")
    return rows.drop(index=dropped.index)


def _info(result: FitResult, source: dict, notes: list, convex_key: str) -> dict:
    info = {"form": result.form, "valid_range": result.surface.valid_range, "source": source,
            "num_points": result.num_points,
            "fit_error": {"heldout": result.heldout, "in_sample": result.in_sample,
                          "kept": result.form},
            "worst_residuals": result.worst, "worst_heldout_residuals": result.worst_heldout,
            "notes": list(result.notes) + notes,
            convex_key: result.convex_in_x}
    if not result.convex_in_x:
        info["nonconvex_reason"] = result.surface.nonconvex_reason
    return info


def _in_registry(model: str) -> bool:
    try:
        get_model(model)
    except SimtreeError:
        return False
    return True


def _resolve_forms(forms, moe: tuple[int, int] | None, model: str) -> tuple:
    if forms is None or forms == "auto":
        return AUTO_FORMS + (MOE_FORMS if moe else ())
    forms = tuple(forms)
    if moe is None and set(forms) & set(MOE_FORMS):
        raise SimtreeError(f"forms {', '.join(MOE_FORMS)} need an MoE model; {model!r} is dense or "
                           "not in the model registry")
    return forms


def check_fit_options(*, moe_routing: str | None = None, deployment: str | None = None,
                      draft_from_verify: bool = False, draft_fraction: float = 0.05, verify_pad: bool = True,
                      pad_min_saving: float = PAD_MIN_SAVING, verify_cells: bool = True,
                      cells_min_excess: float = CELLS_MIN_EXCESS) -> None:
    """The options of :func:`fit_profile` that need no table, each checked (one line) before a
    table is read: what ``simtree fit`` checks before it writes anything."""
    if moe_routing is not None and moe_routing not in MOE_ROUTINGS:
        raise SimtreeError(f"MoE routing {moe_routing!r} unknown: one of {', '.join(MOE_ROUTINGS)}")
    if deployment is not None:
        parse_deployment(deployment)
    if draft_from_verify:
        check_draft_fraction(draft_fraction)
    if verify_pad:
        check_min_saving(pad_min_saving)
    if verify_cells:
        check_min_excess(cells_min_excess)


def fit_profile(profile: str | os.PathLike, *, stage: str | None = None, model: str | None = None,
                variant: str | None = None, device: str | None = None, dtype: str | None = None,
                draft_variant: str | None = None, draft_from_verify: bool = False,
                draft_fraction: float = 0.05, forms=None, folds: int = 5,
                reference_forms=("per_bin",), deployment: str | None = None, comm=None, measured_comm=None,
                on_fit: Callable[[], None] | None = None,
                on_more_solves: Callable[[int], None] | None = None, moe_routing: str | None = None,
                verify_pad: bool = True, pad_min_saving: float = PAD_MIN_SAVING,
                verify_cells: bool = True, cells_min_excess: float = CELLS_MIN_EXCESS) -> FitReport:
    """Fit C_v and C_d to a profile table and return the bundle with its evaluation.

    ``forms``: None/"auto" (see the module doc) or a tuple of form names.  ``on_fit()`` runs
    after every solve; ``on_more_solves(k)`` before the k solves of the n = 1 split (see
    ``_decode_split``), so a progress bar can grow.  ``deployment``: the rows of that rank
    (canonical or not: "ep=8"); ``comm``: the communication model (a
    :class:`simtree.costs.comm.CommModel` or its JSON path) the bundle records for a
    deployment of several GPUs, default the machine's assumed one (``meta["communication"]``).
    ``moe_routing``: how the profile's MoE layers routed (``simtree.costs.forms.touched_experts``);
    default the table's ``.meta.json`` ``moe_routing``, ``balanced`` for a sweep's table from before
    it was recorded, ``uniform`` for a table without one (the runtime's rank profiles: its gate
    routes). Raises SimtreeError
    (one line) on a bad table, an ambiguous selection (several models, devices or variants with
    none chosen), an MoE form for a dense model, or data that cannot be fitted.
    """
    path = Path(profile)
    check_fit_options(moe_routing=moe_routing, deployment=deployment, draft_from_verify=draft_from_verify,
                      draft_fraction=draft_fraction, verify_pad=verify_pad, pad_min_saving=pad_min_saving,
                      verify_cells=verify_cells, cells_min_excess=cells_min_excess)
    df = load_profile(path)
    notes: list[str] = []
    vstage = _choose_verify_stage(df, stage, notes)
    what = f"stage {vstage}"
    rows = _pick(df[df["stage"] == vstage], "model", model, what)
    rows = _pick(rows, "deployment", None if deployment is None else parse_deployment(deployment).name, what)
    rows = _pick(rows, "device", device, what)
    rows = _pick(rows, "dtype", dtype, what)
    rows = _pick(rows, "variant", variant, what,
                 prefer="composed" if vstage == DEFAULT_VERIFY_STAGE else None, notes=notes)
    rows = _drop_context_copies(rows, what, notes)
    pad = pad_map(rows, pad_min_saving) if verify_pad else {"by_batch": {}}
    if pad["by_batch"]:
        rows = envelope_rows(rows, pad)
        notes.append(f"{what}: C_v fitted on the lower envelope in n (a round padded to a cheaper measured "
                     f"bucket, saving >= {100 * pad_min_saving:g}%): " + "; ".join(
                         f"batch {b}: " + ", ".join(f"{n} -> {m}" for n, m in sorted(ns.items(), key=lambda x: int(x[0])))
                         for b, ns in sorted(pad["by_batch"].items(), key=lambda x: int(x[0]))))
    if rows["tree_shape"].nunique() > 1:
        notes.append(f"{what}: tree shapes {', '.join(sorted(rows['tree_shape'].unique()))} merged "
                     "by median at equal (n, l, b)")
    model_name, device_name = rows["model"].iloc[0], rows["device"].iloc[0]
    dep_name = rows["deployment"].iloc[0]
    moe = model_moe = moe_shape(model_name, dep_name)
    if moe is None and moe_routing is not None:
        raise SimtreeError(f"--moe-routing {moe_routing} applies to MoE models; {model_name} has no MoE layers to route: "
                           "leave the option out")
    if moe is not None:
        routing = moe_routing or profile_moe_routing(path, df)
        if routing not in MOE_ROUTINGS:
            raise SimtreeError(f"MoE routing {routing!r} unknown: one of {', '.join(MOE_ROUTINGS)}")
        moe = model_moe = (*moe, routing)
    draft_forms = _resolve_forms(forms, model_moe, model_name) if forms in (None, "auto") else None
    if moe is None and not _in_registry(model_name):
        notes.append(f"model {model_name!r} is not in the model registry: fitted as dense (no MoE "
                     "expert-saturation forms)")
    if moe is not None and vstage not in EXPERT_STAGES:
        moe = None   # an attention core or projection reads no experts
        if forms not in (None, "auto") and set(forms) & set(MOE_FORMS):
            raise SimtreeError(f"forms {', '.join(MOE_FORMS)} model expert saturation; stage {vstage} "
                               f"reads no experts (MoE stages: {', '.join(EXPERT_STAGES)})")
    auto = forms in (None, "auto")
    forms = _resolve_forms(forms, moe, model_name)
    decode_forms = forms + DECODE_FORMS if auto else forms
    draft_forms = draft_forms or forms   # the draft step runs an MLP: an MoE model's forms
    digest = profile_hash(path)
    base_source = {"profile": str(path), "sha256": digest, "model": model_name, "device": device_name}
    fold_key = _pad_folds(pad)
    vres = fit_surface(rows["nodes_per_seq"], rows["context_len"], rows["batch_size"],
                       rows["latency_us_median"], "verify", VERIFY_AXES, forms=forms, folds=folds,
                       what=f"C_v from {what}", on_fit=on_fit, reference_forms=reference_forms, moe=moe,
                       fold_key=fold_key)
    vsource = {**base_source, "stage": vstage, "variant": rows["variant"].iloc[0]}
    split = _decode_split(rows, vres, forms, folds, what, on_fit, moe, notes, on_more_solves, decode_forms,
                          fold_key)
    if split is not None and split["kept"]:
        vres = split["main"]
    tile, tile_record = _tile_interp(vres, moe, notes, on_fit, on_more_solves, pad)
    if split is not None and split["kept"]:
        vres.surface = DecodeSplitSurface(vres.surface, split["decode"].surface)
    vinfo = _info(vres, vsource, [], "convex_in_n")
    if pad["by_batch"]:
        vinfo[PAD_KEY] = pad
    if split is not None:
        vinfo["decode_split"] = split["record"]
        if split["kept"]:
            vinfo["nonconvex_reason"] = vres.surface.nonconvex_reason
    if tile_record is not None:
        vinfo["tile_interp"] = tile_record
        if tile is not None and split is not None and split["kept"]:
            vinfo["nonconvex_reason"] += f"; {TILE_NONCONVEX_REASON}"
    verify = VerifyCostModel(vres.surface, vinfo)
    if verify_cells:
        _correct_cells(verify, vres, split, cells_min_excess, notes)

    drows = df[(df["stage"] == DRAFT_STAGE) & (df["model"] == model_name) & (df["device"] == device_name)
               & (df["dtype"] == rows["dtype"].iloc[0]) & (df["deployment"] == dep_name)]
    dres = None
    if drows.empty:
        if not draft_from_verify:
            raise SimtreeError(f"{path.name} has no {DRAFT_STAGE} rows for model {model_name} on "
                               f"{device_name}; pass --draft-from-verify to assume C_d from C_v")
        l_ref = float(np.median(rows["context_len"]))
        assumption = (f"no {DRAFT_STAGE} rows: assumed C_d(s, k, b) = {draft_fraction:g} * s * "
                      f"C_v(n=k, l={l_ref:g}, b)")
        notes.append(assumption)
        scaled = ScaledVerifyDraft(vres.surface, draft_fraction, l_ref)
        dinfo = {"form": "scaled_verify", "assumption": assumption,
                 "source": {**base_source, "stage": vstage}, "fit_error": None,
                 "convex_in_topk": scaled.convex_in_x}
        if not scaled.convex_in_x:
            dinfo["nonconvex_reason"] = scaled.nonconvex_reason
        draft = DraftCostModel(scaled, dinfo)
        drows = None
    else:
        drows = _pick(drows, "variant", draft_variant, f"stage {DRAFT_STAGE}")
        bad = drows[(drows["num_steps"] < 1) | (drows["topk"] < 1)]
        if not bad.empty:
            raise SimtreeError(f"{path.name} line {int(bad.index[0]) + 2}: {DRAFT_STAGE} rows need "
                               "num_steps >= 1 and topk >= 1")
        dnotes = []
        if drows["context_len"].nunique() > 1:
            dnotes.append("draft rows at several context lengths merged by median (C_d has no l)")
        dres = fit_surface(drows["topk"], drows["num_steps"], drows["batch_size"],
                           drows["latency_us_median"], "draft", DRAFT_AXES, forms=draft_forms,
                           folds=folds, what=f"C_d from stage {DRAFT_STAGE}", on_fit=on_fit,
                           reference_forms=reference_forms, moe=model_moe)
        dsource = {**base_source, "stage": DRAFT_STAGE, "variant": drows["variant"].iloc[0]}
        draft = DraftCostModel(dres.surface, _info(dres, dsource, dnotes, "convex_in_topk"))
        notes.extend(dnotes)

    drafters, fam_notes = fit_drafters(df, model=model_name, device=device_name, dtype=rows["dtype"].iloc[0],
                                       deployment=dep_name, source=base_source, folds=folds, on_fit=on_fit)
    notes.extend(fam_notes)
    meta = {"model": model_name, "device": device_name, "synthetic": False, "deployment": dep_name,
            "communication": _communication(dep_name, device_name, comm, notes, measured_comm),
            "moe": None if model_moe is None else {"n_experts": model_moe[0], "experts_per_token": model_moe[1],
                                                   "routing": model_moe[2]},
            "source": {"profile": str(path), "sha256": digest, "verify_stage": vstage,
                       "draft_stage": DRAFT_STAGE if dres is not None else None},
            "profile_meta": read_meta(path)}
    return FitReport(CostBundle(verify, draft, meta, drafters), vres, dres, rows, drows, notes)


def _correct_cells(verify: VerifyCostModel, vres: FitResult, split: dict | None, min_excess: float,
                   notes: list) -> None:
    """Add the measured-cell corrections (:mod:`simtree.costs.verify_cells`) to ``verify``: from
    its fitted points against its surface; the held-out error of the corrected C_v from the k
    folds of the fit (each point corrected from the training folds only), over the same points as
    the held-out error the model reports.  Nothing is added where no cell is corrected."""
    points = vres.points
    record = cell_corrections(points, verify.surface.predict(*points[:3]), min_excess)
    if not record["offset_us"]:
        return
    ho = heldout_corrected(points, vres.fold_of, vres.fold_pred, vres.heldout_pred, verify.info.get(PAD_KEY),
                           min_excess)
    lat = points[3]
    kept_split = split is not None and split["kept"]
    if kept_split:   # the decode split's held-out error is over its n = 1 points too (never corrected)
        ho = np.concatenate([ho, split["decode"].heldout_pred])
        lat = np.concatenate([lat, split["decode"].points[3]])
    before = verify.info["decode_split"]["heldout_split"] if kept_split else vres.heldout[vres.form]
    verify.info[CELLS_KEY] = record
    fitted = np.asarray(verify.predict(*points[:3]), dtype=float)
    record["heldout"] = error_stats(ho, lat)
    record["in_sample"] = error_stats(fitted, points[3])
    reason = "measured cells corrected off the convex surface (verify_cells)"
    verify.info["convex_in_n"] = False
    verify.info["nonconvex_reason"] = "; ".join(r for r in (verify.info.get("nonconvex_reason"), reason) if r)
    by_int = lambda d: sorted(d.items(), key=lambda kv: int(kv[0]))  # noqa: E731
    cells = "; ".join(f"batch {b}: " + ", ".join(f"n={n} {c / 1000:+.2f} ms" for n, c in by_int(ns))
                      for b, ns in by_int(record["offset_us"]))
    notes.append(f"C_v corrected at {sum(map(len, record['offset_us'].values()))} measured cells it misses by >= "
                 f"{100 * min_excess:g}% at every context ({cells}: the excess nearest 0, at any context); "
                 f"held-out median {100 * before['median']:.1f}% -> "
                 f"{100 * record['heldout']['median']:.1f}%, p90 {100 * before['p90']:.1f}% -> "
                 f"{100 * record['heldout']['p90']:.1f}%; in-sample p90 {100 * vres.in_sample['p90']:.1f}% -> "
                 f"{100 * record['in_sample']['p90']:.1f}%; not convex in n, so budget searches take the global argmax")


def _communication(deployment: str, device: str, comm, notes: list, measured=None) -> dict | None:
    """The communication model a bundle of a deployment of several GPUs records: ``comm`` (a
    CommModel or a path: the user's), else ``measured`` (the collectives fitted from the same
    table), else the default of the machine that measured the rows; None for one GPU (a given
    ``comm`` is then refused, the table's own collectives left to their .comm.json), or a device
    no machine table describes (then the deployment's costs need one given)."""
    from simtree.costs.comm import CommModel, load_comm
    from simtree.machine.machines import machine_for_device

    if parse_deployment(deployment).gpus == 1:
        if comm is not None:
            raise SimtreeError(f"--comm: the rows are of {deployment}, one GPU: no collectives to model")
        if measured is not None:
            notes.append(f"the table's collectives are fitted apart (.comm.json); the {deployment} bundle, one GPU, "
                         "records none")
        return None
    comm = comm if comm is not None else measured
    if comm is not None:
        return (comm if isinstance(comm, CommModel) else load_comm(comm)).to_dict()
    machine = machine_for_device(device)
    if machine is None:
        notes.append(f"no machine table describes device {device!r}: the bundle holds no communication model "
                     f"for {deployment} (give one with --comm)")
        return None
    model = load_comm(machine.comm_path)
    if model.assumed:
        notes.append(f"{deployment}: communication assumed ({machine.comm_path.name}, docs/deployments.md), "
                     "not measured")
    return model.to_dict()


# plain decoding fitted on its own only when that cuts the held-out error (median + p90) of
# C_v over all points by at least this fraction and one percentage point: a real jump, not noise
DECODE_SPLIT_GAIN = 0.25


def _tile_interp(vres: FitResult, moe, notes: list, on_fit, on_more_solves, pad: dict | None = None) -> tuple:
    """Leave-one-node-count-out check of the tile-aware interpolation in n
    (:mod:`simtree.costs.tile_fit`); a kept tile replaces ``vres.surface`` and is noted."""
    if on_more_solves is not None and vres.points is not None:
        on_more_solves(max(len(np.unique(vres.points[0])) - 2, 0))
    tile, record = choose_tile_rows(vres, "verify", VERIFY_AXES, moe, on_fit=on_fit, pad=pad)
    if tile is not None:
        vres.surface = with_tile_rows(vres.surface, tile)
        st = record["heldout_node"]
        notes.append(f"C_v interpolates in n by {tile}-row M-tiles of n * b tokens: node counts "
                     f"{', '.join(f'{n:g}' for n in record['held_out'])} left out one at a time, "
                     f"mean |error| {100 * st[str(tile)]['mean']:.1f}% (worst {100 * st[str(tile)]['max']:.1f}%) "
                     f"vs {100 * st['none']['mean']:.1f}% ({100 * st['none']['max']:.1f}%) on a straight line; "
                     "not convex in n between the measured node counts, so budget searches take the global argmax")
    return tile, record


def _pad_folds(pad: dict):
    """The C_v fit's ``fold_key`` (:func:`fit_surface`): at each (b, l) a cell the pad map pads is
    held out with its target, whose latency the envelope copied into it (else a surface trained on
    the copy would predict the held-out point, and the corrected held-out error of
    :mod:`simtree.costs.verify_cells` would price a point by its own measurement)."""
    def key(x, y, z):
        return [(float(padded_nodes(pad, int(n), int(b))) if n >= 2 and float(n).is_integer() else float(n),
                 float(l), float(b)) for n, l, b in zip(x, y, z)]
    return key


def _decode_split(rows: pd.DataFrame, joint, forms, folds, what, on_fit, moe, notes: list,
                  on_more_solves=None, decode_forms=None, fold_key=None) -> dict | None:
    """C_v with n = 1 (plain decoding) on its own curve (``DecodeSplitSurface``) against the
    joint fit ``joint``, compared on the same points' k-fold held-out predictions; None when
    the table has no n = 1 points or too few to fit the two parts.  ``decode_forms`` (default
    ``forms``): the forms the n = 1 curve over batch tries."""
    decode_forms = forms if decode_forms is None else decode_forms
    n = rows["nodes_per_seq"]
    one, rest = rows[n == 1], rows[n >= 2]
    if one.empty or rest.empty:
        return None
    lat = "latency_us_median"
    if on_more_solves is not None:   # two fits of every form: k folds and the refit each
        on_more_solves((len(forms) + len(decode_forms)) * (folds + 1))
    try:
        main = fit_surface(rest["nodes_per_seq"], rest["context_len"], rest["batch_size"], rest[lat],
                           "verify", VERIFY_AXES, forms=forms, folds=folds, what=f"C_v(n >= 2) from {what}",
                           on_fit=on_fit, reference_forms=(), moe=moe, fold_key=fold_key)
        decode = fit_surface(one["batch_size"], one["context_len"], one["nodes_per_seq"], one[lat],
                             "verify", ("batch_size", "context_len", "nodes_per_seq"), forms=decode_forms,
                             folds=folds, what=f"C_v(n = 1) from {what}", on_fit=on_fit,
                             reference_forms=(), moe=moe)
    except SimtreeError as exc:
        notes.append(f"plain decoding (n = 1) not fitted on its own: {exc}")
        return None
    both = error_stats(np.concatenate([main.heldout_pred, decode.heldout_pred]),
                       np.concatenate([main.points[3], decode.points[3]]))
    one_fit = joint.heldout[joint.form]
    score = lambda e: e["median"] + e["p90"]  # noqa: E731
    kept = score(both) <= (1 - DECODE_SPLIT_GAIN) * score(one_fit) and score(one_fit) - score(both) >= 0.01
    record = {"kept": bool(kept), "heldout_split": both,
              "heldout_joint": {k: v for k, v in one_fit.items() if k != "folds"},
              "main_form": main.form, "decode_form": decode.form,
              "decode_valid_range": decode.surface.valid_range,
              "decode_fit_error": {"heldout": decode.heldout[decode.form], "in_sample": decode.in_sample},
              "decode_heldout_forms": {f: {k: e[k] for k in ("median", "p90")} for f, e in decode.heldout.items()}}
    if kept:
        notes.append(f"plain decoding (n = 1) fitted on its own: held-out median+p90 "
                     f"{100 * score(both):.1f}% vs {100 * score(one_fit):.1f}% for one surface over "
                     f"all n; C_v jumps from n = 1 to 2, so budget searches take the global argmax")
        if not decode.convex_in_x:
            record["decode_convex_in_batch"] = False
            notes.append(f"plain decoding's curve kept form {decode.form}: monotone, NOT convex in batch (the "
                         "measured decode step jumps between profiled batch sizes); held-out median+p90 "
                         + ", ".join(f"{f} {100 * score(e):.1f}%" for f, e in decode.heldout.items()))
    return {"kept": kept, "main": main, "decode": decode, "record": record}


_SHORT = {"context_len": "l", "num_steps": "steps"}


def plot_fit(report: FitReport, path: str | os.PathLike) -> Path:
    """PNG: measured (markers) and fitted (lines) latency against n, one line per context
    length, one panel per batch size; a second row does the same for draft cost vs top-k."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    verify = report.bundle.verify   # the line is the fitted surface; corrected cells (verify_cells) are an x
    cells = (verify.info.get(CELLS_KEY) or {}).get("offset_us") or {}
    panels = [("verify", report.verify_rows, "nodes_per_seq", "context_len",
               lambda x, c, b: verify.surface.predict(x, c, b))]
    if report.draft_rows is not None:
        panels.append(("draft", report.draft_rows, "topk", "num_steps",
                       lambda x, c, b: report.bundle.draft.predict(c, x, b)))
    ncols = max(r["batch_size"].nunique() for _, r, *_ in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(3.6 * ncols, 3.2 * len(panels)),
                             squeeze=False)
    for row, (name, df, xcol, ccol, predict) in enumerate(panels):
        agg = df.groupby(["batch_size", ccol, xcol], as_index=False)["latency_us_median"].median()
        for col, (b, sub) in enumerate(agg.groupby("batch_size")):
            ax = axes[row][col]
            for i, (c, line) in enumerate(sub.groupby(ccol)):
                color = f"C{i % 10}"
                ax.plot(line[xcol], line["latency_us_median"], "o", color=color, ms=4)
                xs = np.linspace(line[xcol].min(), line[xcol].max(), 100)
                ax.plot(xs, predict(xs, float(c), float(b)), "-", color=color, lw=1.2,
                        label=f"{_SHORT[ccol]}={c:g}")
                fixed = [float(n) for n in (cells.get(str(int(b))) or {}) if name == "verify"
                         and float(n) in set(line[xcol])]
                if fixed:
                    ax.plot(fixed, [verify.predict(n, float(c), float(b)) for n in fixed], "x", color=color, ms=5)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{name}, batch {b}", fontsize=9)
            ax.set_xlabel(xcol)
            ax.set_ylabel("latency (us)")
            ax.legend(fontsize=6)
        for col in range(agg["batch_size"].nunique(), ncols):
            axes[row][col].axis("off")
    meta = report.bundle.meta
    fig.suptitle(f"{meta['model']} on {meta['device']}: measured (o) vs fitted (-)"
                 + (", corrected cells (x)" if cells else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_predict(bundle: CostBundle, number: int = 20000) -> dict:
    """Microseconds per scalar predict call (verify, draft) and per 1024-point vector call."""
    v, d = bundle.verify, bundle.draft
    rng = v.valid_range
    n = float(rng.get("nodes_per_seq", [1, 8])[1]) / 2
    l = float(rng.get("context_len", [0, 4096])[1]) / 2
    b = float(rng.get("batch_size", [1, 8])[1]) / 2
    drng = getattr(d, "valid_range", {}) or {}
    s = float(np.mean(drng.get("num_steps", [3, 3])))
    k = float(np.mean(drng.get("topk", [2, 2])))
    vec = np.linspace(1, max(n, 2), 1024)
    return {"verify_scalar_us": timeit.timeit(lambda: v.predict(n, l, b), number=number) / number * 1e6,
            "draft_scalar_us": timeit.timeit(lambda: d.predict(s, k, b), number=number) / number * 1e6,
            "verify_vector1024_us": timeit.timeit(lambda: v.predict(vec, l, b), number=200) / 200 * 1e6}
