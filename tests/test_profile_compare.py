"""Profile comparison: per-(model, stage, variant) latency ratios of two tables, lone points."""
import numpy as np
import pandas as pd
import pytest

from simtree.errors import SimtreeError
from simtree.costs.profile_table import load_profile
from simtree.profiler.compare import compare_profiles, main


def random_table(rng, device="NVIDIA H200"):
    rows = []
    for stage, variant in (("gdn_tree_verify", "triton_tree"), ("mlp_step", "torch")):
        for b in (1, 4, 16, 64):
            for n in (1, 2, 4, 8, 16):
                med = float(rng.uniform(5, 5000))
                rows.append(dict(stage=stage, model="qwen3.6-27b", device=device, dtype="bf16",
                                 variant=variant, batch_size=b, nodes_per_seq=n, total_tokens=b * n,
                                 context_len=4096, tree_shape="eagle", num_steps=0, topk=0,
                                 latency_us_median=med, latency_us_p10=med * 0.9,
                                 latency_us_p90=med * 1.2, repeats=50, torch_version="2.11.0",
                                 triton_version="3.6.0", timestamp="2026-12-01T00:00:00+00:00"))
    return pd.DataFrame(rows)


def load(tmp_path, name, df):
    df.to_csv(tmp_path / name, index=False)
    return load_profile(tmp_path / name)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ratios_and_lone_points_per_group(tmp_path, seed):
    rng = np.random.default_rng(seed)
    a = random_table(rng)
    # B: another GPU, the GDN stage scaled by per-point random factors, MLP unchanged; one
    # GDN point dropped, one MLP point only in B
    b = a.copy()
    b["device"] = "NVIDIA H100"
    gdn = b.stage == "gdn_tree_verify"
    factors = rng.uniform(0.8, 1.3, size=int(gdn.sum()))
    for col in ("latency_us_median", "latency_us_p10", "latency_us_p90"):
        b.loc[gdn, col] *= factors
    dropped = int(rng.integers(0, int(gdn.sum())))
    b = b.drop(index=b.index[gdn][dropped])
    extra = b[b.stage == "mlp_step"].iloc[[0]].assign(nodes_per_seq=32, total_tokens=32)
    b = pd.concat([b, extra], ignore_index=True)
    table, totals = compare_profiles(load(tmp_path, "a.csv", a), load(tmp_path, "b.csv", b))
    g = table.set_index("stage")
    kept = np.delete(factors, dropped)
    assert g.loc["gdn_tree_verify", "points"] == len(kept) == 19
    assert g.loc["gdn_tree_verify", "ratio_median"] == pytest.approx(np.median(kept), rel=1e-9)
    assert g.loc["gdn_tree_verify", "ratio_max"] == pytest.approx(kept.max(), rel=1e-9)
    assert g.loc["gdn_tree_verify", "ratio_min"] == pytest.approx(kept.min(), rel=1e-9)
    assert (g.loc["gdn_tree_verify", "only_a"], g.loc["gdn_tree_verify", "only_b"]) == (1, 0)
    assert g.loc["mlp_step", "ratio_median"] == pytest.approx(1.0)
    assert (g.loc["mlp_step", "only_a"], g.loc["mlp_step", "only_b"]) == (0, 1)
    assert totals["points"] == 39 and totals["only_a"] == 1 and totals["only_b"] == 1
    assert totals["devices_b"] == ["NVIDIA H100"]
    # the worst point is the GDN point whose factor is farthest from 1 in log terms
    kept_rows = a[a.stage == "gdn_tree_verify"].drop(index=a.index[a.stage == "gdn_tree_verify"][dropped])
    w = kept_rows.iloc[int(np.argmax(np.abs(np.log(kept))))]
    assert g.loc["gdn_tree_verify", "worst_point"] == f"b{w.batch_size} n{w.nodes_per_seq} l4096 eagle"


def test_cli_writes_csv_and_markdown(tmp_path, capsys):
    rng = np.random.default_rng(5)
    a = random_table(rng)
    b = a.assign(**{c: a[c] * 1.02 for c in ("latency_us_median", "latency_us_p10",
                                              "latency_us_p90")})
    a.to_csv(tmp_path / "a.csv", index=False)
    b.to_csv(tmp_path / "b.csv", index=False)
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "b.csv"), "--csv",
                 str(tmp_path / "c.csv"), "--md", str(tmp_path / "c.md"), "--png",
                 str(tmp_path / "fig" / "c.png")]) == 0
    out = pd.read_csv(tmp_path / "c.csv")
    assert set(out.stage) == {"gdn_tree_verify", "mlp_step"}
    assert np.allclose(out.ratio_median, 1.02, atol=1e-4)
    md = (tmp_path / "c.md").read_text()
    assert "40 points in both" in md and "![B / A per point](fig/c.png)" in md
    assert (tmp_path / "fig" / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_line_errors(tmp_path, capsys):
    rng = np.random.default_rng(6)
    a = random_table(rng)
    a.to_csv(tmp_path / "a.csv", index=False)
    a.assign(model="deepseek-v4-flash").to_csv(tmp_path / "other.csv", index=False)
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "other.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the two profile tables share no point") and "\n" not in err
    assert main([str(tmp_path / "a.csv"), str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: profile table not found: {tmp_path / 'missing.csv'}"
    with pytest.raises(SimtreeError):
        compare_profiles(load_profile(tmp_path / "a.csv"), load_profile(tmp_path / "other.csv"))
    mixed = pd.concat([a, a.assign(device="NVIDIA H100")], ignore_index=True)
    mixed.to_csv(tmp_path / "mixed.csv", index=False)
    assert main([str(tmp_path / "mixed.csv"), str(tmp_path / "a.csv")]) == 2
    assert capsys.readouterr().err.strip() == ("error: profile table A holds several devices "
                                               "(NVIDIA H100, NVIDIA H200): compare one device's rows")
