"""The online controller live in simtree's own (tiny) runtime, the batch changing from phase
to phase; per phase, measured TPOT against the serving benchmark's prediction.

One :class:`simtree.control.Controller` decides every round of every phase (it sees the batch
go 1 -> 8 -> 2 -> 4 -> 8 -> 1 ...), on the cost bundle fitted to this runtime on this device
(``scripts/serve_live_gpu.sh`` profiles and fits it first).  Per phase:

- ``measured_tpot_ms``: the phase's decode wall time (every round's draft + verify + commit,
  the MTP layer's catch-ups after plain rounds, host work included, prefill excluded) over the tokens each sequence gained (accepted + bonus,
  averaged over the batch, uncut);
- ``predicted_tpot_ms``: the same rounds priced as ``simtree bench-serve`` prices a step
  (:func:`simtree.serving.policies.step_us`: C_d of the tier the controller chose + C_v at the
  round's batch, mean verified nodes and mean context, plus the drafter's catch-up after plain
  rounds as the benchmark prices it, :class:`simtree.control.catchup.CatchUpClock`) over the
  same tokens: the benchmark's step model against the live steps, acceptance as it happened;
- ``predicted_model_tpot_ms``: the same step prices over the tokens the controller expected
  (1 + its running acceptance ratio x the tier's expected accepted drafts per round);
- ``catch_ups``, ``measured_catchup_ms``, ``predicted_catchup_ms``: the catch-ups the phase ran
  (the runtime's ``RoundStats.catchup_ms``, inside the measured TPOT) and their price.

    python scripts/serve_live.py --costs OUT/costs.json --out OUT/serve_live.csv --device cuda
    python -m simtree.serving.live_report OUT/serve_live.csv --readme reports/bench_serve/README.md

At full scale (``scripts/serve_live_full_gpu.sh``): ``--model qwen3.6-27b --dtype bf16`` (random
weights), ``--replay sharegpt`` (random weights accept nothing: each drafted tier's rounds accept
as the modes runs replay them, :class:`simtree.runtime.full.measure.AcceptanceSource`'s stratified draws
from the workload's acceptance model, which the controller's running estimate then sees) and
``--costs`` a frozen shipped bundle: the report's full-scale section (out of sample).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from simtree.acceptance.model import get_workload
from simtree.control import DEFAULT_TIERS, Controller
from simtree.control.catchup import CatchUpClock
from simtree.costs.model import load_costs
from simtree.errors import SimtreeError
from simtree.fileio import file_sha256, write_atomic
from simtree.planning.modes import NoneParams
from simtree.runtime.full.build import DTYPES, build_model
from simtree.runtime.full.drafting import round_shape
from simtree.runtime.full.engine import draft_scratch_rows, release_memory, sync_device
from simtree.runtime.full.generate import generate
from simtree.runtime.full.lag import lag_rows
from simtree.runtime.full.measure import AcceptanceSource
from simtree.runtime.bpe import BpeTokenizer
from simtree.runtime.tokenizer import ByteTokenizer
from simtree.serving.live_report import CATCH_UP_COLUMNS, COLUMNS, FROZEN_COLUMNS, FULL_COLUMNS
from simtree.serving.policies import step_us


class Recording:
    """The controller's interface, recording what each round chose (batch, mean context, tier)."""

    def __init__(self, ctl: Controller):
        self.ctl, self.tiers, self.log = ctl, ctl.tiers, []

    def choose(self, batch_size, context_lens, rounds_done=None):
        tier = self.ctl.choose(batch_size, context_lens, rounds_done)
        self.log.append((tier, int(batch_size), float(np.mean(context_lens)), self.ctl.ratio))
        return tier

    def observe(self, tier, accepted):
        self.ctl.observe(tier, accepted)


def _random_prompts(count: int, lo: int, hi: int) -> list[list[int]]:
    """``count`` prompts of printable byte ids, lengths drawn from [lo, hi) (seed 0)."""
    rng = np.random.default_rng(0)
    return [rng.integers(32, 127, int(n)).tolist() for n in rng.integers(lo, hi, count)]


def _prompts(count: int, workload: str, model: str, prompts_file: str | None,
             random_lens: tuple[int, int] | None = None) -> tuple[list[list[int]], str]:
    if random_lens:    # a random-weight target: only the contexts matter
        return _random_prompts(count, *random_lens), f"random ({random_lens[0]}-{random_lens[1] - 1} tokens)"
    if prompts_file:   # token ids encoded where the data extra is installed (the GPU machine lacks it)
        ids = json.loads(Path(prompts_file).read_text())
        if len(ids) < count:
            raise SystemExit(f"error: --prompts {prompts_file} holds {len(ids)} prompts, the phases need {count}")
        return [list(map(int, x)) for x in ids[:count]], f"{workload} ({prompts_file})"
    folder = Path(model)
    tok = BpeTokenizer.from_file(folder) if (folder / "tokenizer.json").is_file() else ByteTokenizer()
    try:
        from simtree.runtime.data import prompts
        texts = prompts(workload, count)
        if len(texts) == count:
            return [tok.encode(t) for t in texts], workload
    except Exception as exc:   # the data extra is missing: random byte prompts, said in the CSV
        print(f"prompts: {workload} unavailable ({exc}); random byte prompts")
    return _random_prompts(count, 24, 160), "random"


def live_controller(costs, workload: str) -> Controller:
    """The controller over the tiers whose drafting the profile measured (a chain of D nodes
    drafts D - 1 steps)."""
    steps_hi = costs.draft.valid_range.get("num_steps", (1, 64))[1]
    topk_hi = costs.draft.valid_range.get("topk", (1, 64))[1]
    specs = [s for s in DEFAULT_TIERS if s.draft_shape()[0] <= steps_hi and s.draft_shape()[1] <= topk_hi]
    return Controller(costs, get_workload(workload).acceptance, specs=specs)


def live_lag_rows(model, ctl: Controller) -> int:
    """The lag buffer of the engine generate builds for the controller's tiers (runtime/full/lag.py)."""
    shapes = [round_shape(NoneParams()), *(round_shape(t.spec) for t in ctl.tiers)]
    return lag_rows(model, draft_scratch_rows(shapes))


def price(costs, log, rounds, buffer_rows: int) -> dict:
    """A phase's predictions from the rounds it ran (``log``: the controller's (tier, batch,
    context, ratio) per round): each step priced as ``simtree bench-serve`` prices it, with the
    drafter's catch-up after plain rounds (a lag buffer of ``buffer_rows``)."""
    lag = CatchUpClock(costs, buffer_rows)
    priced = [step_us(costs, tier, float(np.mean(r.nodes)), ctx, bb) + lag.step_us(tier.spec.mode == "none", bb)
              for (tier, bb, ctx, _), r in zip(log, rounds)]
    gained = sum(float(np.mean(r.accepted)) + 1.0 for r in rounds)        # tokens per sequence
    expected = sum(1.0 + ratio * tier.expected_accepted for tier, _, _, ratio in log)
    return {"predicted_tpot_ms": sum(priced) / gained / 1e3, "predicted_model_tpot_ms": sum(priced) / expected / 1e3,
            "predicted_catchup_ms": lag.total_us / 1e3}


def _lens(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give MIN,MAX token counts") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi + 1


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True, help="cost bundle of this runtime on this device (fitted "
                    "in the session, or a frozen shipped one)")
    ap.add_argument("--out", required=True, help="CSV to write")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--phases", default="1,8,2,4,8,1,4,2", help="batch size of each phase, in order")
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens per sequence per phase")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--model", default="runtime-tiny",
                    help="checkpoint folder or shipped name (its tokenizer.json, if any, encodes the prompts)")
    ap.add_argument("--prompts", default=None, help="JSON list of prompt token-id lists (instead of --workload's text)")
    ap.add_argument("--random-prompts", type=_lens, default=None, metavar="MIN,MAX",
                    help="random token prompts of MIN..MAX tokens (a random-weight target) instead of text")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--replay", default=None, metavar="WORKLOAD",
                    help="replay this workload's acceptance model (what the controller ranks with too) instead of "
                         "the target's own (random weights accept nothing)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="a few rounds of every tier at every batch size first (each phase's capture warms up too)")
    args = ap.parse_args(argv)
    phases = [int(b) for b in args.phases.split(",")]
    costs = load_costs(args.costs)
    costs_sha = file_sha256(args.costs)
    ctl = live_controller(costs, args.replay or args.workload)     # a bad name stops before the model is built
    replays = [AcceptanceSource(None, args.replay, args.device, seed) if args.replay else None   # one draw per phase
               for seed in range(len(phases) + 1)]
    model = build_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    buffer_rows = live_lag_rows(model, ctl)
    ids, source = _prompts(sum(phases), args.workload, args.model, args.prompts, args.random_prompts)

    def acceptance(b: int, replay):
        """Each drafted round shape's replay at batch ``b`` (rows enough for a phase's rounds), or live."""
        return None if replay is None else lambda rs: replay.make(rs, b, args.new_tokens, costs=costs)

    # warm-up, not counted: every tier at every phase's batch size (kernels compiled, caches sized)
    for b in sorted(set(phases)) if args.warmup else []:
        for tier in ctl.tiers:
            generate(model, ids[:b], 4, tier.spec, costs=costs, source=acceptance(b, replays[-1]))
            release_memory()
    rows, start = [], 0
    for i, b in enumerate(phases):
        rec = Recording(ctl)
        switches0 = ctl.switches
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()       # the phase's own peak on its line
        sync_device(args.device)
        t0 = time.perf_counter()
        res = generate(model, ids[start:start + b], args.new_tokens, NoneParams(), costs=costs, controller=rec,
                       source=acceptance(b, replays[i]))
        sync_device(args.device)
        wall_s = time.perf_counter() - t0
        release_memory()
        start += b
        decode_us = sum(r.round_ms for r in res.rounds) * 1e3
        gained = sum(float(np.mean(r.accepted)) + 1.0 for r in res.rounds)   # tokens per sequence
        predicted = price(costs, rec.log, res.rounds, buffer_rows)   # each phase's engine is new: no lag at its start
        names = Counter(tier.name for tier, *_ in rec.log)
        rows.append({"phase": i, "batch_size": b, "new_tokens": args.new_tokens, "rounds": len(res.rounds),
                     "switches": ctl.switches - switches0, "tiers": ";".join(f"{n}:{c}" for n, c in names.most_common()),
                     "measured_tpot_ms": decode_us / gained / 1e3, **predicted,
                     "tokens_per_round": gained / len(res.rounds), "wall_s": wall_s, "prefill_ms": res.prefill_ms,
                     "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                     "costs": args.costs, "prompts": source, "controller_steps": ctl.steps,
                     "controller_switches": ctl.switches, "switch_bound": ctl.max_switches,
                     "catch_ups": sum(r.catchup_ms > 0 for r in res.rounds),
                     "measured_catchup_ms": sum(r.catchup_ms for r in res.rounds),
                     "model": args.model, "dtype": args.dtype,
                     "acceptance": replays[i].label if replays[i] else "live", "weights": model.weights_from,
                     "costs_sha256": costs_sha, "costs_device": costs.meta.get("device", "")})
        r = rows[-1]
        print(f"phase {i} b={b}: measured {r['measured_tpot_ms']:.3f} ms/token, predicted {r['predicted_tpot_ms']:.3f} "
              f"({r['predicted_tpot_ms'] / r['measured_tpot_ms'] - 1:+.1%}); {r['tiers']}; {wall_s:.1f} s"
              + (f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.device.startswith("cuda") else ""),
              flush=True)
        df = pd.DataFrame(rows, columns=COLUMNS + CATCH_UP_COLUMNS + FULL_COLUMNS + FROZEN_COLUMNS)   # each phase's, as it ends
        write_atomic(args.out, lambda tmp: df.to_csv(tmp, index=False, float_format="%.6g"))
    print(f"wrote {args.out}; switches {ctl.switches} in {ctl.steps} steps (bound {ctl.max_switches})")


if __name__ == "__main__":
    try:
        main()
    except SimtreeError as exc:
        raise SystemExit(f"error: {exc}") from None
