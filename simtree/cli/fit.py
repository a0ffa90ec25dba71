"""``simtree fit``: profile table -> monotone cost models (CostBundle JSON) + PNG.

Convex in n, except an MoE model's expert-saturation forms, which are flagged when kept."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from simtree.cli import COMMANDS
from simtree.cli.notes import output_console
from simtree.costs.forms import MOE_FORMS
from simtree.costs.verify_cells import CELLS_KEY


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _print_report(report, console: Console) -> None:
    table = Table(title="relative error: held-out (k-fold) and in-sample of the kept form")
    for col in ("cost", "stage", "variant", "form", "convex", "pts", "ho med", "ho p90", "in p90", "in max"):
        left = col in ("cost", "stage", "variant", "form", "convex")
        table.add_column(col, justify="left" if left else "right")
    for name, res, m in (("C_v", report.verify, report.bundle.verify),
                         ("C_d", report.draft, report.bundle.draft)):
        src = m.info.get("source", {})
        label = (src.get("stage", "?"), src.get("variant", "-"))
        if res is None:
            convex = "yes" if getattr(m.surface, "convex_in_x", True) else "NO"
            table.add_row(name, *label, "assumed from C_v", convex, "-", "-", "-", "-", "-")
            continue
        for form, err in res.heldout.items():
            kept = form == res.form
            tag = "*" if kept else (f" (ref, {100 * err['monotone_violations']:.0f}% non-monotone)"
                                    if err.get("reference") else "")
            table.add_row(name, *label, form + tag, "NO" if form in MOE_FORMS else "yes", str(res.num_points),
                          _pct(err["median"]), _pct(err["p90"]),
                          _pct(res.in_sample["p90"]) if kept else "", _pct(res.in_sample["max"]) if kept else "")
    console.print(table)
    console.print("* kept: lower held-out median + p90; grid_lin: grid whose cells without data follow "
                  "a piecewise-linear continuation in l (C_v) / steps (C_d); ref: per-(l, b) convex curves "
                  "interpolated between bins (public practice), shown for comparison, never kept; "
                  "convex: in n (C_v) or topk (C_d), NO for the MoE expert-saturation forms")
    for name, res in (("C_v", report.verify), ("C_d", report.draft)):
        if res is None:
            continue
        for rows, title in ((res.worst, "worst in-sample residuals (data least convex / monotone)"),
                            (res.worst_heldout, f"worst held-out residuals of {res.form} (k-fold)")):
            worst = Table(title=f"{name}: {title}")
            keys = list(rows[0].keys()) if rows else []
            for k in keys:
                worst.add_column(k, justify="right")
            for w in rows:
                worst.add_row(*(f"{100 * v:+.1f}%" if k == "rel_err" else f"{v:g}" for k, v in w.items()))
            console.print(worst)
    _print_cells(report.bundle.verify.info.get(CELLS_KEY), console)
    for note in report.notes + report.verify.notes + (report.draft.notes if report.draft else []):
        console.print(f"note: {note}")
    consequence = {"C_v": "adaptive budgets take the global argmax of the objective, not the first stop",
                   "C_d": "C_d is only read at fixed (steps, topk), no stop rule depends on it"}
    verify, draft = report.bundle.verify, report.bundle.draft
    for name, m, convex, key, axis in (("C_v", verify, verify.convex_in_n, "convex_in_n", "n"),
                                       ("C_d", draft, draft.convex_in_topk, "convex_in_topk", "topk")):
        if not convex:    # the model's own reading of its surface and info (old bundles included)
            console.print(f"[bold yellow]warning:[/] {name} is NOT convex in {axis} ({key}: false): "
                          f"{m.info.get('nonconvex_reason', 'see notes')}; {consequence[name]}",
                          highlight=False)
    for line in report.misfit_warnings():
        console.print(f"[bold yellow]warning:[/] {line}", highlight=False)


def _print_cells(record, console: Console) -> None:
    """The measured cells C_v is corrected at (batch, nodes, offset, measured / fitted at each timed
    context), if any."""
    if not record or not record.get("offset_us"):
        return
    table = Table(title="C_v: corrected measured cells", min_width=40)
    for col in ("batch", "nodes", "offset", "measured / fitted"):
        table.add_column(col, justify="right")
    ratio = record.get("ratio") or {}
    for b, cells in sorted(record["offset_us"].items(), key=lambda x: int(x[0])):
        for n, c in sorted(cells.items(), key=lambda x: int(x[0])):
            at = (ratio.get(b) or {}).get(n) or {}
            table.add_row(b, n, f"{c / 1000:+.2f} ms", ", ".join(f"{r:.3f} (l={l})" for l, r in at.items()))
    console.print(table)
    console.print(f"offset: measured - fitted C_v, the one nearest 0 over the contexts the cell was timed at, where "
                  f"measured / fitted is beyond {100 * record['min_excess']:g}% on one side at every one; C_v there "
                  "is the fit plus the offset at every context (the kernel's excess does not grow with l), and a "
                  "round the pad map sends to a corrected cell is priced as that cell")


def _print_comm(model, path: Path, as_json: bool) -> None:
    """The fitted alpha-beta parameters, one row per collective and group size."""
    if as_json:
        typer.echo(json.dumps({**model.to_dict(), "output": str(path)}, indent=1))
        return
    table = Table(title=f"communication model ({model.label}): t = alpha + f(g) * bytes / busbw")
    for col in ("collective", "group", "alpha us", "busbw GB/s", "points", "median |err|", "max |err|"):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for coll, groups in model.collectives.items():
        for g, p in sorted(groups.items()):
            f = model.fit.get(coll, {}).get(str(g), {})
            table.add_row(coll, str(g), f"{p.alpha_us:.2f}", f"{p.busbw_gb_s:.1f}", str(f.get("points", "-")),
                          _pct(f.get("median_rel_err")), _pct(f.get("max_rel_err")))
    console = output_console()
    console.print(table)
    console.print(f"wrote {path}")


def _check_outputs(profile: Path, out: Path, png: Path | None) -> None:
    """Refuse outputs that would overwrite the profile or its side files, or a plot path
    matplotlib cannot write as PNG, before any fitting."""
    from simtree.errors import SimtreeError
    from simtree.costs.profile_table import SIDE_FILES, side_path

    inputs = {p.resolve() for p in (profile, *(side_path(profile, kind) for kind in SIDE_FILES))}
    for flag, path in (("--out", out), ("--png", png)):
        if path is not None and path.resolve() in inputs:
            raise SimtreeError(f"{flag} {path} would overwrite the profile table or its side files")
        if path is not None and path.is_dir():
            raise SimtreeError(f"{flag} {path} is a folder; give a file path")
    if png is not None and png.suffix.lower() != ".png":
        raise SimtreeError(f"--png must name a .png file, got {png}")
    if out.resolve() == (png.resolve() if png is not None else None):
        raise SimtreeError(f"--out and --png are the same file: {out}")


def _default_out(profile: Path) -> Path:
    """<stem>.costs.json beside the profile; a table shipped in the package (simtree/data) keeps
    its folder clean: reports/fit/<stem>.costs.json under the working directory."""
    from simtree.data import data_path

    if data_path().resolve() in profile.resolve().parents:
        return Path("reports") / "fit" / (profile.stem + ".costs.json")
    return profile.with_name(profile.stem + ".costs.json")


def register(app: typer.Typer) -> None:
    @app.command("fit", help=COMMANDS["fit"] + "\n\nExample: simtree fit my_gpu/profile.csv -o my_gpu/costs.json")
    def fit(
        profile: Path = typer.Argument(..., help="Profile table CSV (simtree profile output)."),
        out: Optional[Path] = typer.Option(None, "-o", "--out",
                                           help="CostBundle JSON to write (default: PROFILE's folder, <stem>.costs.json; "
                                                "reports/fit/ for a table shipped in the package)."),
        stage: Optional[str] = typer.Option(None, help="Verify stage to fit (default model_verify_step)."),
        model: Optional[str] = typer.Option(None, help="Model name when the table holds several."),
        variant: Optional[str] = typer.Option(None, help="Verify implementation when several."),
        device: Optional[str] = typer.Option(None, help="Device when the table holds several."),
        dtype: Optional[str] = typer.Option(None, help="dtype when the table holds several."),
        draft_variant: Optional[str] = typer.Option(None, help="draft_step implementation when several."),
        draft_from_verify: bool = typer.Option(
            False, help="Without draft_step rows, assume C_d(s,k,b) = fraction * s * C_v(k, l_median, b)."),
        draft_fraction: float = typer.Option(0.05, help="Draft step cost as a fraction of a verify step."),
        form: str = typer.Option("auto", help="Model form: auto (best held-out of basis, grid, grid_lin and, "
                                 "for an MoE model, moe, moe_grid and moe_grid_free; plain decoding's own curve over "
                                 "batch also grid_mono, not convex in batch), basis, grid, grid_lin, moe, moe_grid, "
                                 "moe_grid_free."),
        folds: int = typer.Option(5, min=2, help="Folds for the held-out error."),
        moe_routing: Optional[str] = typer.Option(
            None, help="MoE models: how the profile's MoE layers routed, uniform (E(1-(1-k/E)^T) experts "
                       "touched) or balanced (min(T k, E)); default the table's .meta.json (balanced for the "
                       "profiler's MoE piece swept before it was recorded, uniform for the runtime's layers "
                       "and tables without a sidecar)."),
        png: Optional[Path] = typer.Option(None, help="Plot path (default: OUT with .png)."),
        no_png: bool = typer.Option(False, "--no-png", help="Do not write the plot."),
        bench: bool = typer.Option(False, help="Also time predict() (us per scalar call)."),
        as_json: bool = typer.Option(False, "--json", help="Print the evaluation as JSON."),
        deployment: Optional[str] = typer.Option(None, "--deployment", help="The rank's deployment whose rows to "
                                                 "fit (tp=2, ep=8) when the table holds several."),
        comm: Optional[Path] = typer.Option(None, "--comm", help="Communication model (.comm.json) the bundle "
                                            "records for a deployment of several GPUs (default: fitted from the "
                                            "table's collective rows, else the machine's assumed one)."),
        verify_pad: bool = typer.Option(True, "--verify-pad/--no-verify-pad",
                                        help="Fit C_v on the lower envelope in n and keep the pad map (a round of n "
                                             "nodes verified at a larger measured n' that is cheaper at its batch; "
                                             "simtree.costs.verify_pad), or fit the rows as measured."),
        pad_min_saving: float = typer.Option(0.02, help="The least relative saving that pads a round (0 < s < 1)."),
        verify_cells: bool = typer.Option(True, "--verify-cells/--no-verify-cells",
                                          help="Correct C_v at the measured (batch, nodes) cells the fit misses by at "
                                               "least --cells-min-excess at every context (the excess nearest 0, "
                                               "in us; "
                                               "simtree.costs.verify_cells), or keep the fitted surface alone."),
        cells_min_excess: float = typer.Option(0.02, help="The least relative miss that corrects a cell (0 < e < 1)."),
    ) -> None:
        """Fit monotone C_v(n, l, batch) and C_d(s, k, batch) to a profile table: convex in n,
        except an MoE model's expert-saturation forms, which are reported when kept.

        Example: simtree fit reports/h200/profile.csv -o reports/h200/costs.json --stage gdn_tree_verify

        A table of collective rows (the collectives profile stage) gives the alpha-beta model of
        each collective and group size (<stem>.comm.json): simtree fit reports/comm/profile.csv
        """
        from simtree.errors import SimtreeError
        from simtree.costs.profile_fit import (AUTO_FORMS, bench_predict, check_fit_options, fit_profile, moe_shape,
                                               plot_fit)
        from simtree.costs.profile_table import load_profile
        from simtree.costs.comm import COMM_STAGES, fit_comm_profile, load_comm

        # every option first, then the table and the fits; files are written only once all of them are done
        if form not in ("auto", *AUTO_FORMS, *MOE_FORMS):
            raise SimtreeError(f"--form must be auto, {', '.join(AUTO_FORMS + MOE_FORMS)}; got {form!r}")
        check_fit_options(moe_routing=moe_routing, deployment=deployment, draft_from_verify=draft_from_verify,
                          draft_fraction=draft_fraction, verify_pad=verify_pad, pad_min_saving=pad_min_saving,
                          verify_cells=verify_cells, cells_min_excess=cells_min_excess)
        given_comm = None if comm is None else load_comm(comm)
        stages = set(load_profile(profile)["stage"])
        measured_comm = comm_out = None
        if stages & set(COMM_STAGES.values()):
            measured_comm = fit_comm_profile(profile)
            if not stages - set(COMM_STAGES.values()):   # collectives only: the communication model is the fit
                comm_out = out or profile.with_name(profile.stem + ".comm.json")
                _check_outputs(profile, comm_out, None)
                measured_comm.save(comm_out)
                _print_comm(measured_comm, comm_out, as_json)
                return
            comm_out = (out or profile.with_name(profile.stem + ".costs.json")).with_suffix(".comm.json")
            _check_outputs(profile, comm_out, None)
        out = out or _default_out(profile)
        png = None if no_png else (png or out.with_suffix(".png"))
        _check_outputs(profile, out, png)
        forms = None if form == "auto" else (form,)
        reference = ("per_bin",) if form == "auto" else ()
        # solves per fit (bar length); MoE forms counted unless --model names a dense model
        with_moe = model is None or moe_shape(model) is not None
        num_forms = 1 if forms else len(AUTO_FORMS) + len(MOE_FORMS) * with_moe
        console = output_console(stderr=as_json)
        # no bar where nothing redraws it (a pipe, a log): its exit would leave an empty line
        with Progress(TextColumn("fitting"), BarColumn(), TextColumn("{task.completed}/{task.total} solves"),
                      TimeElapsedColumn(), console=console, transient=True,
                      disable=not console.is_terminal) as progress:
            task = progress.add_task("fit", total=2 * ((num_forms + len(reference)) * folds + 1 + len(reference)))
            report = fit_profile(profile, stage=stage, model=model, variant=variant, device=device, dtype=dtype,
                                 draft_variant=draft_variant, draft_from_verify=draft_from_verify,
                                 draft_fraction=draft_fraction, forms=forms, folds=folds,
                                 reference_forms=reference, deployment=deployment,
                                 comm=given_comm, measured_comm=measured_comm, moe_routing=moe_routing,
                                 verify_pad=verify_pad, pad_min_saving=pad_min_saving,
                                 verify_cells=verify_cells, cells_min_excess=cells_min_excess,
                                 on_fit=lambda: progress.advance(task),
                                 on_more_solves=lambda k: progress.update(
                                     task, total=progress.tasks[0].total + k))
        if measured_comm is not None:
            measured_comm.save(comm_out)
            if not as_json:
                _print_comm(measured_comm, comm_out, False)
        report.bundle.save(out)
        png_path = None if png is None else plot_fit(report, png)
        summary = report.summary()
        if bench:
            summary["bench"] = bench_predict(report.bundle)
        if as_json:
            typer.echo(json.dumps({**summary, "output": str(out), "png": str(png_path) if png_path else None},
                                  indent=1, default=str))
            return
        _print_report(report, console)
        if bench:
            b = summary["bench"]
            console.print(f"predict: verify {b['verify_scalar_us']:.2f} us, draft {b['draft_scalar_us']:.2f} us "
                          f"per scalar call; {b['verify_vector1024_us']:.1f} us per 1024-point call")
        v = report.verify
        d = report.draft
        dtxt = (f"draft {d.form} (held-out median {_pct(d.heldout[d.form]['median'])}, "
                f"p90 {_pct(d.heldout[d.form]['p90'])})" if d else "draft assumed from verify")
        vconvex = "" if report.bundle.verify.convex_in_n else ", NOT convex in n"
        cells = report.bundle.verify.info.get(CELLS_KEY)
        if cells and cells.get("offset_us"):
            vconvex += (f"; {sum(map(len, cells['offset_us'].values()))} measured cells corrected, held-out median "
                        f"{_pct(cells['heldout']['median'])}, p90 {_pct(cells['heldout']['p90'])}")
        console.print(f"wrote {out}" + (f" and {png_path}" if png_path else "") +
                      f": verify {v.form} (held-out median {_pct(v.heldout[v.form]['median'])}, "
                      f"p90 {_pct(v.heldout[v.form]['p90'])}{vconvex}), {dtxt}")
