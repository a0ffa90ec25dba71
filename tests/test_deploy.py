"""Deployments: parsing, one rank's shape and memory, the refusal that names the shortfall, the
communication model and the composition of a rank's step with it (simtree/deploy/)."""
import math

import numpy as np
import pytest

from simtree.data import data_path
from simtree.deploy import Deployment, parse_deployment
from simtree.costs.comm import (COLLECTIVES, AlphaBeta, CommModel, draft_collectives, fit_comm, load_comm,
                                 step_collectives, traffic_factor)
from simtree.machine.machines import MACHINES_ENV, get_machine, machine_for_device
from simtree.deploy.memory import check_fits, rank_memory, smallest_fit
from simtree.errors import SimtreeError
from simtree.models import get_model

COMM = data_path("comm", "h200_nvlink.json")


@pytest.mark.parametrize("text, tp, ep, gpus, dp, name", [
    ("tp=1", 1, 1, 1, 1, "tp=1"), ("", 1, 1, 1, 1, "tp=1"), ("tp=2", 2, 1, 2, 1, "tp=2"),
    ("TP=8", 8, 1, 8, 1, "tp=8"), ("ep=8", 1, 8, 8, 8, "ep=8"), (" ep = 8 , tp = 1 ", 1, 8, 8, 8, "ep=8"),
    ("tp=2,ep=8", 2, 8, 8, 4, "ep=8,tp=2"), ("ep=1,tp=1", 1, 1, 1, 1, "tp=1")])
def test_deployment_strings_users_know_parse_to_one_canonical_name(text, tp, ep, gpus, dp, name):
    d = parse_deployment(text)
    assert (d.tp, d.ep, d.gpus, d.dp, d.name) == (tp, ep, gpus, dp, name)
    assert parse_deployment(d.name) == d and parse_deployment(d) is d


@pytest.mark.parametrize("text, fragment", [
    ("tp=0", "tp must be a whole number >= 1"), ("tp=x", "tp must be a whole number"), ("pp=2", "each part is tp=N or ep=N"),
    ("tp=2,tp=4", "tp given twice"), ("ep=8,tp=3", "tp must divide ep"), ("tp", "each part is"), ("tp=-1", "whole number"),
    (3, "must be a string")])
def test_bad_deployment_strings_are_one_line_errors(text, fragment):
    with pytest.raises(SimtreeError, match=fragment) as err:
        parse_deployment(text)
    assert "\n" not in str(err.value)


def test_engine_arguments_follow_sglang_and_vllm():
    assert parse_deployment("tp=1").sglang_args() == ()
    assert parse_deployment("tp=2").sglang_args() == ("--tp-size", "2")
    assert parse_deployment("ep=8").sglang_args() == ("--tp-size", "8", "--ep-size", "8", "--enable-dp-attention",
                                                      "--dp-size", "8")
    assert parse_deployment("ep=8,tp=2").sglang_args()[-1] == "4"   # 4 attention groups of 2 GPUs
    assert parse_deployment("tp=2").vllm_args() == ("--tensor-parallel-size", "2")
    assert parse_deployment("ep=8").vllm_args() == ("--data-parallel-size", "8", "--enable-expert-parallel")


def test_rank_batch_is_the_busiest_ranks_share_under_data_parallel_attention():
    rng = np.random.default_rng(0)
    b = rng.integers(1, 200, 20)
    assert np.array_equal(parse_deployment("ep=8").rank_batch(b), np.ceil(b / 8))
    assert parse_deployment("ep=8").rank_batch(9) == 2 and parse_deployment("tp=8").rank_batch(9) == 9


# ---- shards ----------------------------------------------------------------------------------
def test_v4_flash_at_ep8_keeps_32_experts_and_picks_6_per_token():
    full, rank = get_model("deepseek-v4-flash"), get_model("deepseek-v4-flash").shard("ep=8")
    assert rank.mlp["n_experts"] == 32 and rank.mlp["experts_per_token"] == 6
    assert rank.deployment == "ep=8" and rank.ranks == 8 and full.ranks == 1
    assert rank.v4 == full.v4 and rank.vocab == full.vocab   # attention whole per rank (data-parallel)
    with pytest.raises(SimtreeError, match="already one rank"):
        rank.shard("ep=2")


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel_ranks_split_heads_and_columns_evenly(t):
    full, rank = get_model("qwen3.6-27b"), get_model("qwen3.6-27b").shard(f"tp={t}")
    assert rank.attn["q_heads"] * t == full.attn["q_heads"]
    assert rank.attn["kv_heads"] == max(1, full.attn["kv_heads"] // t)   # replicated past 4 ranks
    assert rank.gdn["value_heads"] * t == full.gdn["value_heads"] and rank.gdn["key_heads"] * t == full.gdn["key_heads"]
    assert rank.mlp["intermediate"] * t == full.mlp["intermediate"] and rank.vocab == math.ceil(full.vocab / t)
    # t ranks hold the model once over, and a little more (norms, KV heads past 4 ranks, the MTP projection)
    assert full.weight_bytes() <= t * rank.weight_bytes() <= 1.03 * full.weight_bytes()


@pytest.mark.parametrize("model, dep, fragment", [
    ("qwen3.6-27b", "tp=3", "KV heads do not split 3 ways"), ("qwen3.6-27b", "tp=12", "16 GDN key heads do not split 12 ways"), ("qwen3.6-27b", "tp=16", "24 query heads"),
    ("qwen3.6-27b", "ep=2", "needs an MoE model"), ("deepseek-v4-flash", "ep=3", "routed experts do not split 3"),
    ("deepseek-v4-flash", "ep=64", "fewer than the 6 a token picks"), ("tiny-v4", "ep=8", "fewer than the 2")])
def test_splits_that_do_not_divide_the_model_are_refused(model, dep, fragment):
    with pytest.raises(SimtreeError, match=fragment) as err:
        get_model(model).shard(dep)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("comp", ["fp32", "model"])
@pytest.mark.parametrize("name, ep", [("qwen3.6-27b", None), ("tiny-gdn", None), ("deepseek-v4-flash", 8),
                                      ("tiny-v4", 2)])
def test_registry_weight_bytes_equal_what_the_full_runtime_allocates(name, ep, comp):
    """Under either form of the V4 compressors' projections (fp32 copies, or the checkpoint's bf16)."""
    import torch

    from simtree.kernels.layers.forms import forms
    from simtree.runtime.full import qwen, v4_rank
    from simtree.kernels.layers.weights import spec_bytes

    shape = get_model(name)
    dt = torch.bfloat16 if shape.dtype == "bf16" else torch.float32
    with forms(v4_comp=comp):
        if ep is None:
            assert shape.weight_bytes() == spec_bytes(qwen.param_specs(shape), dt)
        else:
            assert shape.shard(f"ep={ep}").weight_bytes() == spec_bytes(v4_rank.param_specs(shape, ep, dt), dt)


def test_the_checkpoints_bf16_compressor_projections_save_their_second_half():
    """V4-Flash ep=8: 21 CSA layers (two compressors) and 20 HCA layers' projections at 2 bytes less."""
    from simtree.kernels.layers.forms import forms
    shape = get_model("deepseek-v4-flash").shard("ep=8")
    with forms(v4_comp="model"):
        bf16 = shape.weight_bytes()
    with forms(v4_comp="fp32"):
        fp32 = shape.weight_bytes()
    assert fp32 - bf16 == 2 * 4096 * (21 * 2 * (1024 + 256) + 20 * 2 * 512)


def test_cache_bytes_grow_with_batch_and_context_and_split_with_heads():
    q = get_model("qwen3.6-27b")
    per_token = 17 * 2 * 4 * 256 * 2   # 16 attention layers + the MTP layer, K and V, 4 KV heads x 256, bf16
    assert q.cache_bytes(1, 1001) - q.cache_bytes(1, 1000) == per_token
    assert q.cache_bytes(3, 512) == 3 * q.cache_bytes(1, 512)
    assert q.shard("tp=2").cache_bytes(4, 4096) * 2 == q.cache_bytes(4, 4096)
    v4 = get_model("deepseek-v4-flash")
    assert v4.cache_bytes(1, 8192) > v4.cache_bytes(1, 4096) > 0   # compressed entries grow with l


# ---- memory -----------------------------------------------------------------------------------
def test_v4_flash_on_one_gpu_is_refused_naming_the_shortfall():
    with pytest.raises(SimtreeError) as err:
        check_fits("deepseek-v4-flash", "tp=1", "h200", 8, 4096)
    msg = str(err.value)
    assert "\n" not in msg and "does not fit tp=1 on NVIDIA H200" in msg
    # FP8 experts: about 298 GB of weights in all, so four H200s hold it (ep=4: about 85 GB a rank)
    whole = get_model("deepseek-v4-flash").weight_bytes()
    assert 290e9 < whole < 310e9 and f"{whole / 1e9:.1f} GB of weights" in msg
    assert "it needs 4 GPUs (ep=4), asked for 1" in msg
    ok = check_fits("deepseek-v4-flash", "ep=8", "h200", 64, 4096)
    assert ok.fits and ok.rank_batch == 8 and 40e9 < ok.weight_bytes < 50e9


def test_the_cache_can_be_what_does_not_fit():
    assert rank_memory("qwen3.6-27b", "tp=1", "h200", 8, 4096).fits
    with pytest.raises(SimtreeError, match=r"KV cache / state \(64 sequences x 32776 rows, context 32768\).*it needs "
                                           r"2 GPUs \(tp=2\), asked for 1"):
        check_fits("qwen3.6-27b", "tp=1", "h200", 64, 32768)
    big = smallest_fit("deepseek-v4-flash", "h200", 64, 4096, like=parse_deployment("ep=8,tp=2"))
    assert big.deployment == parse_deployment("ep=4,tp=2")   # the asked-for kind (its tp) first


def test_users_add_machines_through_the_environment(tmp_path, monkeypatch):
    table = tmp_path / "mine.yaml"
    table.write_text("bigmem:\n  devices: [Big GPU]\n  memory_gb: 1000\n  usable_fraction: 0.9\n"
                     "  link_gb_s: 100\n  comm: h200_nvlink.json\n")
    monkeypatch.setenv(MACHINES_ENV, str(table))
    assert machine_for_device("Big GPU").key == "bigmem" and get_machine("bigmem").memory_bytes == 1000 * 10**9
    assert get_machine("h200").memory_bytes == 150109880320      # CUDA's 139.80 GiB, as a profile logged it
    assert check_fits("deepseek-v4-flash", "tp=1", "bigmem", 8, 4096).fits
    assert load_comm(get_machine("bigmem").comm_path).assumed
    table.write_text("gib:\n  memory_gib: 80\n  usable_fraction: 0.9\n  link_gb_s: 1\n  cuda_context_mib: 512\n")
    assert get_machine("gib").memory_bytes == 80 * 2**30 and get_machine("gib").context_bytes == 512 * 2**20
    for bad, match in (("memory_gb: -1", "memory_gb must be a number > 0"),
                       ("memory_gb: 80\n  memory_bytes: 8", "exactly one of memory_bytes, memory_gib, memory_gb"),
                       ("memory_gb: 80\n  cuda_context_mib: -1", "cuda_context_mib must be a number >= 0")):
        table.write_text(f"bad:\n  {bad}\n  usable_fraction: 0.9\n  link_gb_s: 1\n")
        with pytest.raises(SimtreeError, match=match):
            get_machine("h200")


# ---- communication ----------------------------------------------------------------------------
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("group", [2, 4, 8])
def test_each_collective_costs_more_for_more_bytes(collective, group):
    comm = load_comm(COMM)
    sizes = np.sort(np.random.default_rng(group).uniform(1, 2 ** 28, 50))
    t = comm.time_us(collective, group, sizes)
    assert np.all(np.diff(t) > 0) and t[0] >= comm.params(collective, group).alpha_us
    assert np.all(comm.time_us(collective, 1, sizes) == 0)   # one rank moves nothing


def test_the_assumed_defaults_say_so_and_groups_without_numbers_take_the_next_larger():
    comm = load_comm(COMM)
    assert comm.assumed and comm.label == "communication assumed"
    assert comm.params("all_reduce", 3) == comm.params("all_reduce", 4)
    assert comm.params("all_reduce", 16) == comm.params("all_reduce", 8)
    assert traffic_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)


def test_tp_and_ep_steps_issue_the_collectives_engines_do():
    q, v4 = get_model("qwen3.6-27b"), get_model("deepseek-v4-flash")
    calls = step_collectives(q, "tp=2", 10)
    per_layer = [c for c in calls if c.what in ("attention output", "MLP output")]
    assert all(c.collective == "all_reduce" and c.group == 2 and c.count == 64 for c in per_layer)
    assert per_layer[0].message_bytes == 10 * 5120 * 2 and len(per_layer) == 2
    assert {c.what for c in calls} >= {"embedding", "LM head logits"}
    ep = step_collectives(v4, "ep=8", 10)
    assert [(c.collective, c.group, c.count) for c in ep] == [("all_to_all", 8, 43)] * 2   # dispatch + combine
    assert ep[0].message_bytes == 10 * 6 * 4096 * 2
    assert step_collectives(q, "tp=1", 10) == [] and len(draft_collectives(v4, "ep=8", 4)) == 2


def test_the_fit_recovers_alpha_and_bandwidth_from_noisy_rows():
    import pandas as pd

    rng = np.random.default_rng(3)
    truth = {("all_reduce", 2): AlphaBeta(9.0, 300.0), ("all_to_all", 8): AlphaBeta(15.0, 380.0)}
    rows = []
    for (coll, g), p in truth.items():
        for s in 2.0 ** np.arange(12, 29, 2):
            lat = float(p.time_us(coll, g, s)) * (1 + 0.01 * rng.standard_normal())
            rows.append({"stage": f"comm_{coll}", "deployment": f"tp={g}", "message_bytes": s, "latency_us_median": lat})
    rows.append({"stage": "comm_all_reduce", "deployment": "tp=1", "message_bytes": 4096, "latency_us_median": 3.0})
    model = fit_comm(pd.DataFrame(rows))
    assert model.measured and not model.assumed and set(model.collectives["all_reduce"]) == {2}   # g = 1 left out
    for (coll, g), p in truth.items():
        got = model.collectives[coll][g]
        assert got.alpha_us == pytest.approx(p.alpha_us, rel=0.1) and got.busbw_gb_s == pytest.approx(p.busbw_gb_s, rel=0.05)
    with pytest.raises(SimtreeError, match="two or more"):
        fit_comm(pd.DataFrame(rows[:1] * 3))
    back = CommModel.from_dict(model.to_dict())
    assert back.collectives == model.collectives and back.measured


# ---- composition -------------------------------------------------------------------------------
def _toy_bundle(model="qwen3.6-27b", deployment="tp=2", device="NVIDIA H200", comm=None):
    from simtree.costs.forms import BasisSurface
    from simtree.costs.model import CostBundle, DraftCostModel, VerifyCostModel

    verify = BasisSurface("verify", [64.0], [900.0, 0.5, 40.0, 30.0, 0.01, 0.0005],
                          ("nodes_per_seq", "context_len", "batch_size"),
                          {"nodes_per_seq": [1, 64], "context_len": [128, 8192], "batch_size": [1, 16]})
    draft = BasisSurface("draft", [64.0], [50.0, 2.0, 120.0, 0.1, 0.01, 0.5], ("topk", "num_steps", "batch_size"),
                         {"topk": [1, 8], "num_steps": [1, 4], "batch_size": [1, 16]})
    meta = {"model": model, "device": device, "synthetic": False, "deployment": deployment, "communication": comm}
    return CostBundle(VerifyCostModel(verify, {"form": "basis"}), DraftCostModel(draft), meta)


@pytest.mark.filterwarnings("ignore::simtree.errors.ExtrapolationWarning")
@pytest.mark.parametrize("model, dep", [("qwen3.6-27b", "tp=2"), ("deepseek-v4-flash", "ep=8"),
                                        ("deepseek-v4-flash", "ep=8,tp=2")])
def test_a_deployments_step_is_the_ranks_compute_plus_its_communication(model, dep):
    from simtree.deploy.costs import deployment_costs

    rank = _toy_bundle(model, dep)
    costs = deployment_costs(rank)
    d, comm, shape = parse_deployment(dep), load_comm(COMM), get_model(model)
    rng = np.random.default_rng(1)
    for n, l, b in zip(rng.integers(1, 64, 30), rng.integers(128, 8192, 30), rng.integers(1, 64, 30)):
        rb = d.rank_batch(int(b))
        want = rank.verify.predict(n, l, rb) + comm.calls_us(step_collectives(shape, d, rb * n))
        assert costs.verify.predict(n, l, b) == pytest.approx(float(want), rel=1e-12)
        s, k = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        want_d = rank.draft.predict(s, k, rb) + s * comm.calls_us(draft_collectives(shape, d, rb * k))
        assert costs.draft.predict(s, k, b) == pytest.approx(float(want_d), rel=1e-12)
    assert costs.verify.predict(8, 1024, 8) > rank.verify.predict(8, 1024, d.rank_batch(8))
    assert costs.meta["deployment"] == d.name and costs.meta["communication"]["assumed"] is True
    assert deployment_costs(costs) is costs   # composed once
    # still non-decreasing and convex in n: communication is affine in the tokens
    y = costs.verify.predict(np.arange(1.0, 65.0), 2048, 16)
    assert np.all(np.diff(y) > 0) and np.all(np.diff(y, 2) >= -1e-9 * y[1:-1])


def test_one_gpu_bundles_are_planned_as_they_are():
    from simtree.deploy.costs import deployment_costs

    rank = _toy_bundle(deployment="tp=1")
    assert deployment_costs(rank) is rank


def test_a_measured_communication_model_replaces_the_assumed_one():
    from simtree.deploy.costs import deployment_costs

    measured = CommModel({"all_reduce": {2: AlphaBeta(1.0, 1000.0)}}, measured=True, machine="h200", source="x")
    costs = deployment_costs(_toy_bundle(comm=measured.to_dict()))
    assert costs.meta["communication"]["assumed"] is False and costs.comm.params("all_reduce", 2).alpha_us == 1.0
    with pytest.raises(SimtreeError, match="no communication model"):
        deployment_costs(_toy_bundle(device="cpu"))


def test_the_ep_fit_table_in_the_docs_is_current_and_v4_flash_fits_four_h200s():
    from pathlib import Path

    from simtree.deploy.memory import largest_batch, write_fit_doc

    doc = Path(__file__).resolve().parents[1] / "docs" / "deployments.md"
    assert write_fit_doc(doc, write=False), "docs/deployments.md: run python -m simtree.deploy.memory docs/deployments.md"
    # FP8 experts: ep=4 holds it, ep=2 does not; with bf16 experts ep=4 did not
    v4 = get_model("deepseek-v4-flash")
    assert largest_batch(v4, "ep=2", "h200", 4096) == 0 < largest_batch(v4, "ep=4", "h200", 4096)
    assert largest_batch(v4, "ep=4", "h200", 32768) < largest_batch(v4, "ep=4", "h200", 4096)
    import dataclasses
    bf16 = dataclasses.replace(v4, mlp={**v4.mlp, "expert_dtype": "bf16"})
    assert largest_batch(bf16, "ep=4", "h200", 4096) == 0 < largest_batch(bf16, "ep=8", "h200", 4096)
    with pytest.raises(SimtreeError, match="mlp.expert_dtype 'fp4'"):
        dataclasses.replace(v4, mlp={**v4.mlp, "expert_dtype": "fp4"}).weight_bytes()


@pytest.mark.filterwarnings("ignore::simtree.errors.ExtrapolationWarning")
def test_a_block_drafters_round_is_priced_at_the_ranks_batch_as_the_verify_is():
    """Under data-parallel attention each rank drafts for its own ceil(b / dp) sequences: the
    deployment's C_d of a (dense) block drafter is the rank's at that batch, no collectives, and
    the planner's candidate carries it (it was asked at the deployment's b: 8x too many at ep=8)."""
    import dataclasses

    from simtree.acceptance.model import get_workload
    from simtree.costs.forms import BasisSurface
    from simtree.costs.model import DrafterCostModel
    from simtree.deploy.costs import deployment_costs
    from simtree.planning.drafter_candidates import score_spec
    from simtree.planning.modes import PolicySpec

    surf = BasisSurface("draft", [64.0], [2000.0, 1.0, 50.0, 30.0, 0.01, 0.5], ("nodes_per_seq", "num_steps", "batch_size"),
                        {"nodes_per_seq": [4, 32], "num_steps": [4, 10], "batch_size": [1, 64]})
    rank = dataclasses.replace(_toy_bundle("deepseek-v4-flash", "ep=8"),
                               drafters={"block": DrafterCostModel(surf, {"block_len": 7}, "block")})
    costs, d = deployment_costs(rank), parse_deployment("ep=8")
    for b in (1, 8, 9, 32, 64):
        want = float(rank.drafters["block"].predict(8, 7, d.rank_batch(b)))
        assert costs.drafter("block").predict(8, 7, b) == pytest.approx(want, rel=1e-12)
        assert costs.drafters["block"].predict(8, 7, b) == pytest.approx(want, rel=1e-12)
    assert costs.drafter("block").predict(8, 7, 64) < rank.drafters["block"].predict(8, 7, 64)
    assert costs.drafter("block").block_len == 7 and costs.drafters["block"].valid_range["batch_size"] == (1.0, 512.0)
    spec = PolicySpec.from_dict("block", {"budget": 8, "block_len": 7})
    row = score_spec(costs, get_workload("gsm8k").acceptance, spec, 64, 512)
    assert row["draft_us"] == pytest.approx(float(rank.drafters["block"].predict(8, 7, 8)), rel=1e-12)
    assert row["verify_us"] == pytest.approx(float(costs.verify.predict(8, 512, 64)), rel=1e-12)


@pytest.mark.filterwarnings("ignore::simtree.errors.ExtrapolationWarning")
def test_one_rank_plans_the_b_sequences_a_rank_run_measures():
    """A run of one rank (the full runtime's V4 rank: no all-to-all) measures b sequences on the
    rank: one_rank prices them so, where deployment_costs prices a deployment batch b as
    ceil(b / dp) on a rank plus the collectives."""
    from simtree.deploy.costs import deployment_costs, one_rank

    rank = _toy_bundle("deepseek-v4-flash", "ep=8")
    alone = one_rank(rank)
    assert alone.meta["rank_of"] == "ep=8" and deployment_costs(alone) is alone
    assert alone.verify.predict(8, 512, 8) == rank.verify.predict(8, 512, 8)
    assert one_rank(deployment_costs(rank)).verify.predict(8, 512, 8) == rank.verify.predict(8, 512, 8)
    assert deployment_costs(rank).verify.predict(8, 512, 8) != rank.verify.predict(8, 512, 8)
    single = _toy_bundle(deployment="tp=1")
    assert one_rank(single) is single


def test_the_core_reads_the_compressor_storage_the_form_sets():
    """simtree.quant mirrors the form v4_comp for the core (the registry's bytes, the loader), which
    must not import the kernels: set by forms(), restored after, "auto" resolved."""
    from simtree import quant
    from simtree.errors import SimtreeError
    from simtree.kernels.layers.forms import V4_AUTO, forms
    assert quant.comp_proj_storage() == V4_AUTO["v4_comp"] == quant.DEFAULT_COMP_PROJ
    with forms(v4_comp="model"):
        assert quant.comp_proj_storage() == "model"
        with forms(v4_comp="auto"):
            assert quant.comp_proj_storage() == quant.DEFAULT_COMP_PROJ
    assert quant.comp_proj_storage() == quant.DEFAULT_COMP_PROJ
    with pytest.raises(SimtreeError, match="fp32 or model"):
        quant.set_comp_proj_storage("bf16")
    assert quant.attn_proj_storage() == V4_AUTO["v4_proj"] == "fp8"     # and the attention linears' (v4_proj)
    with forms(v4_proj="bf16"):
        assert quant.attn_proj_storage() == "bf16" and quant.comp_proj_storage() == quant.DEFAULT_COMP_PROJ
    assert quant.attn_proj_storage() == "fp8"
    with pytest.raises(SimtreeError, match="fp8 or bf16"):
        quant.set_attn_proj_storage("fp32")
