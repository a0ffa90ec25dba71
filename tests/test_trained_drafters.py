"""Trained block drafters (runtime/drafter_model.py, drafter_train.py): the training module is the
runtime's block forward; the target features it learns from are the runtime's taps; a short
training run writes a whole folder, resumes bit-exactly (after --max-seconds, a kill past its
periodic checkpoint, or SIGINT) and loads in the runtime, whose greedy output stays plain greedy
decoding's; bad input is one line; the shipped drafters accept."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from simtree.errors import SimtreeError  # noqa: E402
from simtree.kernels.layers.drafters import BackboneState, backbone_forward, drafter_config, dspark_draft  # noqa: E402
from simtree.kernels.layers.drafters.tfm import _expand, tfm_candidates  # noqa: E402
from simtree.kernels.layers.head import logits_fp32  # noqa: E402
from simtree.models import get_model  # noqa: E402
from simtree.planning.simulate import PolicySpec  # noqa: E402
from simtree.runtime.drafter_model import BlockDrafterModule, read_drafter, target_features  # noqa: E402
from simtree.runtime.drafter_train import DrafterTrainConfig, train_drafter  # noqa: E402
from simtree.runtime.full.block_drafters import DrafterRound  # noqa: E402
from simtree.runtime.full.block_engine import make_engine  # noqa: E402
from simtree.runtime.full.build import build_model  # noqa: E402
from simtree.runtime.full.decode import decode_prompts  # noqa: E402
from simtree.runtime.full.drafting import round_shape  # noqa: E402
from simtree.runtime.target_model import TargetWithMTP, hf_config, save_folder  # noqa: E402
from simtree.runtime.train_state import TrainingInterrupted, checkpoint_path  # noqa: E402

torch.set_num_threads(1)
SHIPPED = "simtree/data/models/qwen3.5-tiny-sharegpt"
TINY = dict(steps=3, batch_size=2, prefix_len=8, gen_len=12, anchors=4, block_len=4, layers=1, markov_rank=8,
            conversations=8, warmup=2, checkpoint_every=1)
PROMPTS = [[0, 5, 17, 300, 41, 9], [0, 1000, 12, 7]]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A test-size target with the shipped tokenizer (a trained folder's layout)."""
    torch.manual_seed(0)
    folder = save_folder(TargetWithMTP(hf_config("test", vocab_size=2048)).eval(), tmp_path_factory.mktemp("t") / "tgt")
    shutil.copy(f"{SHIPPED}/tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("family", ["block", "dspark", "tfm"])
def test_training_module_is_the_runtime_forward(target_dir, family):
    shape = get_model(str(target_dir))
    sizes = dict(block_len=5, layers=2, target_layers=4, **{"dspark": {"markov_rank": 8}, "block": {},
                                                            "tfm": {"cand_k": 6, "adapter_dim": 8}}[family])
    cfg = drafter_config(shape, family, **sizes)
    emb = torch.randn(cfg.vocab, cfg.h) * 0.1
    module = BlockDrafterModule(cfg, emb, emb, seed=3)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    B, T, p = 2, 16, 9
    ids, feats = torch.randint(0, cfg.vocab - 1, (B, T)), torch.randn(B, T, 4 * cfg.h)
    rnd = DrafterRound(shape, family, batch=B, max_len=32, device="cpu", dtype=torch.float32,
                       ends={"embed": emb, "lm_head": emb}, weights=module.tensors(), **sizes)
    st = BackboneState.new(rnd.cfg, B, 32, p, torch.float32, "cpu")
    hid = backbone_forward(rnd.w, rnd.cfg, st, rnd.rope, feats[:, :p], torch.full((B,), p), ids[:, p])
    if family == "dspark":
        lp, top, conf = dspark_draft(rnd.w, hid, ids[:, p], 3)
        logits, c = module(feats, ids, torch.full((B, 1), p), top[None, :, :, 0].transpose(0, 1))
        torch.testing.assert_close(torch.sigmoid(c[:, 0]), conf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.log_softmax(logits[:, 0], -1).gather(-1, top), lp, rtol=1e-4, atol=1e-4)
    elif family == "tfm":     # the root's conditional over row 0's candidates, then the target path's next node
        path = torch.randint(0, cfg.vocab - 1, (B, 1, cfg.block_len))
        cond, cand = module(feats, ids, torch.full((B, 1), p), path)
        lp, cids = tfm_candidates(rnd.w, hid, 6)
        assert torch.equal(cand[:, 0], cids)
        q_in, cemb = torch.nn.functional.linear(hid, rnd.w["tfm.in"]), torch.nn.functional.embedding(cids, rnd.w["tfm.emb"])
        s0, c0 = _expand(rnd.w, torch.zeros(B, 1, 8), ids[:, p:p + 1], q_in, cemb, lp, torch.zeros(B, 1, dtype=torch.int64), 5)
        _, c1 = _expand(rnd.w, s0, path[:, 0, :1], q_in, cemb, lp, torch.ones(B, 1, dtype=torch.int64), 5)
        torch.testing.assert_close(cond[:, 0, :2], torch.cat([c0, c1], 1), rtol=1e-4, atol=1e-4)
    else:
        logits, c = module(feats, ids, torch.full((B, 1), p))
        assert c is None
        torch.testing.assert_close(logits[:, 0], logits_fp32(hid.reshape(B * cfg.block_len, -1), emb).view_as(logits[:, 0]),
                                   rtol=1e-4, atol=1e-4)


def test_features_are_the_runtime_taps(target_dir):
    from simtree.runtime.target_model import load_folder
    model = build_model(str(target_dir), device="cpu", dtype=torch.float32)
    engine = make_engine(model, round_shape(PolicySpec.from_dict("block", {"budget": 4, "block_len": 4})), 1, 64,
                         sizes={"layers": 1})
    seen = []
    engine._feed_context = seen.extend
    engine.prefill([PROMPTS[0]])
    feats, greedy = target_features(load_folder(target_dir).eval(), torch.tensor([PROMPTS[0]]), engine.verify_kw["taps"])
    torch.testing.assert_close(seen[0], feats[0], rtol=1e-4, atol=1e-4)
    assert greedy.shape == (1, len(PROMPTS[0]))


def _weights(folder):
    return read_drafter(folder)[1]


def _same_job(a, b):
    """The same weights and, step by step, the same losses (the log without its seconds)."""
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = lambda f: [r.rsplit(",", 1)[0] for r in (f / "training_log.csv").read_text().splitlines()]  # noqa: E731
    assert rows(a) == rows(b)


@pytest.fixture(scope="module")
def whole(target_dir, tmp_path_factory):
    """The uninterrupted dspark run of TINY: (its record, its folder)."""
    out = tmp_path_factory.mktemp("whole") / "dspark"
    return train_drafter(target_dir, DrafterTrainConfig(family="dspark", **TINY), out=out), out


class Killed(Exception):
    """Stands for kill -9: the process dies mid-job, nothing is saved at that moment."""


def test_a_killed_drafter_job_resumes_from_its_periodic_checkpoint(target_dir, whole, tmp_path):
    out, cfg = tmp_path / "d", DrafterTrainConfig(family="dspark", **{**TINY, "checkpoint_every": 2})

    def die_at_step_3(step, loss):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train_drafter(target_dir, cfg, out=out, progress=die_at_step_3)
    assert {p.name for p in out.iterdir()} == {"checkpoint.safetensors"}    # written at step 2, not published
    with pytest.raises(SimtreeError, match="unfinished run: pass --resume"):
        train_drafter(target_dir, cfg, out=out)
    steps = []
    done = train_drafter(target_dir, cfg, out=out, resume=True, progress=lambda s, l: steps.append(s))
    assert steps == [3] and done["complete"] and not checkpoint_path(out).exists()
    _same_job(out, whole[1])


def test_sigint_checkpoints_a_drafter_job_and_resume_finishes_it(target_dir, whole, tmp_path):
    import os
    import signal

    out, cfg = tmp_path / "d", DrafterTrainConfig(family="dspark", **{**TINY, "checkpoint_every": 5})

    def ctrl_c_at_step_1(step, loss):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)    # handled: the loop checkpoints before the next step

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"checkpoint saved at step 1/3 .*--resume") as exc:
        train_drafter(target_dir, cfg, out=out, progress=ctrl_c_at_step_1)
    assert exc.value.step == 1 and exc.value.checkpoint == checkpoint_path(out) and exc.value.checkpoint.is_file()
    assert signal.getsignal(signal.SIGINT) is handler      # the previous handler is back
    steps = []
    done = train_drafter(target_dir, cfg, out=out, resume=True, progress=lambda s, l: steps.append(s))
    assert steps == [2, 3] and done["complete"] and not checkpoint_path(out).exists()
    _same_job(out, whole[1])


def test_train_resume_load_and_lossless(target_dir, whole, tmp_path):
    rec, folder = whole
    assert rec["complete"] and rec["steps"] == 3 and 0 <= rec["heldout_chain_accept"] <= TINY["block_len"]
    rec = json.loads((folder / "training.json").read_text())
    assert rec["family"] == "dspark" and rec["taps"] == [0, 1, 2, 3]
    assert len((folder / "training_log.csv").read_text().splitlines()) == 4
    # stopped after one step (published with its checkpoint), then resumed: the same weights
    part = train_drafter(target_dir, DrafterTrainConfig(family="dspark", **{**TINY, "max_seconds": 0.0}),
                         out=target_dir / "drafters" / "dspark")
    assert not part["complete"] and checkpoint_path(target_dir / "drafters" / "dspark").is_file()
    with pytest.raises(SimtreeError, match="--resume"):
        train_drafter(target_dir, DrafterTrainConfig(family="dspark", **TINY))
    done = train_drafter(target_dir, DrafterTrainConfig(family="dspark", **TINY), resume=True)
    assert done["complete"] and not checkpoint_path(target_dir / "drafters" / "dspark").exists()
    _same_job(folder, target_dir / "drafters" / "dspark")
    # the runtime loads it (no note) and stays lossless; block has no trained drafter here: a note
    model = build_model(str(target_dir), device="cpu", dtype=torch.float32)
    plain = decode_prompts(model, PROMPTS, PolicySpec.from_dict("none", {}), 12)["outputs"]
    spark = decode_prompts(model, PROMPTS, PolicySpec.from_dict("dspark", {"block_len": 4, "threshold": 0.0}), 12)
    assert spark["outputs"] == plain and spark["notes"] == []
    blk = decode_prompts(model, PROMPTS, PolicySpec.from_dict("block", {"budget": 5, "block_len": 4}), 12)
    assert blk["outputs"] == plain and "no trained block drafter" in blk["notes"][0]
    with pytest.raises(SimtreeError, match="adapts a trained block drafter"):
        train_drafter(target_dir, DrafterTrainConfig(family="tfm", **TINY))
    train_drafter(target_dir, DrafterTrainConfig(family="block", **TINY))
    tfm = train_drafter(target_dir, DrafterTrainConfig(family="tfm", **TINY, cand_k=5, adapter_dim=4))
    assert tfm["trainable_parameters"] < tfm["parameters"]          # the block backbone kept
    base, adapter = _weights(target_dir / "drafters" / "block"), _weights(target_dir / "drafters" / "tfm")
    assert all(torch.equal(base[k], adapter[k]) for k in base)
    model = build_model(str(target_dir), device="cpu", dtype=torch.float32)
    for mode, params in [("block", {"budget": 5, "block_len": 4}), ("tfm", {"budget": 5, "width": 2, "block_len": 4})]:
        run = decode_prompts(model, PROMPTS, PolicySpec.from_dict(mode, params), 12)
        assert run["outputs"] == plain and run["notes"] == []
    with pytest.raises(SimtreeError, match="drafts 4 positions"):     # the trained block is 4 long
        decode_prompts(model, PROMPTS, PolicySpec.from_dict("dspark", {"block_len": 6, "threshold": 0.0}), 4)


def test_bad_input_is_one_line(target_dir, tmp_path):
    with pytest.raises(SimtreeError, match="--drafter 'eagle'"):
        DrafterTrainConfig(family="eagle").validate()
    with pytest.raises(SimtreeError, match="not a trained target folder"):
        train_drafter(tmp_path, DrafterTrainConfig(**TINY), out=tmp_path / "o")
    with pytest.raises(SimtreeError, match="unreadable"):
        read_drafter(tmp_path / "nothing")
    with pytest.raises(SimtreeError, match="--resume: .* no training checkpoint"):
        train_drafter(target_dir, DrafterTrainConfig(**TINY), out=tmp_path / "fresh", resume=True)
    shape = get_model(str(target_dir))
    emb = torch.zeros(2048, 32)
    with pytest.raises(SimtreeError, match="has shape"):
        DrafterRound(shape, "block", batch=1, max_len=8, device="cpu", dtype=torch.float32, layers=1,
                     ends={"embed": emb, "lm_head": emb}, weights={"fc": torch.zeros(3, 3)})
    with pytest.raises(SimtreeError, match="lack"):
        DrafterRound(shape, "block", batch=1, max_len=8, device="cpu", dtype=torch.float32, layers=1,
                     ends={"embed": emb, "lm_head": emb}, weights={"fc": torch.zeros(32, 32 * 5)})


@pytest.mark.parametrize("mode,params", [("block", {"budget": 8}), ("dspark", {"threshold": 0.0}),
                                         ("tfm", {"budget": 8, "width": 2})])
def test_shipped_drafters_accept_and_stay_lossless(mode, params):
    from simtree.runtime.bpe import BpeTokenizer
    from simtree.runtime.data import prompts
    model = build_model(SHIPPED, device="cpu", dtype=torch.float32)
    tok = BpeTokenizer.from_file(SHIPPED)
    ids = [tok.encode(p) for p in prompts("sharegpt", 2)]
    plain = decode_prompts(model, ids, PolicySpec.from_dict("none", {}), 24)["outputs"]
    run = decode_prompts(model, ids, PolicySpec.from_dict(mode, params), 24)
    assert run["outputs"] == plain and run["notes"] == []
    assert run["accepted_tokens_per_round"] > 1.5      # random weights accept ~1.0


def test_a_drafter_trained_on_other_target_layers_is_refused(tmp_path):
    """The shipped drafters load (their recorded taps are the target's); a copy whose config
    names the same number of layers in another order (features concatenated otherwise) is
    refused in one line naming both lists."""
    from simtree.runtime.full.block_engine import trained_drafter
    model = build_model(SHIPPED, device="cpu", dtype=torch.float32)
    for family in ("block", "dspark", "tfm"):
        assert trained_drafter(model, family) is not None
    copy = shutil.copytree(SHIPPED, tmp_path / "tgt")
    path = copy / "drafters" / "block" / "config.json"
    config = json.loads(path.read_text())
    assert config["taps"] == [0, 1, 2, 3]
    path.write_text(json.dumps({**config, "taps": [3, 2, 1, 0]}))
    rs = round_shape(PolicySpec.from_dict("block", {"budget": 4, "block_len": 4}))
    with pytest.raises(SimtreeError, match="trained on target layers") as err:
        make_engine(build_model(str(copy), device="cpu", dtype=torch.float32), rs, 1, 64)
    assert "[3, 2, 1, 0]" in str(err.value) and "[0, 1, 2, 3]" in str(err.value)
    assert "\n" not in str(err.value)


def test_acceptance_table_replaces_its_block_only(tmp_path):
    from simtree.runtime.drafter_acceptance import BEGIN, END, POLICIES, table_markdown, write_docs
    rows = [{"drafter": d, "shape": s, "accepted_per_round": 2.5, "verified_drafts_per_round": 3.0, "lossless": True}
            for d, s, _, _ in POLICIES]
    doc = tmp_path / "d.md"
    doc.write_text(f"# head\n{BEGIN}\nold\n{END}\ntail\n")
    write_docs(doc, table_markdown(rows, 900, 32, 64, "abc1234"))
    text = doc.read_text()
    assert text.startswith("# head\n") and text.endswith(f"{END}\ntail\n") and "old" not in text
    assert text.count("| 2.50 | 3.0 | yes |") == len(POLICIES) and "abc1234" in text
    doc.write_text("no markers")
    with pytest.raises(SimtreeError, match="needs one"):
        write_docs(doc, "x")


def test_cli_bad_input_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from simtree.cli import app
    for args, want in [(["--drafter", "eagle"], "--drafter 'eagle'"), (["--drafter", "block"], "not a trained target")]:
        result = CliRunner().invoke(app, ["train-drafter", "--model", str(tmp_path), *args])
        assert isinstance(result.exception, SimtreeError) and want in str(result.exception)   # main: one line, exit 2
