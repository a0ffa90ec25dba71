"""The V4 floor benchmark's code path on a CPU (tiny model, Triton's interpreter): the CSV
has the issue's columns, every point a row per kernel, ratios against the floor."""
import csv
import json

import pytest

from simtree.profiler.bench import v4_floor, v4_variants


@pytest.mark.parametrize("proj", ["bf16", "fp8"])
def test_smoke_sweep_writes_the_floor_table(tmp_path, monkeypatch, proj):
    """The attention's linears as the tiny model has them (bf16) or FP8 as V4-Flash's checkpoint
    (variant fused_bf16 then runs their dequantised twin, against the bf16 floor)."""
    monkeypatch.setattr(v4_floor, "ATTN_LAUNCHES", dict(list(v4_floor.ATTN_LAUNCHES.items())[:1]))   # one launch: the path, quickly
    out = tmp_path / "floor_v4.csv"
    assert v4_floor.main(["--out", str(out), "--model", "tiny-v4", "--smoke", "--no-check", "--kinds", "csa",
                          "--batches", "1", "--ns", "3", "--contexts", "40", "--copies", "1", "--attn-proj", proj]) == 0
    rows = list(csv.DictReader(out.open()))
    assert rows and list(rows[0])[:8] == ["kernel", "layer_kind", "batch_size", "nodes_per_seq", "context_len",
                                          "measured_us", "floor_us", "ratio"]
    kernels = {r["kernel"] for r in rows}
    run = v4_variants.variants("cpu")
    assert "fused_flashmla" not in run           # the FP8 core needs a GPU with sgl-flash-mla
    assert kernels == ({f"block_{v}" for v in run if v in v4_variants.BLOCK_VARIANTS} | {f"core_{v}" for v in run}
                       | {"pre_current", "post_current"} | {f"attn_{name}" for name in v4_floor.ATTN_LAUNCHES})
    assert len(rows) == len(kernels)
    for r in rows:
        assert abs(float(r["ratio"]) / (float(r["measured_us"]) / float(r["floor_us"])) - 1) < 0.02
        assert float(r["floor_us"]) > 0
        assert (float(r["tree_over_linear"]) > 0) if r["scope"] == "attention" else r["tree_over_linear"] == ""
    ends = {r["kernel"]: float(r["floor_us"]) for r in rows}
    assert ends["pre_current"] + ends["post_current"] < ends["block_current"]
    summary = json.loads(out.with_suffix(".json").read_text())
    assert set(summary["worst_ratio"]) == kernels and "v4_topk" in summary["faster_form"]
    assert "targets_met_block_fused" in summary and "attn_proj_fp8" in summary["faster_form"]
    floor = {r["kernel"]: float(r["floor_us"]) for r in rows}
    fp8_floor = {r["kernel"]: float(r["floor_fp8_projections_us"]) for r in rows if r["scope"] == "attention"}
    assert floor["block_fused_pool"] == fp8_floor["block_fused_pool"] if proj == "fp8" else \
        floor["block_fused_pool"] > fp8_floor["block_fused_pool"]
    assert floor["block_fused_bf16"] > fp8_floor["block_fused_bf16"]     # its bf16 linears: the bf16 floor


def test_the_bf16_twin_holds_the_fp8_layers_values():
    """fused_bf16's layer: the FP8 linears dequantised (and the indexer's head weights back in
    the first GEMM), so its block equals the FP8 layer's on a CPU (where FP8 linears run
    dequantised too)."""
    import dataclasses

    import torch

    from simtree.kernels.layers import v4 as V
    from simtree.kernels.layers.forms import forms
    from simtree.models import get_model
    d = dataclasses.replace(V.V4Dims.of(get_model("tiny-v4")), proj="fp8")
    L = v4_variants.Layer(d, "csa", "cpu", dtype=torch.float32, seed=3)
    twin = L.for_variant("fused_bf16")
    assert L.w["wq_b"].dtype == torch.float8_e4m3fn and "wq_b_scale_inv" in L.w and "wi_head" in L.w
    assert twin.d.proj == "bf16" and twin.w["wq_b"].dtype == torch.float32 and "wi_head" not in twin.w
    assert twin.w["wqkv_a"].shape[0] == d.qr + d.D + d.Hi
    assert L.for_variant("fused_bf16") is twin and L.for_variant("current") is L
    cache, rm = L.round(2, 3, 40, "random", seed=1)
    x = L.inputs(6, 1, 2)[0]
    with forms(**v4_variants.VARIANTS["fused_bf16"]):
        a, b = L.block(x, cache, rm, "torch"), twin.block(x, cache, rm, "torch")
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_smoke_breakdown_sums_each_parts_kernels(tmp_path):
    """v4_breakdown's code path: a row per (part, kernel), the part's kernels summing to its total,
    every part of every point present, its floor positive."""
    from simtree.profiler.bench import v4_breakdown
    out = tmp_path / "bd.csv"
    assert v4_breakdown.main(["--out", str(out), "--model", "tiny-v4", "--smoke", "--kinds", "hca",
                              "--points", "1x1,2x3", "--contexts", "40", "--reps", "1"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == v4_breakdown.COLUMNS
    parts = {(r["batch"], r["nodes"], r["part"]) for r in rows}
    assert parts == {(b, n, p) for b, n in (("1", "1"), ("2", "3")) for p in ("pre", "core", "post")}
    for key in parts:
        sub = [r for r in rows if (r["batch"], r["nodes"], r["part"]) == key]
        assert abs(sum(float(r["kernel_us"]) for r in sub) - float(sub[0]["part_kernels_us"])) < 0.05 * len(sub)
        assert float(sub[0]["part_floor_us"]) > 0 and float(sub[0]["part_graph_us"]) > 0
    assert v4_breakdown.main(["--out", str(out)]) == (0 if v4_breakdown.torch.cuda.is_available() else 1)


def test_smoke_breakdown_times_both_hyper_connection_forms(tmp_path):
    """--forms torch,fused: every part of the point under each form, named in the forms column,
    and the fused form's outputs checked against the torch path's in the JSON."""
    from simtree.profiler.bench import v4_breakdown
    out = tmp_path / "hc.csv"
    assert v4_breakdown.main(["--out", str(out), "--model", "tiny-v4", "--smoke", "--kinds", "swa",
                              "--points", "1x3", "--contexts", "40", "--reps", "1", "--forms", "torch,fused"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {(r["forms"], r["part"]) for r in rows} == {(f, p) for f in ("torch", "fused")
                                                       for p in ("pre", "core", "post")}
    kernels = {f: {r["kernel"] for r in rows if r["forms"] == f and r["part"] == "pre"} for f in ("torch", "fused")}
    assert any("hc_mix_partials" in k for k in kernels["fused"]) and not any("hc_mix" in k for k in kernels["torch"])
    check = json.loads(out.with_suffix(".json").read_text())["hc_check"]["swa b1 n3 l40"]["fused"]
    assert check["pre_ref_max_abs"] > 0 and check["post_ref_max_abs"] > 0
    # bf16 streams: the block input a rounding apart, the streams a few (the torch path rounds four times)
    assert check["pre_max_abs"] <= 2 ** -6 * check["pre_ref_max_abs"]
    assert check["post_max_abs"] <= 2 ** -5 * check["post_ref_max_abs"]
    assert v4_breakdown.main(["--out", str(out), "--smoke", "--forms", "triton"]) == 1


def test_smoke_launch_variants_are_checked_and_timed(tmp_path):
    """v4_launch's code path: every fused piece's variants beside the torch form, each with its
    error against it (small: the variants compute the same thing)."""
    from simtree.profiler.bench import v4_launch
    out = tmp_path / "launch.csv"
    assert v4_launch.main(["--out", str(out), "--smoke", "--tokens", "3"]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == v4_launch.COLUMNS
    ops = {r["op"] for r in rows}
    assert {"mix", "collapse", "merge"} <= ops
    for op in ops:
        sub = [r for r in rows if r["op"] == op]
        assert {"torch"} < {r["variant"] for r in sub}
        assert all(float(r["us"]) > 0 and float(r["max_rel_err"]) < 1e-2 for r in sub)
    assert v4_launch.main(["--out", str(out)]) == (0 if v4_launch.torch.cuda.is_available() else 1)


def test_the_bf16_compressor_check_passes_and_would_catch_a_wrong_product(monkeypatch):
    """v4_variants' check of the checkpoint-dtype projections: ok on the CPU form, and not ok when
    the product is wrong (the bias dropped)."""
    from simtree.kernels.layers import v4 as V
    from simtree.kernels.v4 import verify
    from simtree.models import get_model
    d = V.V4Dims.of(get_model("tiny-v4"))
    assert v4_variants._check_comp_proj("cpu", d)["ok"]
    real = verify.project_stacked
    monkeypatch.setattr(verify, "project_stacked", lambda p, x, pos: real(p, x, pos * 0 + 1))   # the wrong bias rows
    assert not v4_variants._check_comp_proj("cpu", d)["ok"]


def test_launch_benchmark_refuses_bad_token_counts_in_one_line(tmp_path, capsys):
    from simtree.profiler.bench import v4_launch
    for bad in ("a", "0", "4,-1"):
        assert v4_launch.main(["--out", str(tmp_path / "x.csv"), "--smoke", "--tokens", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --tokens") and "\n" not in err
    assert not (tmp_path / "x.csv").exists()


def test_the_launch_check_lists_refused_launches_and_needs_the_default(monkeypatch):
    """A launch the device refuses is listed and left out; the check fails when the default
    launch is the one refused (it cannot pass on no launch at all)."""
    from types import SimpleNamespace

    from simtree.profiler.bench import v4_variants
    ok = dict(block_k=16, block_h=16, num_warps=4)
    bad = dict(ok, split_rule="refused")          # raises at launch, as a refused compile does
    d = SimpleNamespace(D=32, H=4)
    monkeypatch.setattr(v4_variants, "ATTN_LAUNCHES", {"default": ok, "other": bad})
    r = v4_variants._check_launches("cpu", d)
    assert r["ok"] and set(r["refused"]) == {"other"} and set(r["max_err"]) == {"default"}
    monkeypatch.setattr(v4_variants, "ATTN_LAUNCHES", {"default": bad, "other": ok})
    assert not v4_variants._check_launches("cpu", d)["ok"]
