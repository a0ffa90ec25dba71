"""A planned policy written as what SGLang and vLLM take today, and what each loses.

SGLang 0.5.23 (``sglang/srt/speculative/adaptive_spec_params.py``, ``server_args.py``,
``speculative/dspark_components/dspark_sps.py``):

- ``launch_static.txt``: ``--speculative-algorithm EAGLE`` with the plan's static tree at the
  reference batch size (:func:`simtree.planning.sglang.export`, the code path of ``simtree sglang``);
- ``launch_adaptive.txt`` + ``adaptive_config.json``: ``--speculative-adaptive`` takes a JSON
  keyed by batch size (a batch routes to the largest key <= it) whose ``candidate_steps`` are
  the linear draft steps (top-k 1 only) an EMA of accept length moves between;
  simtree's candidates per key are the linear steps predicted within ``NEAR_BEST`` of the best
  linear at that batch (0 where plain decoding is best); hysteresis and EMA keep SGLang's defaults;
- ``sps_table.json``: an ``SpsAdditiveCostTable`` (step seconds = bias + alpha(num_reqs) +
  theta(num_reqs + budget)) fitted to simtree's verify + draft cost at the deployment, which
  DSpark's ``compute_verify_token_budget`` reads (``--speculative-dspark-sps-table-path``);
- ``launch_controller.txt`` + ``adaptive_controller.json`` (+ ``costs.json``, the bundle, and the
  acceptance file where it is not a preset): the adaptive launch with simtree's online controller
  choosing every step's draft steps (:mod:`.sglang_controller`), where simtree is installed in
  SGLang's environment (its plugin, :mod:`.sglang_plugin`); elsewhere SGLang reads the same
  file's per-batch candidates with its own class, as ``adaptive_config.json``.

vLLM (Dynamic SD, vllm-project/vllm pull request 32374): ``speculative_config.json`` with
``num_speculative_tokens`` (the startup maximum) and ``num_speculative_tokens_per_batch_size``
(inclusive ``"lo-hi"`` batch ranges -> draft tokens, 0 = off): the best linear length per
planned batch range.

Neither engine runs trees under its adaptive scheme nor per-round budgets: ``export.json``
gives, per planned batch range, the plan's predicted tok/s, the exported policy's and the loss.
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from simtree.acceptance.model import PRESETS, get_workload
from simtree.control.controller import Controller
from simtree.control.tiers import chain_spec
from simtree.costs.model import load_costs
from simtree.parallel import parse_deployment
from simtree.deploy.costs import bundle_deployment
from simtree.deploy.shipped import shipped_bundle, shipped_machine_for
from simtree.errors import SimtreeError
from simtree.fileio import write_text_atomic
from simtree.planning.planner import read_candidates
from simtree.planning.policy_file import Policy
from simtree.planning.sglang import export as sglang_static

from .sglang_controller import COSTS_FILE, controller_config, slot_steps

__all__ = ["ENGINES", "NEAR_BEST", "TierRow", "export_policy", "linear_tiers", "sps_additive_table",
           "adaptive_config", "vllm_per_batch_size",
           "parse_vllm_tiers", "policy_path"]

ENGINES = ("sglang", "vllm")
NEAR_BEST = 0.05   # a linear length within 5% of the best linear's predicted tok/s is an adaptive candidate


@dataclass(frozen=True)
class TierRow:
    batch_min: int
    batch_max: int
    planned: str
    planned_tok_s: float
    best_linear_steps: int          # draft tokens of the best linear (0: plain decoding)
    best_linear_tok_s: float
    candidate_steps: tuple[int, ...]

    @property
    def loss(self) -> float:
        return max(0.0, 1.0 - self.best_linear_tok_s / self.planned_tok_s)


def policy_path(policy: str | Path) -> Path:
    """``policy.json`` itself, or the ``simtree plan`` folder that holds it."""
    p = Path(policy)
    if p.is_dir():
        p = p / "policy.json"
    if not p.is_file():
        raise SimtreeError(f"{policy}: no policy.json (give a folder written by `simtree plan` or its policy.json)")
    return p


def linear_tiers(policy: Policy, path: Path, workload: str) -> list[TierRow]:
    """Per planned batch range of ``workload``: the plan's choice and the linear lengths an
    engine can run there, from the planner's scored candidates (``candidates.csv``)."""
    entries = sorted((e for e in policy.entries if e.workload == workload), key=lambda e: e.batch_min)
    if not entries:
        raise SimtreeError(f"{path}: no entries for workload {workload!r} (has {', '.join(policy.workloads)})")
    cands = read_candidates(path.with_name("candidates.csv"), policy)
    rows = []
    for e in entries:
        c = cands[(cands["workload"] == workload) & (cands["batch_size"] == e.batch_max)
                  & cands["mode"].isin(("none", "linear"))]
        if c.empty:
            raise SimtreeError(f"{path.with_name('candidates.csv')}: no linear candidate at batch {e.batch_max}")
        steps = (c["budget"].astype(int) - 1).clip(lower=0).to_numpy()
        tok = c["tok_s"].astype(float).to_numpy()
        best = int(np.argmax(tok))
        near = sorted({int(s) for s, t in zip(steps, tok) if t >= (1 - NEAR_BEST) * tok[best]})
        rows.append(TierRow(e.batch_min, e.batch_max, e.params.name, float(e.predicted_tok_s), int(steps[best]),
                            float(tok[best]), tuple(near)))
    if rows[0].batch_min != 1:
        raise SimtreeError(f"{path}: the plan's batch ranges for {workload!r} start at {rows[0].batch_min}, not 1")
    return rows


def adaptive_config(rows: list[TierRow]) -> dict:
    """SGLang's ``--speculative-adaptive-config``: each planned range's first batch size ->
    the linear draft steps near the best there (SGLang routes a batch to the largest key <= it)."""
    return {str(r.batch_min): {"candidate_steps": list(r.candidate_steps)} for r in rows}


def vllm_per_batch_size(rows: list[TierRow]) -> dict:
    """vLLM's ``num_speculative_tokens_per_batch_size``: inclusive "lo-hi" -> best linear drafts."""
    return {f"{r.batch_min}-{r.batch_max}": r.best_linear_steps for r in rows}


def parse_vllm_tiers(mapping, where: str) -> list[tuple[int, int, int]]:
    """vLLM's ``num_speculative_tokens_per_batch_size`` ({"lo-hi": k}) as sorted (lo, hi, k);
    it must cover batch 1 (vLLM has no K for a batch below its first range)."""
    if not isinstance(mapping, dict) or not mapping:
        raise SimtreeError(f"{where}: num_speculative_tokens_per_batch_size must be an object {{\"lo-hi\": k}}")
    tiers = []
    for key, k in mapping.items():
        try:
            lo, hi = (int(x) for x in str(key).split("-"))
        except ValueError:
            raise SimtreeError(f"{where}: batch range {key!r} is not \"lo-hi\"") from None
        if not (1 <= lo <= hi) or isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SimtreeError(f"{where}: tier {key!r}: {k!r} (need 1 <= lo <= hi and k >= 0 draft tokens)")
        tiers.append((lo, hi, k))
    tiers.sort()
    if tiers[0][0] != 1:
        raise SimtreeError(f"{where}: the tier table does not cover batch 1 (first range starts at {tiers[0][0]})")
    return tiers


def _mean_context(policy: Policy, workload: str) -> float:
    wl = (policy.source.get("workloads") or {}).get(workload) or {}
    prompt, out = wl.get("mean_prompt_len"), wl.get("output_len")
    if isinstance(prompt, (int, float)) and isinstance(out, (int, float)):
        return float(prompt) + float(out) / 2
    w = get_workload(workload)
    return w.mean_prompt_len + w.output_len / 2


def sps_additive_table(costs, context_len: float, gamma: int, max_batch: int) -> tuple[dict, float]:
    """SGLang's ``SpsAdditiveCostTable`` fields fitted (least squares) to simtree's step time
    C_d(gamma, 1, b) + C_v((b + budget) / b, l, b) over b in powers of two up to ``max_batch`` and
    budget in 0..b*gamma; returns (fields, max relative error of the fit on that grid)."""
    bs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch] or [1]
    m_probes = sorted({b * (1 + j) for b in bs for j in range(gamma + 1)})
    grid = [(b, b + budget) for b in bs for budget in range(0, b * gamma + 1, max(1, b // 2))]
    t = np.array([float(costs.draft.predict(gamma, 1, b)) + float(costs.verify.predict(m / b, context_len, b))
                  for b, m in grid]) * 1e-6
    nb, nm = len(bs), len(m_probes)
    A = np.zeros((len(grid), nb - 1 + nm))
    for row, (b, m) in enumerate(grid):
        if bs.index(b) > 0:
            A[row, bs.index(b) - 1] = 1.0       # alpha(bs[0]) = 0: the bias holds it
        hi = int(np.searchsorted(m_probes, m))
        if m_probes[hi] == m:
            A[row, nb - 1 + hi] = 1.0
        else:
            lo, f = hi - 1, (m - m_probes[hi - 1]) / (m_probes[hi] - m_probes[hi - 1])
            A[row, nb - 1 + lo], A[row, nb - 1 + hi] = 1 - f, f
    x, *_ = np.linalg.lstsq(A, t, rcond=None)
    alpha, theta = np.concatenate([[0.0], x[:nb - 1]]), x[nb - 1:]
    bias = max(0.5 * float(theta.min()), 1e-6)   # SGLang requires bias > 0
    theta = theta - bias
    err = float(np.max(np.abs(A @ x - t) / t))
    return ({"bias_seconds": bias, "bs_probes": bs, "alpha_seconds": [float(a) for a in alpha],
             "m_probes": [int(m) for m in m_probes], "theta_seconds": [float(v) for v in theta]}, err)


def _costs_for(policy: Policy, costs_path: str | None):
    if costs_path:   # the SPS table times the policy's model at its deployment: another bundle's is not it
        bundle = load_costs(costs_path)
        model, dep = bundle.meta.get("model"), bundle_deployment(bundle).name
        if (model, dep) != (policy.model, parse_deployment(policy.deployment).name):
            raise SimtreeError(f"--costs {costs_path} times {model} at {dep}; the policy plans {policy.model} at "
                               f"{policy.deployment}: give that model and deployment's bundle (or leave --costs out)")
        return bundle, costs_path
    path = shipped_bundle(policy.model, parse_deployment(policy.deployment), shipped_machine_for(policy.device))
    if not Path(path).is_file():
        raise SimtreeError(f"no shipped cost bundle for {policy.model} at {policy.deployment}: give --costs")
    return load_costs(path), str(path)


def _controller_acceptance(policy: Policy, workload: str, acceptance: str | None) -> tuple[str, Path | None] | str:
    """(the acceptance the controller config names, the file to copy beside it or None), or why
    no controller config is written: ``acceptance`` (a preset name or a file), else the
    workload where the plan took it from its preset."""
    if acceptance is None:
        src = str(((policy.source.get("workloads") or {}).get(workload) or {}).get("source", ""))
        if workload in PRESETS and src.startswith("preset"):
            return workload, None
        return (f"workload {workload!r} is not a preset: give --acceptance (its traces or an acceptance.json) "
                "for the controller")
    if acceptance in PRESETS:
        return acceptance, None
    path = Path(acceptance)
    if not path.is_file():
        raise SimtreeError(f"--acceptance {acceptance}: neither a preset ({', '.join(PRESETS)}) nor a file (a traces "
                           "file of one workload, or an acceptance.json; the controller config copies it whole)")
    return "acceptance" + "".join(path.suffixes[-1:]), path


def _controller_files(policy: Policy, workload: str, acceptance: str | None, adaptive: dict, bundle, bundle_path: str,
                      ctx: float, launch: str) -> tuple[dict[str, str], dict]:
    """adaptive_controller.json (the adaptive config with its "simtree" entry), the bundle and the
    acceptance file beside it, launch_controller.txt; checked by building the controller."""
    got = _controller_acceptance(policy, workload, acceptance)
    if isinstance(got, str):
        return {}, {"written": False, "why": got}
    name, source = got
    steps = slot_steps(adaptive, "adaptive config")
    acc = get_workload(str(source) if source else name).acceptance
    Controller(bundle, acc, specs=[chain_spec(s) for s in steps])
    files = {COSTS_FILE: Path(bundle_path).read_text()}
    if source is not None:
        files[name] = source.read_text()
    config = controller_config(adaptive, files[COSTS_FILE], name, ctx)
    files["adaptive_controller.json"] = json.dumps(config, indent=1) + "\n"
    files["launch_controller.txt"] = launch.replace("adaptive_config.json", "adaptive_controller.json")
    return files, {"written": True, "config": "adaptive_controller.json", "steps": steps, "context_len": ctx,
                   "acceptance": name,
                   "lost": "SGLang tells the policy neither the live contexts (every step priced at context_len) "
                           "nor each request's rounds (every request counts as new), and runs chains only"}


CONTROLLER_FILES = ("adaptive_controller.json", "launch_controller.txt")


def _write(out: Path, files: dict[str, str]) -> list[Path]:
    """Every file of ``files``; a controller config of an earlier export into ``out`` that this one
    does not write is removed (it would name this export's slots with another's bundle)."""
    written = [write_text_atomic(out / name, text) for name, text in files.items()]
    if "adaptive_config.json" in files:
        for name in CONTROLLER_FILES:
            if name not in files:
                (out / name).unlink(missing_ok=True)
    return written


def export_policy(engine: str, policy: str | Path, out: str | Path, *, workload: str | None = None,
                  batch_size: int = 1, model_path: str | None = None, costs: str | None = None,
                  dspark_gamma: int | None = None, acceptance: str | None = None) -> dict:
    """Write ``engine``'s files for ``workload`` of a plan into ``out``; returns the manifest
    (also written as ``out/export.json``); ``dspark_gamma`` (DSpark's block size) defaults to the
    deepest draft the cost bundle measured; ``acceptance``: what simtree's controller in SGLang
    ranks with (a preset or a file; default the workload's preset).  Everything is computed
    before the first write."""
    if engine not in ENGINES:
        raise SimtreeError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if engine == "vllm" and (costs or acceptance):
        raise SimtreeError(f"{'--costs' if costs else '--acceptance'} is SGLang's (the DSpark SPS table, simtree's "
                           "controller); the vllm export writes neither: leave it out")
    path = policy_path(policy)
    pol = Policy.load(path)
    pol.check_served(str(path), f"export it to {engine}")
    workload = workload or ("sharegpt" if "sharegpt" in pol.workloads else pol.workloads[0])
    tiers = linear_tiers(pol, path, workload)
    model = shlex.quote(model_path or pol.model)   # the launch lines are shell commands: a path with a space stays one word
    manifest = {"engine": engine, "policy": str(path), "workload": workload, "model": pol.model,
                "deployment": pol.deployment,
                "tiers": [{"batch_min": r.batch_min, "batch_max": r.batch_max, "planned": r.planned,
                           "planned_tok_s": r.planned_tok_s, "exported": f"linear {r.best_linear_steps} draft tokens"
                           if r.best_linear_steps else "none", "exported_tok_s": r.best_linear_tok_s,
                           "loss": r.loss, "candidate_steps": list(r.candidate_steps)} for r in tiers]}
    files: dict[str, str] = {}
    if engine == "vllm":
        per_bs = vllm_per_batch_size(tiers)
        parse_vllm_tiers(per_bs, "export")
        spec = {"num_speculative_tokens": max(1, max(per_bs.values())), "num_speculative_tokens_per_batch_size": per_bs}
        files["speculative_config.json"] = json.dumps(spec, indent=1) + "\n"
        files["launch.txt"] = f"vllm serve {model} --speculative-config '{json.dumps(spec)}'\n"
        manifest["lost"] = "vLLM runs chains of one length per batch range: trees and per-round budgets are lost"
    else:
        static = sglang_static(path, workload, batch_size)
        dep = " ".join(static.deployment_args)
        base = f"python -m sglang.launch_server --model-path {model}" + (f" {dep}" if dep else "")
        files["launch_static.txt"] = base + (" " + " ".join(static.args) if static.args else "") + "\n"
        adaptive = adaptive_config(tiers)
        top = max(max(r.candidate_steps) for r in tiers)
        files["adaptive_config.json"] = json.dumps(adaptive, indent=1) + "\n"
        files["launch_adaptive.txt"] = (base + f" --speculative-algorithm EAGLE --speculative-num-steps {max(top, 1)} "
                                        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {max(top, 1) + 1} "
                                        "--speculative-adaptive --speculative-adaptive-config adaptive_config.json\n")
        bundle, bundle_path = _costs_for(pol, costs)
        if dspark_gamma is None:   # DSpark's block: the deepest draft the profile measured
            dspark_gamma = int(bundle.draft.valid_range.get("num_steps", (1, 7))[1])
        ctx = _mean_context(pol, workload)
        sps, err = sps_additive_table(bundle, ctx, dspark_gamma, tiers[-1].batch_max)
        files["sps_table.json"] = json.dumps(sps, indent=1) + "\n"
        files["launch_dspark.txt"] = (base + f" --speculative-algorithm DSPARK --speculative-dspark-block-size "
                                      f"{dspark_gamma} --speculative-dspark-sps-table-path sps_table.json\n")
        more, controller = _controller_files(pol, workload, acceptance, adaptive, bundle, bundle_path, ctx,
                                             files["launch_adaptive.txt"])
        files.update(more)
        manifest["controller"] = controller
        manifest.update({"static": {"batch_size": batch_size, "planned": static.planned_policy,
                                    "exported": static.exported_policy, "loss": static.loss_vs_planned},
                         "sps_table": {"costs": bundle_path, "context_len": ctx, "gamma": dspark_gamma,
                                       "max_rel_error": err},
                         "lost": "SGLang's adaptive steps are top-k 1 chains and DSpark verifies chains: trees and "
                                 "per-tier tree budgets are lost (per tier in 'tiers'); the static launch keeps "
                                 "one tree for all batch sizes"})
    files["export.json"] = json.dumps(manifest, indent=1, allow_nan=False) + "\n"
    _write(Path(out), files)
    return manifest
