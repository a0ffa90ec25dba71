"""README.md is the user's document: short, its layout table complete, and its headline table
(and reports/README.md, the index of report folders) the output of `simtree report --summary`
on the committed report data, never a stale copy."""
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from simtree.cli import app
from simtree.errors import SimtreeError
from simtree.reporting import summary

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIX = "run `simtree report --summary --write` in the repository root and commit the result"


def _block(text: str) -> str:
    return text.split(summary.START + "\n", 1)[1].split(summary.END, 1)[0]


def test_readme_headline_table_is_current():
    assert _block(README.read_text()) == summary.summary_table(ROOT), f"README.md's table is stale: {FIX}"


def test_reports_index_is_current():
    assert (ROOT / "reports" / "README.md").read_text() == summary.reports_index(ROOT), \
        f"reports/README.md is stale: {FIX}"


def test_every_report_folder_is_indexed_and_every_indexed_folder_exists():
    tracked = subprocess.run(["git", "ls-files", "reports"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    # a report folder = a folder under reports/ whose README names its command
    folders = {str(Path(p).parent) for p in tracked.stdout.split() if p.endswith("/README.md")} - {"reports"}
    indexed = {f.path for f in summary.FOLDERS}
    assert folders <= indexed, f"report folders without a line in the index: {sorted(folders - indexed)}"
    for path in indexed:
        assert (ROOT / path).is_dir(), path


def test_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_layout_table_names_every_top_level_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    top = {p.split("/", 1)[0] for p in tracked.stdout.split() if "/" in p and not p.startswith(".")}
    layout = README.read_text().split("## Layout", 1)[1]
    rows = {line.split("|")[1].strip().strip("`").rstrip("/") for line in layout.splitlines()
            if line.startswith("| `")}
    assert top <= rows, f"top-level folders missing from README's layout table: {sorted(top - rows)}"
    assert rows <= top, f"layout table names folders that do not exist: {sorted(rows - top)}"


def test_layout_table_and_package_docstring_name_every_sub_folder():
    # each package folder's row names its sub-packages (``deploy/``, ``layers/``, ``full/``, ...),
    # and simtree/__init__'s docstring names every one of them, as ``simtree.<name>``
    import simtree
    layout = README.read_text().split("## Layout", 1)[1]
    rows = {line.split("|")[1].strip().strip("`").rstrip("/"): line for line in layout.splitlines()
            if line.startswith("| `")}
    missing = [f"{top}/{sub.name}/" for top in ("simtree", "kernels", "runtime", "profiler")
               for sub in sorted((ROOT / top).iterdir()) if (sub / "__init__.py").is_file()
               and f"`{sub.name}/`" not in rows[top]]
    assert missing == [], f"README's layout table leaves out {missing}"
    doc = simtree.__doc__
    named = [f"simtree.{sub.name}" for sub in sorted((ROOT / "simtree").iterdir())
             if (sub / "__init__.py").is_file() or sub.suffix == ".py" and not sub.name.startswith("_")]
    named = [n.removesuffix(".py") for n in named]
    named += [f"simtree.{top}.{sub.name}" for top in ("kernels", "runtime", "profiler")
              for sub in sorted((ROOT / top).iterdir()) if (sub / "__init__.py").is_file()]
    assert [n for n in named if n not in doc] == []


def test_every_doc_the_readme_lists_exists_or_is_being_written():
    listed = [line.split("`")[1] for line in README.read_text().split("## Documentation", 1)[1]
              .split("## Layout", 1)[0].splitlines() if line.startswith("| `docs/")]
    missing = [p for p in listed if not (ROOT / p).is_file()]
    assert set(missing) <= {"docs/kernels/gdn_launch.md"}, missing   # the kernels' launch table lands with them


def _loop_folder(tmp_path: Path, errors, chosen_best: bool) -> Path:
    rows = ["batch_size,role,measured_tok_s,err_tok_s"]
    for i, err in enumerate(errors):
        b = 1 + i // 2
        role = "chosen" if i % 2 == 0 else "linear"
        fast = (role == "chosen") == chosen_best
        rows.append(f"{b},{role},{200.0 if fast else 100.0},{err}")
    (tmp_path / "loop_results.csv").write_text("\n".join(rows) + "\n")
    return tmp_path


def test_loop_headline_is_read_from_the_runs(tmp_path):
    errors = [random.uniform(-0.5, 0.5) for _ in range(6)]
    line = summary.loop_headline(_loop_folder(tmp_path, errors, chosen_best=True))
    med = sorted(abs(e) for e in errors)
    assert f"median error {100 * (med[2] + med[3]) / 2:.0f}%" in line
    assert f"max {100 * med[-1]:.0f}%" in line and "over 6 runs" in line
    assert "best at 3 of 3 batch sizes" in line
    assert "best at 0 of 3" in summary.loop_headline(_loop_folder(tmp_path, errors, chosen_best=False))


def test_modes_headline_counts_the_plans_points_and_the_lossless_checks(tmp_path):
    import pandas as pd
    pd.DataFrame({"model": ["m"] * 4, "batch_size": [1, 1, 4, 4], "gpu": ["G"] * 4,
                  "mode": ["none", "block", "eagle", "tfm"], "plan_choice": [False, True, False, True],
                  "plan_over_best": [0.97, 0.97, 1.0, 1.0]}).to_csv(tmp_path / "modes.csv", index=False)
    pd.DataFrame({"dtype": ["bf16"] * 3, "match": [True, False, False], "near_tie": [False, True, False],
                  "margin": [None, 0.01, 0.4], "deviation": [None, 0.02, 0.01]}).to_csv(tmp_path / "lossless.csv",
                                                                                      index=False)
    assert summary.modes_headline(tmp_path) == (
        "3 modes (block, eagle, tfm) beside plain and linear D=4, decoded at full scale under replayed acceptance "
        "on G (m at batch 1, 4): the plan's choice best or within 2% at 1 of 2 (model, batch) points whose plan "
        "priced what ran (worst 0.970 of the best measured); bf16 lossless: 1 of 3 mode checks match plain greedy, 1 near-tie (top-2 gap 0.0100 "
        "within twice the verify-vs-decode deviation 0.0200), 1 differ beyond one")


def test_live_lossless_is_counted_per_dtype_and_names_cut_models():
    import pandas as pd
    rows = pd.DataFrame({"model": ["qwen3.6-27b"] * 3 + ["deepseek-v4-flash"] * 2,
                         "dtype": ["bf16", "bf16", "fp32", "fp32", "bf16"],
                         "layers": ["64/64", "64/64", "64/64", "24/43", "43/43"],
                         "match": [True, False, True, True, True], "margin": [None, 0.004, None, None, None]})
    assert summary._lossless_by_dtype(rows) == (
        "lossless in bf16 2 of 3 policy checks match plain greedy (largest plain top-2 gap where one differs "
        "0.0040); lossless in fp32 2 of 2 policy checks match plain greedy (DeepSeek-V4-Flash 24/43 layers)")


def test_validation_headline_counts_the_frozen_bundles_choice_per_point(tmp_path):
    import pandas as pd
    rows = []
    # six policies per point: a and b as written, four slower fillers predicted and measured alike
    fill = tuple((50 + i, 50 + i) for i in range(summary.MIN_POLICIES - 2))
    for ctx, toks in ((1024, ((100, 110), (120, 118)) + fill), (4096, ((100, 95), (120, 130)) + fill),
                      (16384, ((100, 92), (120, 130)))):   # too few policies: listed, not counted
        for policy, (measured, predicted) in zip("abcdef", toks):
            rows.append({"model": "qwen3.6-27b", "deployment": "1 GPU", "policy": policy, "batch_size": 2,
                         "context_len": ctx, "measured_tok_s": measured, "predicted_tok_s": predicted,
                         "rel_err": predicted / measured - 1, "gpu": "NVIDIA H100 80GB HBM3"})
    pd.DataFrame(rows).to_csv(tmp_path / "throughput_out_of_sample.csv", index=False)
    line = summary.validation_headline(tmp_path)
    # at 1024 the bundle picks b (118 predicted > 110) and b is the measured best; at 4096 it picks b too
    assert "the frozen bundle's choice best or within 2% at 2 of 2 points with at least 6 policies" in line
    assert "worst 10.0% (Qwen3.6-27B batch 2 at context 1024" in line
    assert f"over {len(rows)} runs" in line and "H100" in line


def test_write_refreshes_a_stale_copy_and_refuses_a_readme_without_markers(tmp_path):
    for name in ("reports", "simtree/data/profiles/h200"):
        shutil.copytree(ROOT / name, tmp_path / name)
    (tmp_path / "README.md").write_text(f"# x\n{summary.START}\n| stale |\n{summary.END}\ntail\n")
    (tmp_path / "reports" / "README.md").write_text("stale\n")
    result = CliRunner().invoke(app, ["report", "--summary", "--write", "--root", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "README.md").read_text()
    assert _block(text) == summary.summary_table(tmp_path) and text.endswith("\ntail\n")
    assert (tmp_path / "reports" / "README.md").read_text() == summary.reports_index(tmp_path)
    with pytest.raises(SimtreeError, match="needs one"):
        summary.replace_block("no markers here\n", "| x |\n")


def test_cli_prints_the_table_and_json():
    out = CliRunner().invoke(app, ["report", "--summary", "--root", str(ROOT)])
    assert out.exit_code == 0 and out.output == summary.summary_table(ROOT)
    rows = json.loads(CliRunner().invoke(app, ["report", "--summary", "--json", "--root", str(ROOT)]).output)
    assert [r["folder"] for r in rows] == [f.path for f in summary.FOLDERS]


def test_a_report_file_missing_its_fields_is_one_error_naming_the_folder(tmp_path):
    for name in ("reports", "simtree/data/profiles/h200"):
        shutil.copytree(ROOT / name, tmp_path / name)
    (tmp_path / "reports/h200/v4/summary_v4.json").write_text(json.dumps({"by_attention": {}}))
    with pytest.raises(SimtreeError, match="reports/h200/v4: .*KeyError"):
        summary.summary_table(tmp_path)


def test_acceptance_line_reports_each_split_family_alone():
    import pandas as pd
    rows = [("policies", "sharegpt", 0.01), ("policies", "sharegpt", -0.05), ("policies", "humaneval", 0.02),
            ("prompts", "sharegpt", 0.0), ("workload", "humaneval", -0.20), ("in_sample", "sharegpt", 0.5)]
    acc = pd.DataFrame([{"split": s, "workload": w, "rel_err": e, "prompts": "seen" if w == "humaneval" else "fresh"}
                        for s, w, e in rows])
    line = summary.acceptance_oos_line(acc)
    assert "chat linear -> chat trees (fresh prompts) median 3.0%, worst 5.0% (2 rows)" in line
    assert ("chat linear -> code, every policy (HumanEval) (seen prompts) median 20.0%, worst 20.0% (1 rows), short of "
            "the 3% median target and 8% worst target" in line)
    assert "code linear -> code trees (HumanEval) (seen prompts) median 2.0%, worst 2.0% (1 rows);" in line  # both met
    assert "code linear -> code linear" not in line and "50.0%" not in line    # absent family; in sample apart
    # pooled: the out-of-sample rows on fresh prompts alone (the seen HumanEval rows and in-sample row left out)
    assert ("pooled over its 3 out-of-sample rows on fresh prompts median 1.0%, worst 5.0% (targets 3% / 8%: met); "
            "by family: chat linear -> chat trees" in line)
    worse = acc.assign(rel_err=acc["rel_err"].where(acc["prompts"] != "fresh", 0.09))
    assert "fresh prompts median 9.0%, worst 9.0% (targets 3% / 8%: short)" in summary.acceptance_oos_line(worse)


def test_acceptance_line_reads_the_shipped_table_family_by_family():
    """Every family the shipped table holds is in the line, in the words the table's module gives it."""
    from simtree.acceptance.out_of_sample import FAMILIES
    acc = summary._csv(ROOT / "reports/validation/acceptance_out_of_sample.csv")
    line = summary.acceptance_oos_line(acc)
    held = {(s, w) if d == "mtp" else (s, w, d) for s, w, d in zip(acc["split"], acc["workload"], acc["drafter"])}
    assert [w for k, w in FAMILIES.items() if k in held] == [w for w in FAMILIES.values() if f"{w} (" in line or
                                                             f"{w} median" in line]
    assert {k for k in held if k[0] != "in_sample"} <= set(FAMILIES)


def test_serving_headline_adds_the_full_scale_live_run_only_where_it_ran(tmp_path):
    """The serving row names the full-scale live run's worst phase (predicted over measured TPOT - 1,
    as its report computes it) when serve_live_full.csv is beside bench.csv, nothing without it, and
    a run the report refuses (here: no bundle hash, so not shown frozen) is one line, not a claim."""
    import pandas as pd
    d = tmp_path / "bench_serve"
    d.mkdir()
    shutil.copy(ROOT / "reports/bench_serve/bench.csv", d / "bench.csv")
    without = summary.bench_serve_headline(d)
    assert "live at full scale" not in without
    run = pd.read_csv(ROOT / "reports/bench_serve/serve_live_full.csv")
    for kept in (ROOT / "reports/bench_serve").glob("frozen_*"):   # the runs' bundles, once the shipped ones moved on
        shutil.copy(kept, d / kept.name)
    run["measured_tpot_ms"] = 10.0
    run["predicted_tpot_ms"] = [10.0, 10.5, 10.0, 9.8, 10.0, 10.0]
    run.to_csv(d / "serve_live_full.csv", index=False)
    line = summary.bench_serve_headline(d)
    assert line.startswith(without)
    assert line[len(without):] == ("; live at full scale (Qwen3.6-27B bf16 on NVIDIA H100 80GB HBM3, batch changing "
                                   "1, 16, 4, 8, 16, 1; the shipped bundle of the time, kept beside it, out of "
                                   "sample: measured TPOT vs "
                                   "predicted 5.0% at worst over 6 phases)")
    v4 = pd.read_csv(ROOT / "reports/bench_serve/serve_live_full_v4.csv")   # a second family's run: a clause each
    v4.assign(measured_tpot_ms=10.0, predicted_tpot_ms=[10.0, 10.0, 9.7, 10.0, 10.0, 10.0]).to_csv(
        d / "serve_live_full_v4.csv", index=False)
    both = summary.bench_serve_headline(d)
    assert both.startswith(line[:-1]) and both.endswith("; DeepSeek-V4-Flash bf16, FP8 experts on NVIDIA H100 80GB HBM3, batch "
                                                        "changing 1, 16, 4, 8, 16, 1; the shipped bundle of the time, "
                                                        "kept beside it, out of sample: measured TPOT vs predicted 3.0% "
                                                        "at worst over 6 phases)")
    v4.to_csv(d / "serve_live_full_v4b.csv", index=False)      # a second run of one model: refused in one line
    with pytest.raises(SimtreeError, match="a second full-scale live run of deepseek-v4-flash"):
        summary.bench_serve_headline(d)
    for extra in ("serve_live_full_v4.csv", "serve_live_full_v4b.csv"):
        (d / extra).unlink()
    run.drop(columns=["costs_sha256"]).to_csv(d / "serve_live_full.csv", index=False)
    with pytest.raises(SimtreeError, match="not a full-scale run"):
        summary.bench_serve_headline(d)
