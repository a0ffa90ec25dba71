"""The live run's full-scale path (scripts/serve_live.py --replay, scripts/serve_live_full_gpu.sh) end
to end on a tiny target of the same family (qwen3_5 text, random weights) on CPU: replayed
acceptance, the frozen shipped H100 bundle, two phases; and its own README section."""
import hashlib
import importlib.util
import math
import shutil
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import torch

from simtree.acceptance.model import get_workload
from simtree.errors import SimtreeError
from simtree.models import get_model
from simtree.planning.modes import EagleParams, LinearParams, NoneParams
from simtree.runtime.full import generate as generate_mod
from simtree.serving.live_report import FROZEN_ARCHIVE, FULL_SECTION, SECTION, existing_section, full_section, main

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "simtree" / "data" / "costs" / "h100_qwen3.6-27b_tp1.json"

torch.set_num_threads(1)


def _serve_live():
    spec = importlib.util.spec_from_file_location("serve_live", ROOT / "scripts" / "serve_live.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, name, *extra):
    """serve_live.main on tiny-gdn, phases 2 then 1; (its CSV, each phase engine's built round shapes)."""
    built, make = [], generate_mod.make_engine

    def recording(*args, **kw):
        engine = make(*args, **kw)
        built.append({rs.spec.name for rs in engine._layouts})
        return engine

    out = tmp_path / f"{name}.csv"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate_mod, "make_engine", recording)
        _serve_live().main(["--model", "tiny-gdn", "--dtype", "fp32", "--device", "cpu", "--costs", str(BUNDLE),
                           "--random-prompts", "256,300", "--no-warmup", "--phases", "2,1", "--new-tokens", "10",
                           "--out", str(out), *extra])
    return pd.read_csv(out), built


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live_full")
    return _run(tmp, "replay", "--replay", "sharegpt"), _run(tmp, "live")


def test_one_row_per_phase_finite_tpot_and_tiers_the_engine_built(runs):
    (df, built), _ = runs
    assert list(df.phase) == [0, 1] and list(df.batch_size) == [2, 1]
    for col in ("measured_tpot_ms", "predicted_tpot_ms", "predicted_model_tpot_ms"):
        assert all(math.isfinite(v) and v > 0 for v in df[col]), col
    assert len(built) == 2       # one engine per phase, the controller's tiers built in each
    for (_, row), shapes in zip(df.iterrows(), built):
        chosen = dict(part.split(":") for part in row.tiers.split(";"))
        assert set(chosen) <= shapes and sum(map(int, chosen.values())) == row.rounds
    assert set(df.acceptance) == {"replay:sharegpt"} and set(df["model"]) == {"tiny-gdn"} and set(df["dtype"]) == {"fp32"}
    assert set(df.costs) == {str(BUNDLE)} and set(df.prompts) == {"random (256-300 tokens)"}


def test_the_rounds_accept_as_replayed_not_as_the_random_target(runs):
    """Random weights accept nothing of their own: live, every round gains the bonus token alone;
    replayed, the drafted rounds gain what sharegpt's acceptance model gives them."""
    (replayed, _), (live, _) = runs
    assert (live.tokens_per_round < 1.2).all()
    assert (replayed.tokens_per_round > 1.8).all() and (replayed.rounds < live.rounds).all()


def test_the_full_scale_section_joins_the_readme_and_stays(runs, tmp_path):
    (df, _), (live, _) = runs
    csv, live_csv = tmp_path / "full.csv", tmp_path / "live.csv"
    assert set(df.weights) == {"random"} and set(df.costs_sha256) == {hashlib.sha256(BUNDLE.read_bytes()).hexdigest()}
    assert set(df.costs_device) == {"NVIDIA H100 80GB HBM3"}
    for column, value, refusal in (("device", "cpu", "another device's costs"), ("costs_sha256", "0" * 64, "not frozen")):
        other = tmp_path / f"other_{column}.csv"
        df.assign(device=df.costs_device).assign(**{column: value}).to_csv(other, index=False)
        with pytest.raises(SimtreeError, match=refusal):
            full_section(other, "cmd")
    df = df.assign(device=df.costs_device)       # as run on the bundle's kind of device
    df.to_csv(csv, index=False)
    live.to_csv(live_csv, index=False)
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n\ntext\n")
    main([str(live_csv), "--readme", str(readme)])              # the tiny model's section first
    tiny = readme.read_text()
    main([str(csv), "--full-scale", "--readme", str(readme)])
    both = readme.read_text()
    assert both.startswith(tiny) and both.count(FULL_SECTION) == 1
    section = full_section(csv, "cmd")
    assert section.startswith(FULL_SECTION) and "OUT OF SAMPLE" in section and "tiny-gdn (fp32, random weights)" in section
    assert "replay:sharegpt" in section and str(BUNDLE) in section and "| 1 | 1 |" in section
    # the benchmark's rewrite keeps both live sections as they were; each report replaces its own
    assert existing_section(readme) == both[both.index(SECTION):]
    main([str(live_csv), "--readme", str(readme)])
    main([str(csv), "--full-scale", "--readme", str(readme)])
    assert readme.read_text() == both
    with pytest.raises(SimtreeError, match="not a full-scale run"):
        full_section(live_csv, "cmd")                               # live acceptance: not this section's


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_each_tier_accepts_as_its_own_replay(device):
    """Tiers switching round by round (CUDA graphs on the GPU, one set per shape): every drafted
    round accepts the next row of its own tier's replay table, plain rounds nothing."""
    from full_helpers import TierRuns
    from simtree.runtime.full.acceptance import StratifiedReplay
    from simtree.runtime.full.generate import generate
    from simtree.runtime.full.qwen import QwenModel
    model = QwenModel(get_model("tiny-gdn"), device=device, dtype=torch.float32, seed=1)
    plain, linear, eagle = NoneParams(), LinearParams(4), EagleParams(3, 2, 6)
    ctl = TierRuns([(eagle, 2), (plain, 1), (linear, 3)])
    made = {}

    def source(rs):
        made[rs.spec.name] = StratifiedReplay(get_workload("sharegpt").acceptance, rs, device, 2, 16, seed=len(made))
        return made[rs.spec.name]

    res = generate(model, [[3, 17, 5, 9], [11, 2, 7, 1, 30, 4]], 40, plain, controller=ctl, source=source)
    assert set(made) == {linear.name, eagle.name}
    tables = {name: src.table.cpu().numpy() for name, src in made.items()}
    assert not all((tables[linear.name] == tables[eagle.name]).ravel())    # a mix-up would show
    read = Counter()
    for name, r in zip(ctl.chosen, res.rounds):
        if name == plain.name:
            assert r.accepted == [0, 0]
            continue
        assert r.accepted == tables[name][read[name] % 16].tolist(), (name, read[name])
        read[name] += 1
    assert read[linear.name] >= 3 and read[eagle.name] >= 2


def test_a_run_whose_shipped_bundle_was_refitted_reads_its_frozen_copy_beside_it(tmp_path):
    """The committed run predicted with a bundle since refitted: its bytes kept beside the CSV as
    frozen_<name> are the run's bundle (named so in the section); without that copy, or with other
    bytes in it, the run is refused in one line, not shown as frozen."""
    import tarfile
    run = ROOT / "reports" / "bench_serve" / "serve_live_full.csv"
    df = pd.read_csv(run)
    sha = str(df.costs_sha256.iloc[-1])
    name = Path(str(df.costs.iloc[-1])).name
    shipped = ROOT / "simtree" / "data" / "costs" / name
    assert hashlib.sha256(shipped.read_bytes()).hexdigest() != sha, "the shipped bundle is the run's again"
    with tarfile.open(run.parent / FROZEN_ARCHIVE) as tar:       # the committed copies: one archive beside the runs
        data = tar.extractfile(f"frozen_{name}").read()
    assert hashlib.sha256(data).hexdigest() == sha, "the committed live run's bundle is not kept beside it"
    kept = [tmp_path / "kept" / f"frozen_{name}"]
    kept[0].parent.mkdir()
    kept[0].write_bytes(data)
    assert f"kept as `{FROZEN_ARCHIVE}:frozen_{name}`" in full_section(run, "cmd")
    csv = tmp_path / "serve_live_full.csv"
    df.to_csv(csv, index=False)
    with pytest.raises(SimtreeError, match="not frozen"):
        full_section(csv, "cmd")                                     # no copy beside it
    (tmp_path / f"frozen_{name}").write_bytes(kept[0].read_bytes()[:-1] + b" ")
    with pytest.raises(SimtreeError, match="not frozen"):
        full_section(csv, "cmd")                                     # a copy of other bytes
    (tmp_path / f"frozen_{name}").write_bytes(kept[0].read_bytes())
    section = full_section(csv, "cmd")
    assert f"kept as `frozen_{name}` beside the run" in section and sha[:12] in section
    mixed = df.copy()
    mixed.loc[0, "costs_sha256"] = "0" * 64          # an earlier phase on another bundle: the last row's check is not enough
    mixed.to_csv(csv, index=False)
    with pytest.raises(SimtreeError, match="2 different costs_sha256 values"):
        full_section(csv, "cmd")


def test_runs_of_two_families_make_one_section_with_a_subsection_each(tmp_path):
    """Full-scale runs of two models (one CSV each): one section, each run under its model's
    heading with its own verdict and table; two runs of one model are refused in one line."""
    run = ROOT / "reports" / "bench_serve" / "serve_live_full.csv"
    df = pd.read_csv(run)
    name = Path(str(df.costs.iloc[-1])).name
    shutil.copy(run.parent / FROZEN_ARCHIVE, tmp_path / FROZEN_ARCHIVE)      # the runs' frozen bundles beside them
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    df.to_csv(first, index=False)
    df.assign(model="deepseek-v4-flash", measured_tpot_ms=df.measured_tpot_ms * 2).to_csv(second, index=False)
    section = full_section([first, second], "cmd")
    assert section.count(FULL_SECTION) == 1 and section.count("OUT OF SAMPLE") == 2
    assert section.index("### qwen3.6-27b") < section.index("### deepseek-v4-flash")
    assert "with MODEL=deepseek-v4-flash" in section and section.count("Measured TPOT within 10%") == 2
    assert "yes (6 of 6" in section and "NO (0 of 6" in section     # each verdict is its own run's
    assert full_section([first], "cmd") == full_section(first, "cmd")
    with pytest.raises(SimtreeError, match="two runs of one model"):
        full_section([first, first], "cmd")
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n")
    with pytest.raises(SimtreeError, match="several only with --full-scale"):
        main([str(first), str(second), "--readme", str(readme)])
