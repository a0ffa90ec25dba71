"""simtree's controller inside SGLang: the exported config read by SGLang's own loaders and
launch parser, SGLang's own AdaptiveController driving the policy step by step (the same steps a
plain Controller picks, within its switch bound), the plugin installed through SGLang's own
plugin loader in a fresh process, and bad configs as one line (skipped where sglang is missing)."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from simtree.acceptance.model import get_workload
from simtree.cli import app
from simtree.control import Controller
from simtree.control.tiers import chain_spec
from simtree.costs.model import load_costs
from simtree.engines.sglang_controller import CONFIG_KEY, SimtreeAdaptiveParams
from simtree.errors import SimtreeError
from simtree.planning.modes import LinearParams, NoneParams
from simtree.serving.policies import sample_tier

from test_export_engines import QWEN, runner, sglang_dir  # noqa: E402,F401  (the export's module fixture)

pytest.importorskip("sglang.srt.speculative.adaptive_spec_params")


@pytest.fixture(scope="module")
def exported(sglang_dir):
    assert (sglang_dir / "adaptive_controller.json").is_file()
    return sglang_dir


def _with_steps(src: Path, dst: Path, steps: list[int], **settings) -> Path:
    """The exported controller config with every batch slot's candidates set to ``steps``."""
    cfg = json.loads((src / "adaptive_controller.json").read_text())
    for key in cfg:
        if key.isdigit():
            cfg[key]["candidate_steps"] = steps
    cfg[CONFIG_KEY]["settings"] = settings
    dst.mkdir(exist_ok=True)
    (dst / "costs.json").write_text((src / "costs.json").read_text())
    (dst / "adaptive_controller.json").write_text(json.dumps(cfg))
    return dst / "adaptive_controller.json"


def test_the_controller_config_is_sglangs_own_adaptive_config(exported):
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative import adaptive_spec_params as adaptive

    path = str(exported / "adaptive_controller.json")
    cfg, slots = adaptive._load_adaptive_config(path)
    assert CONFIG_KEY in cfg and 1 in slots
    assert slots == adaptive._load_adaptive_config(str(exported / "adaptive_config.json"))[1]
    sglangs = adaptive.AdaptiveSpeculativeParams(3, path)          # without the plugin: SGLang's own steps
    assert sglangs.get_steps_for_batch(1) in slots[1]["candidate_steps"]
    ours = SimtreeAdaptiveParams(3, path)
    assert ours.candidate_steps == adaptive.resolve_candidate_steps_from_config(path) == sglangs.candidate_steps
    argv = shlex.split((exported / "launch_controller.txt").read_text())[3:]
    argv = [str(exported / a) if (exported / a).is_file() else a for a in argv]
    parsed = prepare_server_args(argv)
    assert parsed.speculative_adaptive and parsed.speculative_eagle_topk == 1
    assert Path(parsed.speculative_adaptive_config).name == "adaptive_controller.json"
    assert adaptive.adaptive_unsupported_reason(parsed) is None
    assert max(ours.candidate_steps) <= parsed.speculative_num_steps
    manifest = json.loads((exported / "export.json").read_text())["controller"]
    assert manifest["written"] and manifest["steps"] == ours.candidate_steps


class _Worker:
    """SGLang's AdaptiveSpecWorker protocol: a runtime state per step, the active one applied."""

    def __init__(self, steps: int):
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState
        self.state_cls, self.speculative_num_steps, self.built = SpecRuntimeState, steps, {}

    def build_adaptive_runtime_state(self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        self.built[speculative_num_steps] = cuda_graph_bs
        return self.state_cls(speculative_num_steps, speculative_num_draft_tokens, None, None, "verify", None, None,
                              None)

    def apply_runtime_state(self, state):
        self.speculative_num_steps = state.speculative_num_steps


def test_sglangs_controller_runs_the_steps_simtree_chooses(exported, tmp_path):
    """SGLang's AdaptiveController asks the policy before every step and feeds it every verify:
    the worker runs the step a plain Controller (same bundle, acceptance and chains, fed the same
    accepted drafts) picks, every candidate step is built at every CUDA-graph batch size, and the
    switches stay within the controller's bound."""
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    path = _with_steps(exported, tmp_path, [0, 1, 2, 3, 5])
    policy = SimtreeAdaptiveParams(3, str(path))
    worker = _Worker(3)
    ctl = AdaptiveController(worker, policy)
    ctl.register(worker.build_adaptive_runtime_state(3, 4))     # the launch's own state, as SGLang registers it
    worker.built.clear()
    graphs = [1, 2, 4, 8, 16, 32, 64]
    ctl.init_states(cuda_graph_bs=graphs)
    assert set(worker.built) == {0, 1, 2, 5} and all(bs == graphs for bs in worker.built.values())
    sim = json.loads(path.read_text())[CONFIG_KEY]
    ref = Controller(load_costs(tmp_path / "costs.json"), get_workload(sim["workload"]).acceptance,
                     specs=[chain_spec(s) for s in (0, 1, 2, 3, 5)],
                     plain_draft="extend")
    rng = np.random.default_rng(0)
    ran = []
    for bs in [1] * 40 + [64] * 60 + [8] * 40 + [1] * 40:
        ctl.activate_step_by_batch(bs)
        want = ref.choose(bs, [sim["context_len"]])
        assert worker.speculative_num_steps == (0 if want.spec.mode == "none" else want.spec.budget - 1)
        tier = policy.controller.tiers[policy.steps.index(worker.speculative_num_steps)]
        accepted = sample_tier(tier, rng.integers(0, tier.cdf.shape[0], bs), rng.random(bs))
        ref.observe(want, accepted)
        ctl.on_verify_complete([int(a) for a in accepted], bs)
        ran.append(worker.speculative_num_steps)
    assert len(set(ran)) >= 2                                     # it moved with the load
    c = policy.controller
    assert c.switches == ref.switches <= c.max_switches and c.steps == len(ran)


def test_an_overlapped_verify_is_credited_to_the_step_that_ran_it(exported, tmp_path):
    """Overlap scheduling: step t + 1 is chosen before step t's verify reports; each verify goes to
    the tier that ran it, also when the two steps ran different tiers."""
    path = _with_steps(exported, tmp_path, [0, 5], min_dwell_steps=1)   # a credit every step
    policy = SimtreeAdaptiveParams(1, str(path))
    picks = {b: policy.controller.tiers[int(np.argmax(policy.controller.objective(b, policy.context_len)))].name
             for b in (1, 64)}
    assert picks[1] != picks[64]                     # the two batch sizes rank different tiers first
    seen = []
    policy.controller.observe = lambda tier, acc: seen.append((tier.name, list(acc)))
    names = {s: t.name for s, t in zip(policy.steps, policy.controller.tiers)}
    first = policy.get_steps_for_batch(1)
    second = policy.get_steps_for_batch(64)          # chosen before the first step's verify reports
    assert (names[first], names[second]) == (picks[1], picks[64])
    assert policy.on_verify_complete([1], 1) is None
    third = policy.get_steps_for_batch(1)
    policy.on_verify_complete([0] * 64, 64)
    policy.on_verify_complete([2], 1)
    assert seen == [(names[first], [1]), (names[second], [0] * 64), (names[third], [2])]


_PLUGIN = r"""
import json, sys, types
from sglang.srt.speculative import adaptive_spec_params as a
keep = {"original": a.AdaptiveSpeculativeParams}    # in a dict: SGLang's patch rebinds module names holding it
stale = types.ModuleType("stale_importer")          # as eagle_worker_v2 imports it, before the plugins load
stale.AdaptiveSpeculativeParams = keep["original"]
sys.modules["stale_importer"] = stale
from sglang.srt.plugins import load_plugins
load_plugins()
ours = a.AdaptiveSpeculativeParams(3, sys.argv[1])
plain = a.AdaptiveSpeculativeParams(3, sys.argv[2])
default = stale.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=None)
print(json.dumps({"patched": a.AdaptiveSpeculativeParams is not keep["original"],
                  "stale_patched": stale.AdaptiveSpeculativeParams is a.AdaptiveSpeculativeParams,
                  "ours": type(ours).__name__, "plain": type(plain).__name__, "default": type(default).__name__,
                  "plain_is_sglangs": type(plain) is keep["original"], "steps": ours.candidate_steps}))
"""


def test_the_plugin_loads_through_sglangs_plugin_loader(exported):
    """A fresh process, as SGLang's scheduler starts: its own ``load_plugins`` finds simtree's entry
    point; a config with the "simtree" entry builds simtree's policy, any other SGLang's own class;
    a module that imported the class before the plugins loaded sees the replacement."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    r = subprocess.run([sys.executable, "-c", _PLUGIN, str(exported / "adaptive_controller.json"),
                        str(exported / "adaptive_config.json")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["patched"] and got["stale_patched"]
    assert got["ours"] == "SimtreeAdaptiveParams" and got["plain_is_sglangs"]
    assert got["plain"] == got["default"] == "AdaptiveSpeculativeParams"
    assert got["steps"] == json.loads((exported / "export.json").read_text())["controller"]["steps"]


@pytest.mark.parametrize("edit, message", [
    (lambda c, d: c[CONFIG_KEY].update(format="other/9"), "this simtree reads simtree.sglang_controller/1"),
    (lambda c, d: c[CONFIG_KEY].pop("context_len"), "context_len is missing or of the wrong kind"),
    (lambda c, d: c[CONFIG_KEY].update(settings={"dwell": 3}), "settings: unknown dwell"),
    (lambda c, d: (d / "costs.json").unlink(), "costs.json not found"),
    (lambda c, d: (d / "costs.json").write_text((d / "costs.json").read_text() + " "), "is not the bundle"),
    (lambda c, d: c.update({"1": {"candidate_steps": []}}), "batch 1: candidate_steps must be a non-empty list"),
    (lambda c, d: c.update({CONFIG_KEY: []}), "must be an object"),
    (lambda c, d: c[CONFIG_KEY].update(costs_sha256=123), "costs_sha256 must be a string"),
    (lambda c, d: c[CONFIG_KEY].update(context_len=float("inf")), "context_len must be a finite count"),
    (lambda c, d: c[CONFIG_KEY].update(settings={"margin": "0.1"}), "settings: a value of the wrong kind"),
    (lambda c, d: c[CONFIG_KEY].update(workload="mine.json"), "'mine.json' is neither a preset"),
])
def test_a_bad_controller_config_is_one_line(exported, tmp_path, edit, message):
    path = _with_steps(exported, tmp_path, [1, 2])
    cfg = json.loads(path.read_text())
    edit(cfg, tmp_path)
    path.write_text(json.dumps(cfg))
    with pytest.raises(SimtreeError) as err:
        SimtreeAdaptiveParams(3, str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_acceptance_files_travel_with_the_config(tmp_path):
    """An engine's measured acceptance (import-metrics) as what the controller ranks with: copied
    beside the config and read from there."""
    engines = Path(__file__).parent / "data" / "engines"
    r = runner.invoke(app, ["import-metrics", str(engines / "vllm_metrics.prom"), "--engine", "vllm",
                            "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    acc = tmp_path / "m" / "acceptance.json"
    out = tmp_path / "o"
    r = runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(out), "--acceptance", str(acc)])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "adaptive_controller.json").read_text())
    assert cfg[CONFIG_KEY]["workload"] == "acceptance.json" and (out / "acceptance.json").read_text() == acc.read_text()
    acc.unlink()                                   # the copy beside the config is what it reads
    policy = SimtreeAdaptiveParams(3, str(out / "adaptive_controller.json"))
    want = get_workload(str(out / "acceptance.json")).acceptance
    assert [t.expected_accepted for t in policy.controller.tiers] == [
        t.expected_accepted for t in Controller(policy.controller.costs, want, specs=policy.controller.specs).tiers]


def test_a_bundle_with_crlf_line_ends_travels(tmp_path):
    """The copy beside the config is checked against the digest of the copy as written."""
    from simtree.data import data_path
    crlf = tmp_path / "bundle.json"
    crlf.write_bytes(data_path("costs", "h200_qwen3.6-27b_tp1.json").read_bytes().replace(b"\n", b"\r\n"))
    r = runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(tmp_path / "o"), "--costs", str(crlf)])
    assert r.exit_code == 0, r.output
    assert SimtreeAdaptiveParams(3, str(tmp_path / "o" / "adaptive_controller.json")).candidate_steps


def test_no_preset_and_no_acceptance_writes_no_controller(tmp_path):
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "candidates.csv").write_text((QWEN / "candidates.csv").read_text())
    policy = json.loads((QWEN / "policy.json").read_text())
    policy["source"]["workloads"]["sharegpt"]["source"] = "traces.jsonl (fitted)"
    (plan / "policy.json").write_text(json.dumps(policy))
    out = tmp_path / "o"
    assert runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(out)]).exit_code == 0
    assert (out / "adaptive_controller.json").exists()
    r = runner.invoke(app, ["export", "sglang", str(plan), "--out", str(out)])   # again into the same folder
    assert r.exit_code == 0, r.output
    assert "controller: not written: workload 'sharegpt' is not a preset: give --acceptance" in r.output
    assert not (out / "adaptive_controller.json").exists() and not (out / "launch_controller.txt").exists()
    assert (out / "adaptive_config.json").exists()
    r = runner.invoke(app, ["export", "sglang", str(QWEN), "--out", str(tmp_path / "p"), "--acceptance", "nowhere.json"])
    assert isinstance(r.exception, SimtreeError) and "neither a preset" in str(r.exception)
    assert not (tmp_path / "p").exists()
    r = runner.invoke(app, ["export", "vllm", str(QWEN), "--out", str(tmp_path / "v"), "--acceptance", "sharegpt"])
    assert isinstance(r.exception, SimtreeError) and "--acceptance is SGLang's" in str(r.exception)


def test_sglangs_plain_rounds_run_the_drafters_extend(tmp_path):
    """SGLang keeps its drafter level: a step-0 round runs the draft extend over each request's
    row.  The controller inside SGLang prices plain decoding so (C_v(1) + C_d(1, 1, b), no lag
    share), and the benchmark's SGLang driver charges it to every step-0 round, never a catch-up."""
    from simtree.control.catchup import catch_up_us
    from simtree.data import data_path
    from simtree.serving.policies import SGLangAdaptiveDriver

    costs = load_costs(data_path("costs", "h200_qwen3.6-27b_tp1.json"))
    acc = get_workload("sharegpt").acceptance
    specs = [NoneParams(), LinearParams(3)]
    extend = Controller(costs, acc, specs=specs, plain_draft="extend")
    for b in (1, 8, 64):
        want = b / (costs.verify.predict(1.0, 700.0, b) + catch_up_us(costs, 1, b)) * 1e6
        assert extend.predicted_tok_s(b, 700.0)[0] == pytest.approx(want, rel=1e-9)
    with pytest.raises(SimtreeError, match="plain_draft 'eager' must be one of lag, extend"):
        Controller(costs, acc, specs=specs, plain_draft="eager")

    class Steps:   # SGLang's policy interface, pinned to a step
        def __init__(self, s):
            self.s = s

        def get_steps_for_batch(self, b):
            return self.s

        def on_verify_complete(self, acc, b):
            return None

    assert not SGLangAdaptiveDriver.lags
    ctx, levels, u = np.full(8, 700.0), np.zeros(8, np.int64), np.full(8, 0.5)
    plain_us, accepted, _ = SGLangAdaptiveDriver(costs, acc, Steps(0)).step(8, ctx, levels, u)
    assert plain_us == pytest.approx(float(costs.verify.predict(1.0, 700.0, 8)) + catch_up_us(costs, 1, 8))
    assert not accepted.any()
    chain_us, *_ = SGLangAdaptiveDriver(costs, acc, Steps(2)).step(8, ctx, levels, u)
    assert chain_us == pytest.approx(float(costs.draft.predict(2, 1, 8) + costs.verify.predict(3.0, 700.0, 8)))
