"""Compose a whole-model verify step from per-part measurements, and validate it.

    model_verify_step(b, n, l, shape) = lm_head(T) + round(b, n)
        + sum over layer kinds k of  count_k * (core_k(b, n, l, shape) + proj_k(T) + mlp(T) + commit_k)

with T = b * n, core_k the attention-core stage of kind k (gdn_tree_verify, attn_tree_verify,
v4_*_verify), proj_k = ``<k>_proj_step`` and the counts from the model's layer pattern; plus
count_k * commit_k(b, n, shape) where the table has kind k's commit stage (gdn_tree_commit:
the state rewritten along the accepted path, once per layer per round; attn_kv_commit,
v4_<kind>_commit likewise) and the round's metadata: ``round_meta_step`` (every kind's, once
per round, plain decoding included) where the table has it, else round_k(b, n, shape) where it
has kind k's round stage (gdn_round_meta, n > 1 only: at n = 1, plain decoding, no tree is
built). Where a stage has rows of several variants the preferred one is taken
(VARIANT_PREFERENCE: ``layers``, the full runtime's own layer calls, first), so a table of the
runtime's layers composes the runtime's step: lm_head_step is then its two ends (embedding,
final norm + logits + argmax) and mlp_step its MLP or MoE. A
core stage measured at one context length only is taken as independent of l (GDN state,
sliding window); otherwise l is interpolated linearly between measured lengths, and a point
outside them is not composed (a value copied from the nearest measured length is no measurement).
The percentiles are composed the same way (sum of p10s, of p90s: a bound, not a quantile).

Validation: ``stack_verify_step`` rows (a measured stack of L real layers in the model's
pattern, variant ``stack<L>``) are compared with the same composition over those L layers.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.models import (COMMIT_STAGE, DECODE_STAGE, HASH_MLP_STAGE, MODEL_ROUND_STAGE, ROUND_STAGE, VERIFY_STAGE,
                            get_model, hash_layers)

from .stages import VARIANT_PREFERENCE, stack_core_variant

__all__ = ["compose_rows", "compose_table", "validate_stacks", "COMPOSED_STAGE", "COMPOSED_VARIANT"]

COMPOSED_STAGE, COMPOSED_VARIANT = "model_verify_step", "composed"
_LAT = ("latency_us_median", "latency_us_p10", "latency_us_p90")
SHAPE_FREE_VARIANTS = ("torch_sdpa", "torch_gather")


def _preferred(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the most preferred variant among them (VARIANT_PREFERENCE, then "torch")."""
    have = set(rows.variant)
    pick = next((v for v in (*VARIANT_PREFERENCE, "torch") if v in have), None)
    return rows[rows.variant == pick] if pick else rows


def _lookup_tokens(df: pd.DataFrame, stage: str, b: int, n: int):
    rows = df[(df.stage == stage) & (df.batch_size == b) & (df.nodes_per_seq == n)]
    if rows.empty:
        return None
    rows = _preferred(rows)
    return rows[list(_LAT)].iloc[0].to_numpy(float), int(rows.repeats.iloc[0])


def _lookup_round(df: pd.DataFrame, b: int, n: int, shape: str):
    """The model-level round metadata (MODEL_ROUND_STAGE) at (b, n): this tree shape's row where
    measured, else any shape's (its cost follows the sizes, not the shape)."""
    rows = df[(df.stage == MODEL_ROUND_STAGE) & (df.batch_size == b) & (df.nodes_per_seq == n)]
    same = rows[rows.tree_shape == shape]
    rows = _preferred(same if not same.empty else rows)
    if rows.empty:
        return None
    return rows[list(_LAT)].iloc[0].to_numpy(float), int(rows.repeats.iloc[0])


def _lookup_core(df: pd.DataFrame, stage: str, b: int, n: int, l: int, shape: str, variant: str | None):
    rows = df[(df.stage == stage) & (df.batch_size == b) & (df.nodes_per_seq == n)]
    same = rows[rows.tree_shape == shape]
    # Variants whose cost does not depend on the tree's shape (dense masks, index lists of
    # the same length) may be measured at one shape only; they stand in for the others.
    rows = same if not same.empty else rows[rows.variant.isin(SHAPE_FREE_VARIANTS)]
    if variant is None:
        variant = next((v for v in VARIANT_PREFERENCE if (rows.variant == v).any()), None)
    rows = rows[rows.variant == variant] if variant else rows.iloc[0:0]
    if rows.empty:
        return None
    rows = rows.drop_duplicates("context_len").sort_values("context_len")
    ls = rows.context_len.to_numpy(float)
    if len(ls) == 1:
        return rows[list(_LAT)].iloc[0].to_numpy(float), int(rows.repeats.iloc[0]), variant
    if not ls[0] <= l <= ls[-1]:   # never a value copied from the nearest measured context
        return None
    vals = np.array([np.interp(l, ls, rows[c].to_numpy(float)) for c in _LAT])
    return vals, int(rows.repeats.min()), variant


def _main_variant(rows: pd.DataFrame) -> str | None:
    """The preferred variant among those covering >= 90% of the best-covered variant's
    points: one implementation per stage, so the composed curve does not jump between
    kernels where a budget-limited variant stops."""
    if rows.empty:
        return None
    counts = rows.variant.value_counts()
    good = set(counts[counts >= 0.9 * counts.max()].index)
    return next((v for v in VARIANT_PREFERENCE if v in good), counts.index[0])


def _extra_stages(sub: pd.DataFrame, kinds) -> dict:
    """{(kind, role): (stage, variant)} for the per-round extras of these layer kinds that
    have rows here: "commit" (``COMMIT_STAGE``, once per layer of the kind), "round"
    (``ROUND_STAGE``, once per round for all layers of the kind) and "decode" (``DECODE_STAGE``,
    the plain decoding step, per layer at n = 1 in place of the verify core and the commit)."""
    out = {}
    for k in kinds:
        for role, table in (("commit", COMMIT_STAGE), ("round", ROUND_STAGE), ("decode", DECODE_STAGE)):
            stage = table.get(k)
            rows = sub[sub.stage == stage] if stage else sub.iloc[0:0]
            if not rows.empty:
                out[k, role] = (stage, _main_variant(rows))
    return out


def round_extras_used(df: pd.DataFrame, model_name: str) -> list[str]:
    """The per-round extra stages ``compose_rows`` adds for ``model_name`` with this table, as
    ``stage/variant`` (e.g. whether the round metadata is the CUDA-graph or the eager time)."""
    model = get_model(model_name)
    return sorted(f"{s}/{v}" for s, v in
                  _extra_stages(df[df.model == model_name], set(model.layer_kinds)).values())


def compose_rows(df: pd.DataFrame, model_name: str, *, layers: tuple[str, ...] | None = None,
                 core_variants: dict | None = None, contexts=None,
                 round_extras: bool = True) -> list[dict]:
    """Composed rows (stage model_verify_step, variant composed) for every (b, n, l, shape)
    at which all parts of ``model_name`` were measured. ``layers`` restricts the sum to a
    layer list (stack validation); ``core_variants`` pins a variant per core stage.
    ``round_extras``: where the table has a layer kind's commit stage (``COMMIT_STAGE``: the
    GDN state commit, once per layer per round) or round stage (``ROUND_STAGE``: the GDN tree
    metadata, once per round), they are part of every composed step, and a point without
    them is left out; tables without such rows compose without them.  At n = 1 (plain
    decoding: no tree) a kind with decode-step rows (``DECODE_STAGE``) takes that fused step
    in place of its verify core and commit, and no round stage is added."""
    model = get_model(model_name)
    sub = df[df.model == model_name]
    if sub.empty:
        return []
    counts = {}
    for k in (layers or model.layer_kinds):
        counts[k] = counts.get(k, 0) + 1
    core_stages = {k: VERIFY_STAGE[k] for k in counts}
    hashed = sum(1 for i in hash_layers(model) if i < sum(counts.values()))
    cores = sub[sub.stage.isin(core_stages.values())]
    pinned = {s: _main_variant(cores[cores.stage == s]) for s in core_stages.values()}
    pinned.update(core_variants or {})
    if cores.empty:
        return []
    multi_l = sorted({int(l) for s in core_stages.values()
                      for l in sub[sub.stage == s].context_len.unique()
                      if sub[sub.stage == s].context_len.nunique() > 1})
    ls = sorted(set(contexts)) if contexts is not None else (multi_l or sorted(cores.context_len.unique()))
    combos = cores[["batch_size", "nodes_per_seq", "tree_shape"]].drop_duplicates().itertuples(index=False)
    device, dtype = str(sub.device.iloc[0]), str(sub.dtype.iloc[0])
    extras = _extra_stages(sub, counts) if round_extras else {}
    model_round = round_extras and (sub.stage == MODEL_ROUND_STAGE).any()
    out = []
    for b, n, shape in combos:
        b, n, shape = int(b), int(n), str(shape)
        parts = [_lookup_tokens(sub, "lm_head_step", b, n), _lookup_tokens(sub, "mlp_step", b, n)]
        # V4's hash-routed layers: their own MoE stage where measured, else the routed one's
        hmlp = _lookup_tokens(sub, HASH_MLP_STAGE, b, n) if hashed else None
        parts += [_lookup_tokens(sub, f"{k}_proj_step", b, n) for k in counts]
        if any(p is None for p in parts):
            continue
        lm, mlp, projs = parts[0], parts[1], dict(zip(counts, parts[2:]))
        rnd = _lookup_round(sub, b, n, shape) if model_round else None
        if model_round and rnd is None:
            continue
        for l in ls:
            total, reps, ok = lm[0].copy(), [lm[1], mlp[1]], True
            if hmlp is not None:    # hash layers: their MoE in place of the routed one
                total += hashed * (hmlp[0] - mlp[0])
                reps.append(hmlp[1])
            if rnd is not None:   # the round's metadata for every kind, once, plain decoding too
                total += rnd[0]
                reps.append(rnd[1])
            for k, c in counts.items():
                # n = 1 is plain decoding: a fused decode step where measured (it reads and
                # writes the state once), else the verify core and the commit below
                decode = extras.get((k, "decode")) if n == 1 else None
                core = (_lookup_core(sub, decode[0], b, n, int(l), shape, decode[1]) if decode else
                        _lookup_core(sub, core_stages[k], b, n, int(l), shape, pinned.get(core_stages[k])))
                if core is None:
                    ok = False
                    break
                total += c * (core[0] + projs[k][0] + mlp[0])
                reps += [core[1], projs[k][1]]
                for role in ("commit", "round"):   # context-free: measured at one length, any
                    # no tree at n = 1, so no round metadata; no commit after a decode step; the
                    # model-level round stage stands in for the kinds' own where measured
                    if (k, role) not in extras or (n == 1 and (role == "round" or decode)) \
                            or (role == "round" and model_round):
                        continue
                    stage, variant = extras[k, role]
                    extra = _lookup_core(sub, stage, b, n, int(l), shape, variant)
                    if extra is None:
                        ok = False
                        break
                    total += (c if role == "commit" else 1) * extra[0]
                    reps.append(extra[1])
                if not ok:
                    break
            if not ok:
                continue
            out.append({"stage": COMPOSED_STAGE, "model": model_name, "device": device, "dtype": dtype,
                        "variant": COMPOSED_VARIANT, "batch_size": b, "nodes_per_seq": n,
                        "total_tokens": b * n, "context_len": int(l), "tree_shape": shape,
                        "num_steps": 0, "topk": 0, "latency_us_median": float(total[0]),
                        "latency_us_p10": float(min(total[1], total[0])),
                        "latency_us_p90": float(max(total[2], total[0])), "repeats": int(min(reps))})
    return out


def validate_stacks(df: pd.DataFrame) -> dict:
    """Measured stack_verify_step rows vs the composition of the same layers.
    Returns {model: {"points": [...], "median_abs_rel_err": x, "max_abs_rel_err": y}}."""
    report = {}
    stacks = df[df.stage == "stack_verify_step"]
    for (model_name, variant), rows in stacks.groupby(["model", "variant"]):
        model = get_model(model_name)
        try:
            L = int(str(variant).removeprefix("stack"))
        except ValueError:
            continue
        layers = model.stack(L)
        device = "cpu" if str(rows.device.iloc[0]) == "cpu" else "cuda"
        pinned = {VERIFY_STAGE[k]: stack_core_variant(VERIFY_STAGE[k], device)
                  for k in sorted(set(layers))}   # sorted: the same report file every run
        pts = []
        for r in rows.itertuples(index=False):
            # the measured stack times verify steps only (no commit, no round metadata), so
            # does its composition
            comp = compose_rows(df[(df.batch_size == r.batch_size) & (df.nodes_per_seq == r.nodes_per_seq)],
                                model_name, layers=layers, core_variants=pinned, contexts=[r.context_len],
                                round_extras=False)
            comp = [c for c in comp if c["tree_shape"] == r.tree_shape]
            if not comp:
                continue
            pred = comp[0]["latency_us_median"]
            pts.append({"batch_size": int(r.batch_size), "nodes_per_seq": int(r.nodes_per_seq),
                        "context_len": int(r.context_len), "tree_shape": r.tree_shape,
                        "measured_us": round(float(r.latency_us_median), 2), "composed_us": round(pred, 2),
                        "rel_err": round(pred / float(r.latency_us_median) - 1, 4)})
        errs = np.abs([p["rel_err"] for p in pts]) if pts else np.array([np.nan])
        report[f"{model_name}/{variant}"] = {
            "layers": list(layers), "core_variants": pinned, "points": pts,
            "median_abs_rel_err": None if not pts else round(float(np.median(errs)), 4),
            "max_abs_rel_err": None if not pts else round(float(np.max(errs)), 4)}
    return report


def _rewrite(path: Path, df: pd.DataFrame) -> None:
    from simtree.costs import profile_table as pt

    pt.write_table(path, pt.validate_profile(df.reset_index(drop=True), path))


def compose_table(table: str | Path, stack_layers: int = 8, core_variants: dict | None = None) -> dict:
    """Replace the composed rows of ``table`` by a fresh composition of every model in it,
    write ``<table>.compose.json`` with the stack validation, return that summary.
    ``core_variants`` ({stage: variant}) pins the attention-core implementation, e.g.
    ``{"v4_csa_verify": "triton_tree"}``; by default the best-covered preferred one."""
    from simtree.costs import profile_table as pt

    table = Path(table)
    df = pt.load_profile(table)
    df = df[~((df.stage == COMPOSED_STAGE) & (df.variant == COMPOSED_VARIANT))]
    measured = df[df.stage != COMPOSED_STAGE]
    rows = []
    for model_name in sorted(measured.model.unique()):
        try:
            rows += compose_rows(measured, model_name, core_variants=core_variants)
        except SimtreeError:
            continue  # a model name that is not in the registry: nothing to compose
    now = pd.Timestamp.now(tz="UTC").isoformat(timespec="seconds")
    if rows:
        new = pd.DataFrame(rows)
        new["torch_version"] = str(measured.torch_version.iloc[0])
        new["triton_version"] = str(measured.triton_version.iloc[0])
        new["timestamp"] = now
        df = pd.concat([df, new[list(pt.PROFILE_COLUMNS)]], ignore_index=True)
    _rewrite(table, df)
    models = sorted({r["model"] for r in rows})
    summary = {"composed_rows": len(rows), "models": models,
               "core_variants": core_variants or "auto",
               "round_extras": {m: round_extras_used(measured, m) for m in models},
               "stack_validation": validate_stacks(measured)}
    write_text_atomic(pt.side_path(table, "compose.json"), json.dumps(summary, indent=2))
    meta = pt.read_meta(table)
    if meta:   # the table's sidecar says how its composed rows were made too
        pt.write_meta(table, {**meta, "compose": summary})
    return summary
