"""Throughput out of sample: the frozen bundle (with the block drafters' C_d), the GPU-side run of
every runnable mode on a tiny model on the CPU, and the home-side table."""
import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from simtree.costs.model import load_costs
from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import file_sha256
from simtree.planning.modes import BLOCK_DRAFTER_MODES
from simtree.reporting.summary import MIN_POLICIES, plan_points
from simtree.runtime.full import oos, oos_report

BUNDLE = data_path("costs", "h200_qwen3.6-27b_tp1.json")
ROOT = Path(__file__).resolve().parents[1]
DRAFTER_PROFILE = ROOT / "reports" / "h100" / "drafters_profile.csv"
RUN = {"contexts": (32,), "batch_sizes": (2,), "device": "cpu", "max_seconds": 120, "min_draws": 2, "rounds": 2}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run against the shipped bundle, which holds no drafter fits."""
    out = tmp_path_factory.mktemp("oos")
    assert oos.run("tiny-gdn", str(BUNDLE), out, **RUN) == 0
    return out


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen") / "frozen.json"
    assert oos.main(["freeze", "--model", "qwen3.6-27b", "--costs", str(BUNDLE), "--drafter-profile",
                     str(DRAFTER_PROFILE), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def modes_dir(tmp_path_factory, frozen):
    """A run of every mode against the frozen bundle with drafters."""
    out = tmp_path_factory.mktemp("oos_modes")
    assert oos.run("tiny-gdn", str(frozen), out, **RUN) == 0
    return out


def _csv_rows(folder):
    return list(csv.DictReader(open(folder / "throughput_out_of_sample.csv")))


def test_freeze_writes_the_shipped_bundle_with_the_drafters_c_d(frozen):
    """One bundle: the shipped C_v and MTP C_d unchanged, every block drafter's C_d fitted from the
    drafter profile (its sha256 in each fit's source, as the grid check finds it), and what it was
    built from in meta.frozen."""
    from simtree.runtime.full.modes_gpu import drafter_bundle
    got, shipped = load_costs(frozen), load_costs(BUNDLE)
    assert set(got.drafters) == set(BLOCK_DRAFTER_MODES)
    assert got.verify.to_dict() == shipped.verify.to_dict() and got.draft.to_dict() == shipped.draft.to_dict()
    want, _ = drafter_bundle(str(BUNDLE), str(DRAFTER_PROFILE), "qwen3.6-27b")
    for fam, m in got.drafters.items():
        x, y = (4, 7) if fam == "dspark" else (8, 7)       # on each family's axes (dspark: top-K, block length)
        assert m.predict(x, y, 8, 600) == want.drafters[fam].predict(x, y, 8, 600)
        assert m.info["source"]["sha256"] == "sha256:" + file_sha256(DRAFTER_PROFILE)
    info = json.loads(frozen.read_text())["meta"]["frozen"]
    assert info["costs_sha256"] == file_sha256(BUNDLE) and info["drafter_profile_sha256"] == file_sha256(DRAFTER_PROFILE)
    assert info["drafters"] == sorted(BLOCK_DRAFTER_MODES)
    # the H200 bundle beside H100 drafter timings: said
    assert any(n.startswith("ASSUMPTION: the drafters were timed on NVIDIA H100") for n in info["notes"])
    assert set(oos_report._grid(frozen)["drafters"]) == set(BLOCK_DRAFTER_MODES)


def test_every_mode_is_measured_and_predicted_from_the_frozen_bundle(modes_dir, frozen, tmp_path):
    stats = oos.report([modes_dir], tmp_path, {file_sha256(frozen): str(frozen)})
    rows = _csv_rows(tmp_path)
    want = ["plain:none", "linear_d4:linear_d4"] + [f"{label}:{spec.name}" for label, spec in oos.policies()]
    assert [r["policy"] for r in rows] == want and len(want) == len(set(want)) == 16
    assert all(math.isfinite(float(r["predicted_tok_s"])) and float(r["predicted_tok_s"]) > 0 for r in rows)
    assert {r["bundle_sha256"] for r in rows} == {file_sha256(frozen)}
    # the per-mode table: every mode the runtime builds, the block drafters among them
    modes = ("none", "linear", "eagle", "best_first", "cost_aware", "batch_alloc", "block", "tfm", "dspark")
    assert set(stats["per_mode"]) == set(modes)
    assert stats["per_mode"]["eagle"]["runs"] == 5 and stats["per_mode"]["block"]["runs"] == 2
    md = (tmp_path / "summary.md").read_text()
    assert "Per mode" in md and "| dspark | block drafter | 2 |" in md and "| best_first | MTP layer | 1 |" in md
    # the plan's choice among all 16 policies measured at the point
    assert stats["points"] == 1 and stats["min_policies"] == 16
    assert "Modes not run" not in md


def test_a_bundle_without_drafter_fits_runs_the_other_modes(run_dir, tmp_path):
    """The shipped bundle has no block drafter's C_d: those modes are not run, said in one log line
    (and in the summary); every other mode is measured and predicted."""
    stats = oos.report([run_dir], tmp_path, {file_sha256(BUNDLE): str(BUNDLE)})
    rows = _csv_rows(tmp_path)
    others = [s for _, s in oos.policies() if s.mode not in BLOCK_DRAFTER_MODES]
    assert len(rows) == 2 + len(others) == stats["runs"] == 11
    assert not {oos_report.mode_of(r["policy"]) for r in rows} & set(BLOCK_DRAFTER_MODES)
    said = [line for line in (run_dir / "log.txt").read_text().splitlines() if "not run" in line]
    blocks = [s.name for _, s in oos.policies() if s.mode in BLOCK_DRAFTER_MODES]
    assert len(said) == 1 and all(name in said[0] for name in blocks)
    assert "Modes not run at any point" in (tmp_path / "summary.md").read_text()


def test_report_rows_name_the_frozen_bundle(run_dir, tmp_path):
    stats = oos.report([run_dir], tmp_path, {file_sha256(BUNDLE): str(BUNDLE)})
    rows = _csv_rows(tmp_path)
    assert list(rows[0]) == list(oos.COLUMNS)
    assert {r["bundle_sha256"] for r in rows} == {file_sha256(BUNDLE)}
    # context 32 is off the bundle's profile grid (256, 1024, 4096)
    assert {r["on_profile_grid"] for r in rows} == {"False"}
    assert stats["points"] == 1 and stats["min_policies"] == len(rows)
    assert (tmp_path / "summary.md").read_text().count("| tiny-gdn |") == 2
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 0


def test_a_block_drafters_round_is_on_the_grid_only_on_its_drafter_profiles_too(frozen):
    grid = oos_report._grid(frozen)
    row = {"batch_size": 8, "context_len": 1024, "nodes": 8,
           **oos_report._draft_axes("block", {"budget": 8, "block_len": 7})}
    assert grid["verify"]["batch_size"].count(8) and oos_report._on_grid(row, grid)
    assert not oos_report._on_grid({**row, "drafter_y": 5}, grid)          # block length 5: not timed
    assert not oos_report._on_grid({**row, "context_len": 4096}, grid)     # C_d timed at 256 and 1024 only
    assert not oos_report._on_grid(row, {**grid, "drafters": {}})          # a bundle without its C_d
    tfm = oos_report._draft_axes("tfm", {"budget": 16, "width": 4, "block_len": 7})
    assert (tfm["drafter_x"], tfm["drafter_y"]) == (16, 4)                  # ceil(15 / 4) adapter steps
    assert oos_report._draft_axes("dspark", {"block_len": 7})["drafter_x"] == 4    # the marginals' top-K
    # an MTP-drafted round is checked on the draft grid (batch 8 untimed there), not a drafter's
    assert not oos_report._on_grid({"batch_size": 8, "context_len": 1024, "nodes": 8,
                                    **oos_report._draft_axes("best_first", {"budget": 8, "draft_depth": 3})}, grid)


def test_the_policies_are_deduplicated_and_chosen_by_mode():
    names = [s.name for _, s in oos.policies()]
    assert len(names) == len(set(names)) == 14 and names.count("eagle_s3_k2_d6") == 1
    assert [label for label, _ in oos.policies()][:len(oos.POLICIES)] == [p[0] for p in oos.POLICIES]
    assert {s.mode for _, s in oos.policies(["block", "dspark"])} == {"block", "dspark"}
    assert [s.name for _, s in oos.policies(["linear", "eagle"])] == names[:len(oos.POLICIES)]   # the first runs'
    with pytest.raises(SimtreeError, match="unknown mode tree"):
        oos.policies(["eagle", "tree"])


def test_a_deadline_loses_whole_points(monkeypatch):
    """A point starts only if the time left holds its runs at the seconds a run took at that batch
    (before any: FIRST_RUN_S, then the most at any batch); one that cannot is skipped whole
    (full_run called with a deadline already past: every run a skipped row) and a later point that
    fits still runs."""
    clock = {"now": 0.0}
    calls = []

    def fake_full_run(model, *, batch_sizes, context_len, deadline, extra, **kw):
        whole = deadline > clock["now"]
        calls.append((context_len, batch_sizes[0], whole))
        if whole:   # batch 1: 4 s a run, batch 2: 2 s a run
            clock["now"] += (2 + len(extra)) * (4 if batch_sizes[0] == 1 else 2)
    import simtree.runtime.full.measure as measure
    monkeypatch.setattr(measure, "full_run", fake_full_run)
    monkeypatch.setattr(oos, "time", SimpleNamespace(time=lambda: clock["now"]))
    said = []
    extra = oos.policies(["eagle"])[:4]          # 6 runs a point
    failed = oos._points(None, None, Path("unused"), [(32, 1), (32, 2), (64, 1), (64, 2)], extra, said.append,
                         end=50.0, device="cpu", acceptance="gsm8k", rounds=2, min_draws=0)
    # (32, 1): 6 x 3 s estimated, took 24; (32, 2): 6 x 4 s (batch 1's), took 12, 14 s left;
    # (64, 1): 6 x 4 s > 14: skipped; (64, 2): 6 x 2 s fits
    assert failed == 0 and calls == [(32, 1, True), (32, 2, True), (64, 1, False), (64, 2, True)]
    assert sum("skipped whole" in line for line in said) == 1


H100_MODES = ROOT / "reports" / "validation" / "frozen_h100_qwen3.6-27b_tp1_modes.json"   # the H100 runs' bundle


def _fake_h100(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")


def _shapes_full_run(calls):
    """full_run without the device: each run's RoundShape made as full_run makes it (its
    AcceptanceSource's, at the point's context and batch), handed with its spec to ``skip``; records
    {spec name: (bucket, skip's line)} per call."""
    import simtree.runtime.full.measure as measure

    def fake_full_run(model, *, batch_sizes, context_len, extra, costs, acceptance, deadline=None, skip=None, **kw):
        source, (B,) = measure.AcceptanceSource(None, acceptance, "cpu", 0), batch_sizes
        got = {}
        for _, spec in [("plain", measure.PLAIN), ("linear_d4", measure.LINEAR_D4), *extra]:
            rs = source.round_shape(spec, B, costs, context_len)
            got[spec.name] = (rs.nodes, skip(spec, rs) if callable(skip) else skip)
        calls.append(got)
    return fake_full_run


def test_a_point_the_memory_check_refuses_spends_no_gpu_time(monkeypatch):
    """Qwen3.6-27B on one H100 at batch 64, context 4096 (the H100 runs' rounds): plain decoding does
    not fit (the check's own verdict, not a stand-in's), so every run of the point is a skipped row
    saying why, nothing is timed, and the next point, where everything fits, runs."""
    import simtree.runtime.full.measure as measure
    from simtree.models import get_model

    _fake_h100(monkeypatch)
    calls = []
    monkeypatch.setattr(measure, "full_run", _shapes_full_run(calls))
    said = []
    built = SimpleNamespace(shape=get_model("qwen3.6-27b"))
    oos._points(built, load_costs(H100_MODES), Path("unused"), [(4096, 64), (1024, 8)], oos.policies(["eagle"])[:4],
                said.append, end=1e12, device="cuda", acceptance="gsm8k", rounds=24, min_draws=96, deployment="tp=1")
    at_4096, at_1024 = calls
    whys = {why for _, why in at_4096.values()}
    (why,) = whys
    assert why.startswith("the deployment memory check refuses it: one tp=1 rank of qwen3.6-27b run alone does not "
                          "fit NVIDIA H100 80GB HBM3 at batch 64") and f"(64 sequences x {4096 + 29 + 8} rows" in why
    assert not any(why for _, why in at_1024.values())
    assert any(f"skipped whole, {why}" in line for line in said)


def test_the_memory_refusal_names_the_shortfall_or_is_none_off_the_gpu(monkeypatch):
    """The check of one run as full_run builds it: the cache rows of the batch's rounds
    (RunConfig.for_batch: at least ceil(min_draws / B)) and the bucket it verifies, not the mode's
    largest round."""
    import dataclasses

    import torch

    from simtree.deploy.memory import rank_memory
    from simtree.machine.machines import get_machine
    from simtree.models import get_model
    from simtree.planning.modes import PolicySpec
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.measure import LINEAR_D4, RunConfig, run_max_len
    qwen, linear = get_model("qwen3.6-27b"), round_shape(LINEAR_D4)
    cfg = RunConfig(4096, 24, oos.WARMUP_ROUNDS, min_draws=96)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # no GPU: unchecked
    assert oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg.for_batch(64), "cuda") is None
    _fake_h100(monkeypatch)
    why = oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg.for_batch(64), "cuda")
    # the rows the run allocates: the context and 29 rounds of its 4-row accepted paths, and 8
    rows = run_max_len(4096, 4, oos.WARMUP_ROUNDS, 24)
    mem = rank_memory(qwen, "tp=1", "h100", 64, 4096, rank_alone=True, drafter=LINEAR_D4, cache_len=rows)
    assert rows == 4096 + 29 * 4 + 8 and f"x {rows} rows" in why and f"= {mem.total_bytes / 1e9:.1f} GB" in why
    assert why.startswith("the deployment memory check refuses it: ") and "at most batch" in why
    small = RunConfig(1024, 24, oos.WARMUP_ROUNDS, min_draws=96)
    assert oos._memory_refusal(qwen, "tp=1", 8, LINEAR_D4, linear, small.for_batch(8), "cuda") is None      # fits
    # batch 2 runs 48 rounds (96 draws), not 24: its cache rows say so
    why = oos._memory_refusal(qwen, "tp=1", 2, LINEAR_D4, linear, small.for_batch(2), "cuda",
                              machine=dataclasses.replace(get_machine("h100"), memory_bytes=40 * 2 ** 30))
    assert f"x {run_max_len(1024, 4, oos.WARMUP_ROUNDS, 48)} rows" in why
    # DSpark at batch 64, context 1536 (ran on the H100): refused at its chain's 8 nodes, it fits at
    # the 4-node bucket it verified
    dspark = PolicySpec.from_dict("dspark", {"block_len": 7})
    at = RunConfig(1536, 24, oos.WARMUP_ROUNDS, min_draws=96).for_batch(64)
    assert oos._memory_refusal(qwen, "tp=1", 64, dspark, round_shape(dspark), at, "cuda") is not None
    assert oos._memory_refusal(qwen, "tp=1", 64, dspark, round_shape(dspark, 4), at, "cuda") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Unknown GPU")
    # no machine table
    assert oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg.for_batch(64), "cuda") is None


def test_the_memory_refusal_checks_the_runs_own_gpu(monkeypatch):
    """The check is of the GPU the run's device names, not GPU 0: an H100 at cuda:1 beside a GPU no
    table describes at cuda:0 refuses the run on cuda:1 only; a CPU run is unchecked."""
    import torch

    from simtree.models import get_model
    from simtree.runtime.full.drafting import round_shape
    from simtree.runtime.full.measure import LINEAR_D4, RunConfig
    names = {0: "Some Unknown GPU", 1: "NVIDIA H100 80GB HBM3"}
    asked = []

    def device_name(device=None):
        index = torch.device(device).index if device is not None else None
        asked.append(index)
        return names[index or 0]       # no index: the current device, GPU 0 here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", device_name)
    qwen, linear = get_model("qwen3.6-27b"), round_shape(LINEAR_D4)
    cfg = RunConfig(4096, 24, oos.WARMUP_ROUNDS, min_draws=96).for_batch(64)
    why = oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg, "cuda:1")
    assert why.startswith("the deployment memory check refuses it: one tp=1 rank of qwen3.6-27b run alone does not "
                          "fit NVIDIA H100 80GB HBM3 at batch 64") and asked == [1]
    assert oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg, "cuda:0") is None and asked == [1, 0]
    assert oos._memory_refusal(qwen, "tp=1", 64, LINEAR_D4, linear, cfg, "cpu") is None and asked == [1, 0]


@pytest.mark.parametrize("make, match", [
    (lambda d: d / "absent.json", "not found"),
    (lambda d: (d / "table.csv").write_text("a,b\n1,2\n") and d / "table.csv", "not valid JSON"),
    (lambda d: (d / "other.json").write_text('{"schema": "x"}') and d / "other.json", "not a simtree cost bundle")])
def test_a_frozen_bundle_that_is_not_one_is_refused_in_one_line(tmp_path, capsys, make, match):
    rc = oos.main(["run", "--model", "tiny-gdn", "--costs", str(make(tmp_path)), "--out", str(tmp_path / "out"),
                   "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()       # refused before anything ran


@pytest.mark.parametrize("args, match", [
    (["--model", "deepseek-v4-flash"], "not of 'deepseek-v4-flash'"),
    (["--drafter-profile", "README.md"], "not a readable CSV"),
    (["--costs", "absent.json"], "not found")])
def test_freeze_refuses_bad_input_in_one_line(tmp_path, capsys, args, match):
    given = {"--model": "qwen3.6-27b", "--costs": str(BUNDLE), "--drafter-profile": str(DRAFTER_PROFILE),
             "--out": str(tmp_path / "f.json"), **dict(zip(args[::2], args[1::2]))}
    rc = oos.main(["freeze", *[x for kv in given.items() for x in kv]])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "f.json").exists()


def test_run_refuses_unknown_modes_and_bad_numbers_in_one_line(tmp_path, capsys):
    base = ["run", "--model", "tiny-gdn", "--costs", str(BUNDLE), "--out", str(tmp_path / "o"), "--device", "cpu"]
    assert oos.main([*base, "--modes", "eagle,tree"]) == 2
    assert "unknown mode tree" in capsys.readouterr().err
    assert oos.main([*base, "--batch-sizes", "2,x"]) == 2
    assert "--batch-sizes 2,x" in capsys.readouterr().err


def test_a_failing_report_leaves_the_previous_one_intact(run_dir, tmp_path, monkeypatch):
    bundles = {file_sha256(BUNDLE): str(BUNDLE)}
    oos.report([run_dir], tmp_path, bundles)
    names = ("throughput_out_of_sample.csv", "summary.md", "predicted_vs_measured.png")
    before = {n: (tmp_path / n).read_bytes() for n in names}

    def fail(table):
        raise RuntimeError("plot failed")
    monkeypatch.setattr(oos_report, "_plot_png", fail)
    (tmp_path / "throughput_out_of_sample.csv").write_bytes(b"older table\n")   # an earlier report's
    before["throughput_out_of_sample.csv"] = b"older table\n"
    with pytest.raises(RuntimeError):
        oos.report([run_dir], tmp_path, bundles)
    assert {n: (tmp_path / n).read_bytes() for n in names} == before


def test_plan_check_counts_a_choice_within_two_percent():
    rows = [{"model": "m", "batch_size": 1, "context_len": 1, "policy": p, "measured_tok_s": m, "predicted_tok_s": q}
            for p, m, q in (("a", 100.0, 90.0), ("b", 98.5, 95.0), ("c", 80.0, 70.0))]
    (check,) = plan_points(rows)
    assert check["chosen"] == "b" and check["best"] == "a" and check["ok"]
    rows[1]["measured_tok_s"] = 97.0
    assert not plan_points(rows)[0]["ok"]


def test_a_point_with_a_run_not_measured_is_listed_not_counted():
    """Enough policies measured, but one asked for failed (out of memory): its prediction might have
    been the choice, so the point does not count for the plan's choice."""
    rows = [{"model": "m", "batch_size": 1, "context_len": 1, "policy": f"p{i}", "measured_tok_s": 100.0 - i,
             "predicted_tok_s": 100.0 - i, "point_complete": True} for i in range(MIN_POLICIES)]
    assert plan_points(rows)[0]["counted"]
    for r in rows:
        r["point_complete"] = False
    (check,) = plan_points(rows)
    assert not check["counted"] and check["ok"]
    from_csv = [{**r, "point_complete": "False"} for r in rows]        # as the committed table reads back
    assert not plan_points(from_csv)[0]["counted"]


def test_report_refuses_a_folder_without_runs(tmp_path):
    with pytest.raises(SimtreeError, match="no meta.json"):
        oos.report([tmp_path], tmp_path / "out")


def test_a_later_folder_fills_an_earlier_ones_misses():
    def row(policy, tok_s):
        return {"model": "m", "batch_size": 2, "context_len": 4096, "policy": policy, "measured_tok_s": tok_s}
    first = [row("linear_d4", 10.0), row("eagle", 20.0)]
    missed = [{"model": "m", "batch_size": 2, "context_len": 4096, "policy": p, "why": "skipped"}
              for p in ("block", "tfm")]
    later = [row("linear_d4", 11.0), row("block", 30.0)]
    other = [row("linear_d4", 12.0) | {"deployment": "tp=2"}]       # another deployment: another run
    rows, still, replaced = oos_report._latest(first + later + other, missed)
    assert sorted((r["policy"], r["measured_tok_s"]) for r in rows) == [
        ("block", 30.0), ("eagle", 20.0), ("linear_d4", 11.0), ("linear_d4", 12.0)]
    assert [m["policy"] for m in still] == ["tfm"]
    assert [(r["policy"], r["measured_tok_s"], r["later_tok_s"]) for r in replaced] == [("linear_d4", 10.0, 11.0)]


def test_a_rank_run_alone_is_labelled_the_rank():
    """A V4 ep=8 rank runs b sequences on its own (the all-to-all not run): its rows say "ep=8 rank",
    the label policy files use, where a one-GPU deployment keeps its name; the summary's words
    say what the rank left out."""
    from simtree.planning.policy_file import deployment_label, rank_collectives
    assert oos_report._deployment_label("ep=8") == "ep=8 rank" == deployment_label("ep=8 rank")
    assert oos_report._deployment_label("tp=1") == "tp=1"
    assert rank_collectives("ep=8 rank") == "all-to-all" and rank_collectives("tp=2 rank") == "all-reduce"
    assert rank_collectives("ep=8") is None
    table = Path(__file__).resolve().parents[1] / "reports" / "validation" / "throughput_out_of_sample.csv"
    rows = list(csv.DictReader(open(table)))
    assert {r["deployment"] for r in rows if r["model"] == "deepseek-v4-flash"} == {"ep=8 rank"}


VALIDATION = Path(__file__).resolve().parents[1] / "reports" / "validation"


@pytest.mark.parametrize("bundle", sorted(VALIDATION.glob("frozen_*.json")), ids=lambda p: p.stem)
def test_each_frozen_bundle_finds_the_profile_it_was_fitted_on(bundle):
    """The committed report command works from the tree: each frozen bundle's fitted profile (by the
    sha256 it records) is shipped or committed beside it, even after the shipped one gained rows."""
    grid = oos_report._grid(bundle)
    assert grid["verify"]["batch_size"] and grid["draft"]["num_steps"]


def test_a_bundle_finds_its_profile_by_sha256_among_those_given(tmp_path):
    """A bundle whose recorded profile has changed or is gone: refused in one line, unless the
    profile of its sha256 is given (--profile) or lies beside it."""
    shipped = data_path("profiles", "h200", "profile_qwen3.6-27b_tp1.csv")
    lines = shipped.read_text().splitlines(keepends=True)
    fitted = tmp_path / "elsewhere" / "fitted.csv"
    fitted.parent.mkdir()
    fitted.write_text("".join(lines[:-1]))     # the table as it was, one row short of the shipped one
    frozen = json.loads(BUNDLE.read_text())
    for part in ("verify", "draft"):
        frozen[part]["info"]["source"]["sha256"] = "sha256:" + file_sha256(fitted)
    bundle = tmp_path / "bundles" / "frozen.json"
    bundle.parent.mkdir()
    bundle.write_text(json.dumps(frozen))
    with pytest.raises(SimtreeError, match="is not the one it was fitted on"):
        oos_report._grid(bundle)
    assert oos_report._grid(bundle, [fitted]) == oos_report._grid(bundle, [shipped, fitted])
    (bundle.parent / "frozen.profile.csv").write_text(fitted.read_text())
    assert oos_report._grid(bundle) == oos_report._grid(bundle, [fitted])
    assert oos.main(["report", str(tmp_path), "--bundle", str(bundle), "--profile", str(tmp_path / "no.csv")]) == 2


def test_a_mode_whose_drafter_does_not_fit_is_skipped_alone(monkeypatch):
    """Qwen3.6-27B on one H100 at batch 64, context 1536 (the H100 runs' bundle, rounds and draws):
    the MTP-drafted modes and DSpark (both of its runs ran there, verifying a 4-node bucket of its
    8-node chain) fit, the block drafters' modes do not (block D=8 ran on the H100 all the same,
    0.2 GB past the check's usable memory: docs/deployments.md): each is a skipped row with the
    check's line while the point's other runs go on.  At batch 48, context 4096 (DSpark ran out
    of memory there) DSpark is refused too; at a point where they fit nothing is skipped."""
    import simtree.runtime.full.measure as measure
    from simtree.models import get_model

    _fake_h100(monkeypatch)
    calls = []
    monkeypatch.setattr(measure, "full_run", _shapes_full_run(calls))
    said = []
    extra = oos.policies(["eagle", "block", "tfm", "dspark"])
    assert {s.name for _, s in extra} >= {"dspark_p7_sched", "dspark_p7_t0.3"}
    oos._points(SimpleNamespace(shape=get_model("qwen3.6-27b")), load_costs(H100_MODES), Path("unused"),
                [(1536, 64), (4096, 48), (1024, 8)], extra, said.append, end=1e12, device="cuda", acceptance="gsm8k",
                rounds=24, min_draws=96, deployment="tp=1")
    at_64, at_48, at_8 = calls
    refused = {name for name, (_, why) in at_64.items() if why}
    assert refused == {"block_d8_p7", "block_d16_p7", "tfm_d16_w4_p7"}    # the MTP chain, eagle, dspark: fit
    assert at_64["dspark_p7_sched"][0] == at_64["dspark_p7_t0.3"][0] == 4     # the bucket each verified
    assert all(at_64[n][1].startswith("the deployment memory check refuses it: one tp=1 rank") for n in refused)
    assert "of the block drafter" in at_64["block_d16_p7"][1] and not any(why for _, why in at_8.values())
    assert at_48["dspark_p7_sched"][1] and at_48["dspark_p7_t0.3"][1] and not at_48["none"][1]
    assert any("block_d16_p7 skipped, the deployment memory check" in line for line in said)
    assert any(f"{len(at_64) - 3} runs" in line for line in said if "batch 64" in line)


def test_full_run_skips_the_runs_its_skip_function_names():
    """``skip`` as a function of the run's PolicySpec and RoundShape: the runs it gives a line for
    are skipped rows saying it, before anything is built for them; a line skips every run."""
    import torch

    from full_helpers import tiny_model
    from simtree.planning.modes import PolicySpec
    from simtree.runtime.full.measure import full_run

    block = PolicySpec.from_dict("block", {"budget": 8, "block_len": 7})
    seen = []

    def skip(spec, rs):
        seen.append((spec.name, rs.nodes))
        return "too big" if spec.mode != "none" else None
    out = full_run(tiny_model("tiny-gdn", dtype=torch.float32), device="cpu", batch_sizes=[2], acceptance="gsm8k",
                   context_len=32, rounds=1, warmup_rounds=0, extra=[("block", block)], skip=skip)
    errors = {r["label"]: r.get("error") for r in out["runs"]}
    assert errors == {"plain": None, "linear_d4": "skipped: too big", "block": "skipped: too big"}
    assert seen == [("none", 1), ("linear_d4", 4), ("block_d8_p7", 8)]     # each run's own shape
    out = full_run(tiny_model("tiny-gdn", dtype=torch.float32), device="cpu", batch_sizes=[2], acceptance="gsm8k",
                   context_len=32, rounds=1, warmup_rounds=0, skip="plain does not fit")      # a line: every run
    assert {r.get("error") for r in out["runs"]} == {"skipped: plain does not fit"}
