"""Acceptance measured by a serving engine, read from what it exposes, into an acceptance file
(schema ``simtree.engine_acceptance/1``) that ``simtree plan --workload`` takes.

vLLM (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``; prometheus_client appends
``_total`` to a counter's name): counters ``vllm:spec_decode_num_drafts_total`` (verify rounds
that carried drafts), ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total`` (bonus token excluded) and
``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` (drafts whose position i,
0-based, was accepted; accepting i implies every position before it).  Series of several
engines (label ``engine``) are summed.

SGLang (``sglang/srt/observability/metrics_collector.py``): gauges ``sglang:spec_accept_length``
(mean accepted drafts + bonus token per verify, over the last logging interval),
``sglang:spec_accept_rate`` (accepted / proposed drafts), ``sglang:spec_num_draft_tokens``
(tokens per verify, bonus slot included) and the counter ``sglang:spec_verify_calls_total``;
``/server_info`` JSON (``internal_states[i].avg_spec_accept_length``,
``speculative_num_draft_tokens``); or per-request responses whose ``meta_info`` carries
``spec_accept_length``, ``spec_verify_ct``, ``spec_num_correct_drafts`` and
``spec_num_proposed_drafts`` (``tokenizer_manager.py``), as a JSON list or JSONL.

Two scrapes of one server (earlier first) give the window between them: counters must not
go backwards.  The file says how many drafts back each number (``num_drafts``) and the
standard error of the mean accepted length where the source allows one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from simtree.acceptance.engine_file import ENGINE_ACCEPTANCE_SCHEMA as SCHEMA, META_FIELDS, conditional_from_per_position
from simtree.engines.prometheus import Sample, parse_text, read_source
from simtree.errors import SimtreeError, check_real

__all__ = ["ENGINES", "SCHEMA", "EngineAcceptance", "import_metrics", "VLLM_SERIES", "SGLANG_SERIES"]

ENGINES = ("vllm", "sglang")
VLLM_SERIES = {"drafts": "vllm:spec_decode_num_drafts_total",
               "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
               "accepted": "vllm:spec_decode_num_accepted_tokens_total",
               "per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
SGLANG_SERIES = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate",
                 "draft_tokens": "sglang:spec_num_draft_tokens", "verify_calls": "sglang:spec_verify_calls_total"}


@dataclass
class EngineAcceptance:
    """What an engine measured: mean accepted tokens per verify round (bonus included), the
    draft length, optionally the per-position acceptance, and how many drafts back them."""

    engine: str
    sources: list[str]
    mean_accepted_tokens: float
    draft_len: int | None
    num_drafts: int | None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    per_position_accept_rate: list[float] | None = None   # P(position i accepted), unconditional
    mean_accepted_tokens_se: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The acceptance file: the schema, the fields the reader checks (``META_FIELDS``, in its
        order) with the per-position rates and the conditional ones they give before the notes."""
        per = self.per_position_accept_rate
        cond = [float(x) for x in conditional_from_per_position(per)] if per else None
        counts = {key: getattr(self, key) for key in META_FIELDS if key != "notes"}
        return {"schema": SCHEMA, **counts, "per_position_accept_rate": per, "conditional_accept_rate": cond,
                "notes": self.notes}


def _by_name(samples: dict[Sample, float], name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def _label_text(labels: tuple) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


def _count(meta: dict, key: str, where: str) -> float | None:
    """``meta[key]`` as a finite number >= 0, None where it is absent; anything else (a string,
    NaN, a negative count) is a one-line error naming the field."""
    v = meta.get(key)
    return None if v is None else check_real(v, f"{where}: meta_info.{key}", 0)


def _window(scrapes: list[tuple[str, dict]], name: str, *, key=None) -> dict:
    """{key: value} of counter ``name`` summed per key over its label sets, the later scrape
    minus the earlier when there are two; a counter that decreased is an error."""
    sums = []
    for src, samples in scrapes:
        acc: dict = {}
        for labels, v in _by_name(samples, name).items():
            if not (math.isfinite(v) and v >= 0):   # a counter counts: NaN, inf or below 0 is a broken page
                raise SimtreeError(f"{src}: counter {name}{_label_text(labels)} is {v:g}: a counter is a finite "
                                   "count >= 0")
            k = key(labels) if key else None
            acc[k] = acc.get(k, 0.0) + v
        sums.append(acc)
    if len(sums) == 1:
        return sums[0]
    (first_src, _), (second_src, _) = scrapes
    out = {}
    for k, v in sums[1].items():
        before = sums[0].get(k, 0.0)
        if v < before:
            what = name if k is None else f"{name}{{position={k}}}"
            raise SimtreeError(f"counter {what} went backwards from {before:g} in {first_src} to {v:g} in "
                               f"{second_src} (a restarted server, or scrapes in the wrong order: earlier first)")
        out[k] = v - before
    return out


def _vllm(scrapes: list[tuple[str, dict]]) -> EngineAcceptance:
    srcs = [s for s, _ in scrapes]
    if not any(_by_name(samples, VLLM_SERIES["drafts"]) for _, samples in scrapes):
        raise SimtreeError(f"{srcs[-1]}: no vLLM spec-decode series ({VLLM_SERIES['drafts']} missing): "
                           "is speculative decoding on, and is this vLLM's /metrics?")
    drafts = _window(scrapes, VLLM_SERIES["drafts"]).get(None, 0.0)
    tokens = _window(scrapes, VLLM_SERIES["draft_tokens"]).get(None)
    accepted = _window(scrapes, VLLM_SERIES["accepted"]).get(None)
    if accepted is None:
        raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['drafts']} without {VLLM_SERIES['accepted']}")
    if drafts <= 0:
        raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['drafts']} counted no drafts in the window: nothing measured")
    if tokens is not None and accepted > tokens:   # the file's mean accepted length would pass its draft length
        raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['accepted']} {accepted:g} exceeds the {tokens:g} draft tokens "
                           f"({VLLM_SERIES['draft_tokens']}): a server cannot accept more tokens than it drafted")
    per_pos = _window(scrapes, VLLM_SERIES["per_pos"], key=lambda labels: dict(labels).get("position"))
    notes, rates = [], None
    if per_pos:
        try:
            positions = sorted(int(p) for p in per_pos)
        except (TypeError, ValueError):
            raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['per_pos']} has a series without an integer "
                               "position label") from None
        if positions != list(range(len(positions))):
            missing = sorted(set(range(max(positions) + 1)) - set(positions))
            raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['per_pos']} has gaps: positions {missing} missing "
                               f"(have {positions})")
        counts = np.array([per_pos[str(p)] for p in positions])
        if np.any(np.diff(counts) > 1e-9) or counts[0] > drafts + 1e-9:
            raise SimtreeError(f"{srcs[-1]}: {VLLM_SERIES['per_pos']} rises with position ({counts.tolist()}) "
                               f"or exceeds the {drafts:g} drafts: accepting a position implies every earlier one")
        if abs(counts.sum() - accepted) > max(1e-6 * accepted, 0.5):
            notes.append(f"per-position counts sum to {counts.sum():g}, accepted tokens {accepted:g}")
        rates = [float(c / drafts) for c in counts]
    draft_len = len(rates) if rates else (round(tokens / drafts) if tokens else None)
    mean = 1.0 + accepted / drafts
    se = None
    if rates:   # A = sum_i 1[i accepted], nested events: Cov(1_i, 1_j) = p_max(i,j) - p_i p_j
        p = np.asarray(rates)
        var = float(np.sum(p[np.maximum.outer(np.arange(p.size), np.arange(p.size))]) - p.sum() ** 2)
        se = math.sqrt(max(var, 0.0) / drafts)
    else:
        notes.append("no per-position series: acceptance per depth is extrapolated from the mean")
    return EngineAcceptance("vllm", srcs, mean, draft_len, int(round(drafts)),
                            None if tokens is None else int(round(tokens)), int(round(accepted)), rates, se, notes)


def _gauge_mean(samples: dict, name: str) -> float | None:
    values = [v for v in _by_name(samples, name).values() if math.isfinite(v)]
    return float(np.mean(values)) if values else None


def _sglang_prometheus(scrapes: list[tuple[str, dict]]) -> EngineAcceptance:
    srcs, last = [s for s, _ in scrapes], scrapes[-1][1]
    length = _gauge_mean(last, SGLANG_SERIES["accept_length"])
    if length is None:
        raise SimtreeError(f"{srcs[-1]}: no SGLang spec-decode series ({SGLANG_SERIES['accept_length']} "
                           "missing): is speculative decoding on and the server started with --enable-metrics?")
    if length < 1.0:
        raise SimtreeError(f"{srcs[-1]}: {SGLANG_SERIES['accept_length']} = {length:g} < 1: no verify round "
                           "logged yet (send traffic, then scrape)")
    tokens = _gauge_mean(last, SGLANG_SERIES["draft_tokens"])
    calls = _window(scrapes, SGLANG_SERIES["verify_calls"]).get(None)
    notes = [f"{SGLANG_SERIES['accept_length']} is SGLang's mean over its last logging interval, "
             "not over the scrape window"]
    if calls is None:
        notes.append(f"no {SGLANG_SERIES['verify_calls']}: the number of drafts behind the mean is unknown")
    return EngineAcceptance("sglang", srcs, length, None if not tokens else int(round(tokens)) - 1,
                            None if calls is None else int(round(calls)), notes=notes)


def _sglang_json(src: str, data) -> EngineAcceptance:
    if isinstance(data, dict) and "internal_states" in data:
        states = data["internal_states"] if isinstance(data["internal_states"], list) else []
        vals = [s.get("avg_spec_accept_length") for s in states if isinstance(s, dict)]
        vals = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
        if not vals:
            raise SimtreeError(f"{src}: /server_info has no internal_states[].avg_spec_accept_length: "
                               "is speculative decoding on?")
        tokens = data.get("speculative_num_draft_tokens")
        return EngineAcceptance("sglang", [src], float(np.mean(vals)),
                                int(tokens) - 1 if isinstance(tokens, int) and tokens > 1 else None, None,
                                notes=["/server_info gives a mean without the number of drafts behind it"])
    records = data if isinstance(data, list) else [data]
    metas = {i: r.get("meta_info", r) for i, r in enumerate(records, 1) if isinstance(r, dict)}
    metas = {i: m for i, m in metas.items() if isinstance(m, dict) and m.get("spec_verify_ct")}
    if not metas:
        raise SimtreeError(f"{src}: no SGLang spec-decode fields (meta_info.spec_accept_length, spec_verify_ct) "
                           "in any record: is speculative decoding on?")
    fields = [{k: _count(m, k, f"{src} record {i}") for k in ("spec_verify_ct", "spec_accept_length",
                                                             "spec_num_correct_drafts", "spec_num_proposed_drafts")}
              for i, m in metas.items()]
    verify = np.array([f["spec_verify_ct"] for f in fields])
    length = np.array([f["spec_accept_length"] or 0.0 for f in fields])
    correct = [f["spec_num_correct_drafts"] for f in fields]
    if all(c is not None for c in correct):
        length = 1.0 + np.asarray(correct, float) / verify
    mean = float(np.sum(length * verify) / verify.sum())
    se = float(np.sqrt(np.sum(verify * (length - mean) ** 2) / verify.sum() / max(len(metas) - 1, 1)))
    proposed = [f["spec_num_proposed_drafts"] for f in fields]
    draft_len = None
    if all(p is not None for p in proposed):
        draft_len = int(round(float(np.sum(proposed)) / verify.sum()))
    return EngineAcceptance("sglang", [src], mean, draft_len, int(verify.sum()), mean_accepted_tokens_se=se,
                            notes=[f"{len(metas)} requests; the standard error is over requests"])


def _parse_json(src: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        try:   # JSONL: one response per line
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise SimtreeError(f"{src}: neither Prometheus text nor JSON ({exc.msg}, line {exc.lineno})") from None


def import_metrics(sources: list[str], engine: str) -> EngineAcceptance:
    """Acceptance from one scrape (cumulative since the server started) or two (the window
    between them, earlier first) of ``engine``'s metrics."""
    if engine not in ENGINES:
        raise SimtreeError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if not 1 <= len(sources) <= 2:
        raise SimtreeError(f"give one metrics source or two scrapes of one server (earlier first), got {len(sources)}")
    texts = [(s, read_source(s)) for s in sources]
    if engine == "sglang" and texts[-1][1].lstrip()[:1] in ("{", "["):
        if len(texts) > 1:
            raise SimtreeError("SGLang JSON (/server_info, per-request meta_info) is read one file at a time")
        return _sglang_json(*texts[0][:1], _parse_json(*texts[0]))
    scrapes = [(s, parse_text(t, s)) for s, t in texts]
    return _vllm(scrapes) if engine == "vllm" else _sglang_prometheus(scrapes)
