"""A bundle timed on a runtime path the runtime no longer runs is named in one line by plan and
simulate (simtree/costs/runtime_path.py): the V4 forms and attention linears it timed against
today's defaults; a profile without the record ran the path before it existed."""
from __future__ import annotations

from simtree.costs.runtime_path import LEGACY_V4, V4_FORMS, path_changes, path_note, runtime_path
from simtree.kernels.layers.forms import forms, v4_form
from simtree.models import get_model


def _meta(model: str, paths=None) -> dict:
    return {"model": model, "profile_meta": {} if paths is None else {"runtime_paths": paths}}


def test_todays_v4_path_is_the_fused_forms_and_fp8_linears():
    now = runtime_path(get_model("deepseek-v4-flash"))
    assert now == {"attn_proj_dtype": "fp8", "v4_topk": "fused", "v4_hc": "fused", "v4_comp": "model",
                   "v4_pool": "split"}
    assert runtime_path(get_model("tiny-v4"))["attn_proj_dtype"] == "bf16"
    assert runtime_path(get_model("qwen3.6-27b")) == {}
    with forms(v4_topk="sort"):                      # the profiler passes the forms in effect
        assert runtime_path(get_model("deepseek-v4-flash"), {k: v4_form(k) for k in V4_FORMS})["v4_topk"] == "sort"


def test_a_v4_bundle_without_a_record_is_the_legacy_path_and_named():
    changes = path_changes(_meta("deepseek-v4-flash"))
    assert changes == ["attention linears bf16 (now fp8)", "v4_topk sort (now fused)", "v4_hc torch (now fused)",
                       "v4_comp fp32 (now model)", "v4_pool whole (now split)"]
    note = path_note(_meta("deepseek-v4-flash"))
    assert "\n" not in note and "records no path" in note and "attention linears bf16 (now fp8)" in note
    assert set(LEGACY_V4) == set(runtime_path(get_model("deepseek-v4-flash")))


def test_a_recorded_path_equal_to_todays_is_silent_and_one_switch_is_named():
    now = runtime_path(get_model("deepseek-v4-flash"))
    assert path_note(_meta("deepseek-v4-flash", {"deepseek-v4-flash": now})) is None
    note = path_note(_meta("deepseek-v4-flash", {"deepseek-v4-flash": {**now, "v4_pool": "live"}}))
    assert "v4_pool live (now split)" in note and "records no path" not in note and "v4_topk" not in note


def test_qwen_synthetic_and_unknown_models_carry_no_note():
    assert path_note(_meta("qwen3.6-27b")) is None
    assert path_note({**_meta("deepseek-v4-flash"), "synthetic": True}) is None
    assert path_note(_meta("not-a-model")) is None


def test_plan_names_the_shipped_v4_bundles_path_in_a_note_and_its_report():
    from simtree.deploy.select import select_costs
    from simtree.reporting.plan_report import _source_line
    costs, notes = select_costs(model="deepseek-v4-flash", machine="h200")
    assert any("deepseek-v4-flash: its costs were timed on an earlier runtime path" in n for n in notes)
    assert "Runtime path changed since" in _source_line(costs[0].meta)
    _, qnotes = select_costs(model="qwen3.6-27b", machine="h200")
    assert not any("runtime path" in n for n in qnotes)


def test_the_attention_linears_run_in_bf16_when_the_form_says_so():
    """Form v4_proj "bf16": V4-Flash's FP8 linears dequantised when the weights are made (the dims,
    the registry's bytes and the recorded path follow); a bf16 shape has nothing to keep."""
    from simtree.kernels.layers.v4 import V4Dims
    flash = get_model("deepseek-v4-flash")
    fp8_bytes = flash.shard("ep=8").weight_bytes()
    assert V4Dims.of(flash).proj == "fp8"
    with forms(v4_proj="bf16"):
        assert V4Dims.of(flash).proj == "bf16"
        assert flash.shard("ep=8").weight_bytes() - fp8_bytes > 4.5e9      # the linears' second byte
        path = runtime_path(flash, {k: v4_form(k) for k in V4_FORMS})
        assert path["attn_proj_dtype"] == "bf16"
    with forms(v4_proj="fp8"):
        assert V4Dims.of(get_model("tiny-v4")).proj == "bf16"               # its config stores no FP8
    assert V4Dims.of(flash).proj == "fp8" and flash.shard("ep=8").weight_bytes() == fp8_bytes


def test_a_full_run_with_a_bundle_of_an_earlier_path_says_so():
    """simtree run's measured runs (full_run, tiny V4 on the CPU) carry the note when the bundle
    was timed on another path (here: a tiny-v4 bundle without the record, the legacy forms)."""
    import dataclasses

    from full_helpers import tiny_model
    from simtree.costs.synthetic import synthetic_costs
    from simtree.runtime.full.measure import full_run
    base = synthetic_costs()
    costs = dataclasses.replace(base, meta={**base.meta, "model": "tiny-v4", "synthetic": False, "profile_meta": {}})
    said = []
    res = full_run(tiny_model("tiny-v4"), device="cpu", costs=costs, batch_sizes=[1], acceptance="gsm8k",
                   context_len=16, rounds=1, warmup_rounds=0, progress=said.append)
    note = next(n for n in res["notes"] if "earlier runtime path" in n)
    assert "v4_topk sort (now fused)" in note and note in said
