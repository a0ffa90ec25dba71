"""simtree's online controller inside SGLang, as its adaptive-steps policy.

SGLang 0.5.23 serves EAGLE top-k 1 with ``--speculative-adaptive``: before each decode step its
``AdaptiveController`` (``sglang/srt/speculative/adaptive_runtime_state.py``) asks a policy for the
step's draft steps (``get_steps_for_batch(batch_size)``) and switches to that step's captured
runtime state; after each verify it hands the policy every request's accepted drafts
(``on_verify_complete``).  The policy is ``AdaptiveSpeculativeParams(initial_steps, cfg_path)``
(``adaptive_spec_params.py``), built from ``--speculative-adaptive-config``.

:class:`SimtreeAdaptiveParams` is that policy with :class:`simtree.control.Controller` deciding:
built from an adaptive config whose key ``"simtree"`` (:data:`CONFIG_KEY`; SGLang's loader reads
only the integer batch keys, so the file stays valid for SGLang's own class) names the cost
bundle, the acceptance model, the context the steps are priced at and the controller's settings;
its tiers are plain decoding (step 0) and the chains of the config's candidate steps (step ``s``
is ``linear D = s + 1``: ``s`` drafts and the root, SGLang's ``s + 1`` draft tokens).  simtree's
SGLang plugin (:mod:`.sglang_plugin`) puts it in SGLang's place in every SGLang process;
``simtree export sglang`` writes the config (``adaptive_controller.json``).

What the engine does not tell the policy, and what it is priced at instead:

- the live contexts: every step is priced at ``context_len`` (the workload's mean context);
- the rounds each request has run: every live request counts as new, so the short-reply tail
  ranks the tiers at ``tail_rounds`` rounds (``Controller.choose`` without ``rounds_done``);
- trees: SGLang's adaptive steps are top-k 1 chains (``adaptive_unsupported_reason``).

A step-0 round is priced as SGLang runs it by default: the target's one-token verify and the
draft model's extend over each request's row (``Controller(plain_draft="extend")``).  With
overlap scheduling a verify's accepted drafts arrive after the next step was chosen: the tiers
chosen wait in order (at most :data:`IN_FLIGHT`) and each verify is credited to the oldest.
Every candidate step is captured at every CUDA-graph batch size (``cuda_graph_bs_for_step``;
SGLang's own class captures a step only at the batch sizes whose slot lists it), so a step held
across a load change still replays a graph, at the price of more graphs at start-up.  The
bundle is priced directly; the controller keeps each batch size's step times after the first
step there.  It logs one line when built (``simtree controller in SGLang: ...``): without it
SGLang is running its own class on the config's slots (simtree not installed in its
environment, or ``SGLANG_PLUGINS`` set without it).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import deque
from pathlib import Path

from simtree.acceptance.model import PRESETS, get_workload
from simtree.control.controller import Controller
from simtree.control.tiers import chain_spec
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.fileio import file_sha256

__all__ = ["CONFIG_KEY", "COSTS_FILE", "FORMAT", "IN_FLIGHT", "SimtreeAdaptiveParams", "controller_config",
           "slot_steps", "has_controller"]

CONFIG_KEY = "simtree"
FORMAT = "simtree.sglang_controller/1"
IN_FLIGHT = 4          # chosen steps whose verify has not reported yet (SGLang overlaps one or two)
_SETTINGS = ("margin", "min_dwell_steps", "switch_burst", "memory", "prior", "tail_rounds", "tail_power",
             "tail_mix", "switch_cost_us", "confidence_z")


COSTS_FILE = "costs.json"   # the bundle's copy beside the config


def controller_config(slots: dict, costs_text: str, workload: str, context_len: float,
                      settings: dict | None = None) -> dict:
    """An adaptive config for simtree's controller: SGLang's per-batch ``slots`` and the
    ``"simtree"`` entry naming the bundle's copy (:data:`COSTS_FILE`, whose text is
    ``costs_text``, written beside the config by the caller, its digest taken of that text) and
    ``workload`` (a preset name, or a file beside the config)."""
    digest = hashlib.sha256(costs_text.encode()).hexdigest()[:16]
    return {**slots, CONFIG_KEY: {"format": FORMAT, "costs": COSTS_FILE, "workload": workload,
                                  "context_len": float(context_len), "settings": dict(settings or {}),
                                  "costs_sha256": digest}}


def has_controller(cfg_path) -> bool:
    """Whether the adaptive config at ``cfg_path`` asks for simtree's controller (False where it
    cannot be read: SGLang's own loader then says why)."""
    try:
        cfg = json.loads(Path(cfg_path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and CONFIG_KEY in cfg


def slot_steps(cfg: dict, where: str) -> list[int]:
    """The union of the config's per-batch ``candidate_steps`` (SGLang's
    ``resolve_candidate_steps_from_config``: what its runtime buffers are sized for)."""
    steps = set()
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        cand = entry.get("candidate_steps") if isinstance(entry, dict) else None
        if not isinstance(cand, list) or not cand or not all(isinstance(s, int) and not isinstance(s, bool)
                                                            and s >= 0 for s in cand):
            raise SimtreeError(f"{where}: batch {key}: candidate_steps must be a non-empty list of steps >= 0")
        steps.update(cand)
    if not steps:
        raise SimtreeError(f"{where}: no batch-size key with candidate_steps (e.g. {{\"1\": {{\"candidate_steps\": "
                           f"[0, 1, 3]}}}})")
    return sorted(steps)


def _section(cfg: dict, where: str) -> dict:
    sim = cfg.get(CONFIG_KEY)
    if not isinstance(sim, dict):
        raise SimtreeError(f"{where}: \"{CONFIG_KEY}\" must be an object (simtree export sglang writes it)")
    if sim.get("format") != FORMAT:
        raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".format is {sim.get('format')!r}, this simtree reads {FORMAT}")
    for key, kind in (("costs", str), ("workload", str), ("context_len", (int, float)), ("settings", dict)):
        if not isinstance(sim.get(key), kind) or isinstance(sim.get(key), bool):
            raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".{key} is missing or of the wrong kind")
    if "costs_sha256" in sim and not isinstance(sim["costs_sha256"], str):
        raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".costs_sha256 must be a string of hex digits")
    if not (math.isfinite(sim["context_len"]) and sim["context_len"] >= 1):
        raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".context_len must be a finite count >= 1 token, "
                           f"got {sim['context_len']}")
    unknown = sorted(set(sim["settings"]) - set(_SETTINGS))
    if unknown:
        raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".settings: unknown {', '.join(unknown)} "
                           f"(the controller takes {', '.join(_SETTINGS)})")
    return sim


class SimtreeAdaptiveParams:
    """SGLang's adaptive-steps policy (``AdaptiveSpecPolicy``) with simtree's controller choosing
    each step (module docstring).  ``cfg_path``: an adaptive config with a ``"simtree"`` entry;
    ``initial_steps``: the launch's ``--speculative-num-steps`` (SGLang starts there)."""

    def __init__(self, initial_steps: int, cfg_path: str | None = None, *, costs=None):
        """``costs``: a cost model of the config's bundle to price with instead of the bundle itself
        (the serving benchmark's tabulated grid)."""
        if cfg_path is None:
            raise SimtreeError("simtree's SGLang controller needs --speculative-adaptive-config (a file with a "
                               f"\"{CONFIG_KEY}\" entry: simtree export sglang writes adaptive_controller.json)")
        where = str(cfg_path)
        try:
            cfg = json.loads(Path(cfg_path).read_text())
        except (OSError, ValueError) as exc:
            raise SimtreeError(f"{where}: not a readable JSON adaptive config ({exc})") from None
        if not isinstance(cfg, dict):
            raise SimtreeError(f"{where}: an adaptive config is a JSON object keyed by batch size")
        sim = _section(cfg, where)
        base = Path(cfg_path).resolve().parent
        costs_path = base / sim["costs"]
        if not costs_path.is_file():
            raise SimtreeError(f"{where}: cost bundle {costs_path} not found")
        if sim.get("costs_sha256") and file_sha256(costs_path)[:len(sim["costs_sha256"])] != sim["costs_sha256"]:
            raise SimtreeError(f"{where}: {costs_path} is not the bundle the config was written with (sha256 "
                               f"{sim['costs_sha256']})")
        workload = sim["workload"]
        if workload not in PRESETS:     # a file beside the config, never one of SGLang's working folder
            if not (base / workload).is_file():
                raise SimtreeError(f"{where}: acceptance {workload!r} is neither a preset ({', '.join(PRESETS)}) nor "
                                   f"a file beside the config")
            workload = str(base / workload)
        self.steps = slot_steps(cfg, where)
        self.context_len = float(sim["context_len"])
        self.initial_steps = int(initial_steps)
        specs = [chain_spec(s) for s in self.steps]
        try:
            self.controller = Controller(load_costs(costs_path) if costs is None else costs,
                                         get_workload(workload).acceptance, specs=specs, plain_draft="extend",
                                         **sim["settings"])
        except TypeError as exc:
            raise SimtreeError(f"{where}: \"{CONFIG_KEY}\".settings: a value of the wrong kind ({exc})") from None
        logging.getLogger(__name__).info(
            "simtree controller in SGLang: steps %s, costs %s, acceptance %s, priced at context %.0f",
            self.steps, costs_path, sim["workload"], self.context_len)
        self._step_of = {t.index: s for t, s in zip(self.controller.tiers, self.steps)}
        self._cuda_graph_bs: list[int] | None = None
        self._waiting: deque = deque()

    @property
    def candidate_steps(self) -> list[int]:
        return list(self.steps)

    def set_cuda_graph_bs(self, cuda_graph_bs) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def cuda_graph_bs_for_step(self, step: int):
        """Every CUDA-graph batch size, for every candidate step (None: graphs off)."""
        return None if self._cuda_graph_bs is None else list(self._cuda_graph_bs)

    def get_steps_for_batch(self, batch_size: int) -> int:
        """The controller's choice for the next step at ``batch_size`` live requests."""
        tier = self.controller.choose(max(int(batch_size), 1), [self.context_len])
        self._waiting.append(tier)
        while len(self._waiting) > IN_FLIGHT:
            self._waiting.popleft()
        return self._step_of[tier.index]

    def on_verify_complete(self, num_correct_drafts_per_req, batch_size: int):
        """A verify's accepted drafts per request (bonus excluded), credited to the oldest step
        chosen and not yet reported; the next step is chosen when it starts (None: no switch now)."""
        tier = self._waiting.popleft() if self._waiting else self.controller.current
        if tier is not None and len(num_correct_drafts_per_req):
            self.controller.observe(tier, list(num_correct_drafts_per_req))
        return None
