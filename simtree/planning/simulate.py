"""Decode-throughput simulator: cost models x acceptance model x batch size x policy.

One round of a batch of b sequences: draft (C_d), build each sequence's tree, verify the whole
batch (C_v at the batch's mean nodes per sequence and mean context length), accept.  A
sequence gains 1 + accepted drafts tokens (the bonus token included) and its context grows by
that much.  The simulator runs the rounds needed for ``output_len`` tokens per sequence and
reports tokens per round, round latency, throughput (batch and per sequence: the
``output_len`` tokens each sequence outputs, not a last round's surplus) and speedups against
plain decoding (verify of 1 node, no draft) and against linear speculation verifying as many
nodes per sequence as the policy does.

Two modes: ``analytic`` (expected accepted length per round, contexts grow by the expectation)
and Monte-Carlo (a level and an accepted length drawn per sequence per round, ``mc_runs``
replications, 95% interval over replications).  The adaptive modes' round decisions
(cost_aware, batch_alloc) are :mod:`simtree.planning.adaptive`.

Draft cost per mode (the drafter cost model is C_d(s, k, b): s sequential steps of k tokens
per sequence): none 0; linear D -> C_d(D-1, 1); eagle -> C_d(s, k); the marginal modes
(best_first, cost_aware, batch_alloc) read top-K marginals at ``draft_depth`` positions, drafted
as a top-1 chain of that many steps -> C_d(draft_depth, 1) (a block drafter would be cheaper:
give the cost model its measured cost).

Verify cost: a fixed shape's C_v at its nodes per sequence (its mean over levels where their
trees differ in size).  cost_aware and batch_alloc are priced as the full runtime runs them
every round verifies the static bucket of
:func:`simtree.planning.adaptive.adaptive_bucket` (decided at the run's starting context) at
C_v(bucket, l, b), its trees - the rule's, capped at the bucket - accepted as the rule chooses
them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from simtree.acceptance.model import AcceptanceModel, Workload
from simtree.acceptance.phi import expected_accepted_ranked, rank_tokens, sample_accepted_length
from simtree.costs.model import Costs
from simtree.errors import SEED_MAX, SimtreeError, check_whole
from simtree.planning.adaptive import AdaptiveRounds, adaptive_bucket
from simtree.planning.allocation import RunningPrice, batch_allocation
from simtree.planning.modes import (BatchAllocParams, BestFirstParams, CostAwareParams, EagleParams, LinearParams,
                                    NoneParams, PolicySpec, check_batch_size)
from simtree.trees.builders import batched_best_first_tree, eagle_tree_positional
from simtree.trees.tree import DraftTree

__all__ = ["RoundShape", "SimResult", "static_round", "simulate", "analytic_static", "analytic_run",
           "batch_allocation", "check_simulable", "MAX_TREE_NODES", "MAX_DRAFT_STEPS"]


@dataclass(frozen=True, eq=False)
class RoundShape:
    """Per-level trees of a fixed-shape policy: nodes [L], expected accepted drafts [L], and
    weights [L], the share of the policy's rounds at each level (``round_weights``)."""

    trees: tuple[DraftTree, ...]
    tables: tuple[np.ndarray, ...]
    nodes: np.ndarray
    accepted: np.ndarray
    weights: np.ndarray

    @property
    def tokens_per_round(self) -> float:
        return 1.0 + float(self.weights @ self.accepted)

    @property
    def nodes_per_seq(self) -> float:
        return float(self.weights @ self.nodes)

    @property
    def nodes_std(self) -> float:
        """Spread of the nodes a sequence verifies per round over the policy's rounds."""
        return float(np.sqrt(self.weights @ (self.nodes - self.nodes_per_seq) ** 2))


def static_round(acc: AcceptanceModel, spec: PolicySpec) -> RoundShape:
    """Trees of a none/linear/eagle/best_first policy per acceptance level, with their Phi.

    The acceptance model hands the builders numbers (the drafter's probabilities per depth and
    rank, ``draft_table`` / ``draft_marginals``); the trees they return are scored here with
    the level's acceptance table (a node's token is its rank id, its column there)."""
    trees, tables = [], []
    for level in range(acc.num_levels):
        if isinstance(spec, NoneParams):
            tree, table = DraftTree.chain(1), acc.table(level, 1)
        elif isinstance(spec, (LinearParams, EagleParams)):
            s, k = spec.draft_shape()
            tree = eagle_tree_positional(acc.draft_table(level, s), s, k, spec.budget) if s >= 1 else DraftTree.chain(1)
            table = acc.table(level, max(s, 1))
        elif isinstance(spec, BestFirstParams):
            toks, draft = acc.draft_marginals(level, spec.draft_depth)
            tree = batched_best_first_tree(toks, draft, spec.budget, spec.width)[0]
            table = acc.table(level, spec.draft_depth)
        else:
            raise SimtreeError(f"mode {spec.mode!r} is adaptive: it has no fixed round shape")
        trees.append(tree)
        tables.append(table)
    nodes = np.array([t.num_nodes for t in trees], np.float64)
    chain = acc.scores_chain(spec.mode)
    accepted = np.array([expected_accepted_ranked(t, tb, chain) for t, tb in zip(trees, tables)])
    return RoundShape(tuple(trees), tuple(tables), nodes, accepted, acc.round_weights(1.0 + accepted))


EXACT_ROUNDS = 4096      # runs of up to this many rounds sum C_v over every round
SAMPLED_ROUNDS = 1024    # longer runs: C_v at this many evenly spread rounds, trapezoid in between
_CHUNK = 1 << 20         # [candidates x rounds] values evaluated at a time (memory stays ~10 MB)


def _verify_sums(costs: Costs, n: np.ndarray, g: np.ndarray, rounds: np.ndarray, batch_size: int,
                 context_len: float) -> np.ndarray:
    """[C]: sum over rounds t < rounds[c] of C_v(n[c], context_len + g[c] t, batch_size).

    Exact for runs of <= EXACT_ROUNDS rounds (evaluated in chunks, never one [C x R] matrix).
    Longer runs take C_v at SAMPLED_ROUNDS integer rounds from first to last and sum by the
    trapezoid rule with the end correction, which is exact wherever C_v is linear in l between
    samples (the grid and basis forms are piecewise linear in l with a few kinks).
    """
    total = np.zeros(g.shape)
    exact = np.flatnonzero(rounds <= EXACT_ROUNDS)
    if exact.size:
        R = rounds[exact]
        step = max(1, _CHUNK // exact.size)
        for start in range(0, int(R.max()), step):
            t = np.arange(start, min(int(R.max()), start + step))
            ctx = context_len + g[exact, None] * t[None, :]
            v = np.broadcast_to(np.asarray(costs.verify.predict(n[exact, None], ctx, batch_size), np.float64),
                                ctx.shape)
            total[exact] += np.where(t[None, :] < R[:, None], v, 0.0).sum(1)
    long = np.flatnonzero(rounds > EXACT_ROUNDS)
    for part in np.array_split(long, max(1, long.size * SAMPLED_ROUNDS // _CHUNK + 1)):
        if not part.size:
            continue
        t = np.round(np.linspace(0.0, 1.0, SAMPLED_ROUNDS)[None, :] * (rounds[part, None] - 1))
        v = np.broadcast_to(np.asarray(costs.verify.predict(n[part, None], context_len + g[part, None] * t,
                                                            batch_size), np.float64), t.shape)
        total[part] = (np.diff(t, axis=1) * (v[:, 1:] + v[:, :-1]) / 2).sum(1) + (v[:, 0] + v[:, -1]) / 2
    return total


def analytic_static(tokens_per_round, nodes_per_seq, draft_us, costs: Costs, batch_size: int,
                    context_len: float, output_len: int) -> dict:
    """Expected-value simulation of fixed-shape policies, vectorised over candidates [C].

    Round t (0-based) verifies at context l0 + t * g; R = ceil(N / g) rounds; the tokens output
    are N per sequence.  Throughput pays the rounds a sequence expects to need,
    N / g + (g - 1) / (2 g) (:func:`_expected_rounds_time`), not R.  Returns arrays [C]: rounds, total_us (the R rounds), verify_us (mean), throughput_tok_s
    (batch).
    """
    g = np.atleast_1d(np.asarray(tokens_per_round, np.float64))
    n = np.broadcast_to(np.asarray(nodes_per_seq, np.float64), g.shape)
    d = np.broadcast_to(np.asarray(draft_us, np.float64), g.shape)
    rounds = np.ceil(output_len / g - 1e-9).astype(np.int64)
    total_verify = _verify_sums(costs, n, g, rounds, batch_size, context_len)
    total = total_verify + rounds * d
    last = np.asarray(costs.verify.predict(n, context_len + g * (rounds - 1), batch_size), np.float64) + d
    paid = _expected_rounds_time(total, last, rounds, rounds * g, output_len, g)
    return {"rounds": rounds, "total_us": total, "verify_us": total_verify / rounds,
            "throughput_tok_s": float(batch_size) * output_len / paid * 1e6}


def _expected_rounds_time(total_us, last_round_us, rounds, produced, output_len, g):
    """The time of the rounds a sequence expects to need for N tokens, from that of the whole
    rounds counted (``rounds``, which produced ``produced`` >= N at g tokens per round in the
    last): N is reached (N - produced) / g into the last round, and a round's accepted count
    is random, so the round holding the N-th token overshoots it by (E[G^2] - g) / (2 g) tokens
    on average (renewal theory), at least (g - 1) / 2 (G fixed: plain decoding overshoots
    nothing), which is taken; never under one round.  Paying ceil(N / g) whole rounds instead
    would make throughput a sawtooth in g: a policy accepting slightly more per round could
    lose a whole round (about 1% at N = 256 and g = 3)."""
    g = np.asarray(g, np.float64)
    expected = np.maximum(1.0, rounds - (np.asarray(produced, np.float64) - output_len) / g + (g - 1.0) / (2.0 * g))
    return total_us + (expected - rounds) * last_round_us


@dataclass
class SimResult:
    """What one simulation reports (per-sequence quantities are per sequence per round)."""

    policy: str
    mode: str
    params: dict
    workload: str
    batch_size: int
    method: str
    accepted_tokens_per_round: float   # incl. the bonus token
    mean_nodes_per_seq: float
    round_latency_us: float
    draft_us: float
    verify_us: float
    throughput_tok_s: float            # whole batch
    per_seq_tok_s: float
    rounds: int
    speedup_vs_none: float = float("nan")
    speedup_vs_linear: float = float("nan")
    linear_budget: int = 0
    ci95: dict = field(default_factory=dict)
    synthetic: bool = False
    model: str = ""                    # the cost bundle's meta["model"]
    notes: list = field(default_factory=list)   # one-line caveats (e.g. a budget the shape cannot fill)
    nodes_std_per_seq: float = 0.0     # spread of a sequence's nodes per round over the policy's rounds
    deployment: str = "tp=1"           # the cost bundle's meta["deployment"]
    communication: str | None = None   # "communication assumed" / "... measured"; None for one GPU

    def to_dict(self) -> dict:
        return asdict(self)


def _comm_label(meta) -> str | None:
    comm = meta.get("communication")
    return str(comm.get("label")) if isinstance(comm, dict) and comm.get("label") else None


def _draft_us(costs: Costs, spec: PolicySpec, batch_size: int) -> float:
    s, k = spec.draft_shape()
    return 0.0 if s == 0 else float(costs.draft.predict(s, k, batch_size))


CTX_QUANTUM = 32  # tokens; granularity of adaptive budget decisions in the analytic run
MAX_DECISIONS = 64  # longer runs (N > 2048) decide per (output_len / 64)-token bucket instead


def analytic_run(workload: Workload, spec: PolicySpec, costs: Costs, b: int, *, bucket: int | None = None,
                 tree_cap: int | None = None) -> dict:
    """Expected-value run: mean tokens per round g (incl. bonus), mean nodes verified per
    sequence n and their spread ``nodes_std`` over the policy's rounds, rounds, total_us, mean
    verify_us and draft_us per round, tok_s (batch throughput counting the N = output_len tokens
    each sequence outputs), ``level_weights`` (the share of its rounds at each acceptance
    level); adaptive modes also ``decision_ctx``, the [lo, hi] of the (bucketed) contexts their
    budget decisions query C_v at (None for fixed shapes), ``tree_nodes`` (the mean size of the
    rule's trees) and ``bucket``.

    Adaptive modes (module docstring) verify ``bucket`` nodes per sequence every round (default:
    :func:`adaptive_bucket` at the workload's mean prompt length, as the runtime takes it); n is
    the bucket.  ``tree_cap``: the most nodes the rule's trees may hold (default: the bucket; a
    runtime that pads the bucket to a cheaper verify keeps the trees capped at the unpadded one)."""
    acc = workload.acceptance
    l0, N = workload.mean_prompt_len, workload.output_len
    if not isinstance(spec, (CostAwareParams, BatchAllocParams)):
        shape = static_round(acc, spec)
        g, n, draft = shape.tokens_per_round, shape.nodes_per_seq, _draft_us(costs, spec, b)
        out = analytic_static(g, n, draft, costs, b, l0, N)
        return {"g": g, "n": n, "nodes_std": shape.nodes_std, "rounds": int(out["rounds"][0]),
                "total_us": float(out["total_us"][0]), "verify_us": float(out["verify_us"][0]), "draft_us": draft,
                "tok_s": float(out["throughput_tok_s"][0]), "level_weights": shape.weights, "decision_ctx": None}
    static = adaptive_bucket(acc, spec, costs, b, l0) if bucket is None else int(bucket)
    ad = AdaptiveRounds(acc, spec, costs, b, max_nodes=static if tree_cap is None else int(tree_cap))
    # The per-round budget decision depends on the context only through C_v, which moves
    # negligibly over a few tokens: decide once per quantum-token bucket of context (the
    # rounds' own costs below still use their exact contexts).
    quantum = max(CTX_QUANTUM, math.ceil(N / MAX_DECISIONS))
    produced, ctx, total, verify_sum, rounds, gs = 0.0, l0, 0.0, 0.0, 0, 0.0
    level_rounds, tree_nodes = np.zeros(acc.num_levels), 0.0   # tree_nodes: the rule's nodes over every round
    decided = [math.inf, -math.inf]   # the contexts the decisions ask C_v at: up to quantum / 2 off ctx
    while produced < N - 1e-9:   # one decision per bucket: its rounds all go at once below
        bucket = int(round(ctx / quantum))
        at = bucket * quantum or ctx
        decided = [min(decided[0], at), max(decided[1], at)]
        nodes, w = ad.decide(at)   # level l carries b * w_l requests
        g = 1.0 + float(sum(w[i] * ad.phi(i, int(nodes[i])) for i in range(acc.num_levels)))
        # every round left in this bucket at once: contexts ctx + g j while they round to it
        left = max(1, math.ceil((N - 1e-9 - produced) / g))
        span = max(1, math.ceil(((bucket + 0.5) * quantum - ctx) / g) + 1)
        j = np.arange(min(left, span))
        ctxs = ctx + g * j
        keep = (np.round(ctxs / quantum) == bucket) & (produced + g * j < N - 1e-9)
        keep[0] = True
        k = int(keep.size if keep.all() else np.argmin(keep))
        v = float(np.sum(costs.verify.predict(np.full(k, float(static)), ctxs[:k], b)))
        total += v + k * ad.draft_us
        verify_sum, produced, ctx = verify_sum + v, produced + g * k, ctx + g * k
        rounds, gs = rounds + k, gs + g * k
        level_rounds += w * k
        tree_nodes += k * float(w @ nodes)
        last = (g, float(ctxs[k - 1]))   # the run's last round, priced once after the loop
    last_g, last_ctx = last
    paid = _expected_rounds_time(total, float(costs.verify.predict(float(static), last_ctx, b)) + ad.draft_us,
                                 rounds, produced, N, last_g)
    return {"g": gs / rounds, "n": float(static), "nodes_std": 0.0, "rounds": rounds,
            "total_us": total, "verify_us": verify_sum / rounds, "draft_us": ad.draft_us,
            "tok_s": b * float(N) / float(paid) * 1e6, "level_weights": level_rounds / rounds,
            "decision_ctx": (float(decided[0]), float(decided[1])), "tree_nodes": tree_nodes / rounds,
            "bucket": static}


def _monte_carlo(workload: Workload, spec: PolicySpec, costs: Costs, b: int, rounds: int, runs: int,
                 seed: int, level_weights: np.ndarray, progress=None, bucket: int | None = None) -> dict:
    """``runs`` replications of ``rounds`` rounds.  A sequence outputs N = output_len tokens, then
    its slot takes a new request (continuous batching: a fresh prompt); what its last round
    accepted beyond N is not output, as in the analytic run.  Levels are drawn per sequence per
    round from ``level_weights`` (the policy's rounds, as the analytic run spreads them);
    cost_aware prices each run's nodes at its own running rate, as the runtime does; with a
    ``bucket`` the adaptive modes' trees are capped at it and every round verifies it."""
    acc, N = workload.acceptance, workload.output_len
    rng = np.random.default_rng(seed)
    adaptive = isinstance(spec, (CostAwareParams, BatchAllocParams))
    ad = AdaptiveRounds(acc, spec, costs, b, max_nodes=bucket) if adaptive else None
    shape = None if adaptive else static_round(acc, spec)
    draft = ad.draft_us if adaptive else _draft_us(costs, spec, b)
    p = np.asarray(level_weights, np.float64) / np.sum(level_weights)
    chain = acc.scores_chain(spec.mode)
    tput, acc_per_round, cache = np.zeros(runs), np.zeros(runs), {}
    for run in range(runs):
        ctx = rng.choice(workload.prompt_lens, b).astype(np.float64)
        produced, time, accepted, output = np.zeros(b), 0.0, 0.0, 0.0
        price = RunningPrice()
        for _ in range(rounds):
            levels = rng.choice(acc.num_levels, b, p=p)
            if adaptive:
                nodes = ad.round_nodes(levels, float(ctx.mean()), price)
            else:
                nodes = shape.nodes[levels].astype(np.int64)
            gained = np.ones(b)
            for key in set(zip(levels.tolist(), nodes.tolist())):
                idx = np.flatnonzero((levels == key[0]) & (nodes == key[1]))
                if key not in cache:
                    cache[key] = ((ad.tree(*key), ad.tables[key[0]]) if adaptive
                                  else (shape.trees[key[0]], shape.tables[key[0]]))
                tree, table = cache[key]
                gained[idx] += sample_accepted_length(tree, rng, idx.size, marginal_tokens=rank_tokens(table),
                                                      marginal_probs=table, chain_marginals=chain)
            verified = float(nodes.mean()) if bucket is None or not adaptive else float(bucket)
            round_us = draft + float(costs.verify.predict(verified, float(ctx.mean()), b))
            price.update(gained.sum(), round_us)
            time += round_us
            accepted += gained.sum()
            done = produced + gained >= N
            output += float(np.where(done, N - produced, gained).sum())
            produced = np.where(done, 0.0, produced + gained)
            ctx += gained
            if done.any():
                ctx[done] = rng.choice(workload.prompt_lens, int(done.sum()))
        tput[run] = output / time * 1e6
        acc_per_round[run] = accepted / (rounds * b)
        if progress:
            progress(run + 1, runs)
    half = lambda x: 1.96 * x.std(ddof=1) / math.sqrt(runs)  # noqa: E731  (runs >= 2)
    return {"throughput_tok_s": float(tput.mean()), "accepted_tokens_per_round": float(acc_per_round.mean()),
            "ci95": {"throughput_tok_s": [float(tput.mean() - half(tput)), float(tput.mean() + half(tput))],
                     "accepted_tokens_per_round": [float(acc_per_round.mean() - half(acc_per_round)),
                                                   float(acc_per_round.mean() + half(acc_per_round))]}}


def _capped_budget_note(workload: Workload, spec: PolicySpec, nodes: float) -> str | None:
    """A note when a fixed budget is more than the policy's drafted shape can fill."""
    if not isinstance(spec, BestFirstParams):
        return None
    budget = spec.budget
    most = int(max(static_round(workload.acceptance, spec).nodes))
    if most >= budget:
        return None
    return (f"{spec.mode} budget {budget} is more than its drafted shape holds ({spec.draft_depth} "
            f"positions x top-{workload.acceptance.topk}): it verifies {nodes:.1f} nodes per sequence "
            f"(at most {most}), and the linear comparison uses that many")


MAX_TREE_NODES = 1024   # the largest budget simulated (nodes per sequence, root included)
MAX_DRAFT_STEPS = 64    # the most draft steps, top-k, draft depth or heap width simulated
_BUDGETS = ("budget", "max_budget", "max_budget_per_seq")


def check_simulable(spec: PolicySpec) -> PolicySpec:
    """``spec`` when its budget is at most MAX_TREE_NODES and its other counts (steps, top-k,
    draft depth, width) at most MAX_DRAFT_STEPS, else a one-line SimtreeError naming the limit:
    one policy at the limits takes the simulator a few seconds, beyond them minutes (budget
    5000: ~30 s; steps and top-k 1024: > 2 min), and no verify profile reaches such trees."""
    for name, value in spec.to_dict().items():
        limit, what = (MAX_TREE_NODES, "MAX_TREE_NODES") if name in _BUDGETS else (MAX_DRAFT_STEPS, "MAX_DRAFT_STEPS")
        if value > limit:
            raise SimtreeError(f"{spec.mode} {name} {value}: the simulator takes at most {limit} "
                               f"(simtree.planning.simulate.{what}: larger trees take it minutes and lie far "
                               "outside any measured verify cost)")
    if spec.mode in ("block", "tfm", "dspark"):
        raise SimtreeError(f"{spec.name}: the simulator does not run block-drafter rounds; `simtree plan` scores "
                           "them where the cost bundle has the drafter's C_d, `simtree run --model` runs them")
    return spec


def _bucket_note(spec: PolicySpec, a: dict) -> str | None:
    """What an adaptive run verifies against what its rule chooses."""
    if a.get("bucket") is None:
        return None
    return (f"{spec.mode} verifies a static bucket of {a['bucket']} nodes per sequence every round (as the full "
            f"runtime runs it); its rule's trees hold {a['tree_nodes']:.2f} nodes on average")


def simulate(costs: Costs, workload: Workload, batch_size: int, spec: PolicySpec, *, mc_runs: int = 0,
             seed: int = 0, progress=None, bucket: int | None = None) -> SimResult:
    """Simulate ``spec`` for ``workload`` at ``batch_size``; Monte-Carlo when mc_runs > 0
    (>= 2 replications: throughput and accepted tokens then come from the samples, with
    ``ci95``; ``progress(done, total)`` is called after each replication).  The linear
    comparison is at the nodes per sequence the policy actually verifies.  ``bucket``: the
    nodes cost_aware and batch_alloc verify per sequence every round (module docstring;
    default :func:`adaptive_bucket`).  A policy beyond
    MAX_TREE_NODES is refused (:func:`check_simulable`)."""
    b = check_batch_size(batch_size)
    check_simulable(spec)
    if check_whole(mc_runs, "Monte-Carlo runs", 0, 2 ** 31) == 1:
        raise SimtreeError(f"Monte-Carlo runs must be 0 (analytic) or >= 2 (for an interval), got {mc_runs}")
    check_whole(seed, "seed", 0, SEED_MAX)
    a = analytic_run(workload, spec, costs, b, bucket=bucket)
    throughput = a["tok_s"]
    none_tput = analytic_run(workload, NoneParams(), costs, b)["tok_s"]
    lin_d = max(1, int(round(a["n"])))
    lin_tput = (analytic_run(workload, LinearParams(lin_d), costs, b)["tok_s"]
                if lin_d >= 2 else none_tput)
    notes = [n for n in (_capped_budget_note(workload, spec, a["n"]), _bucket_note(spec, a)) if n]
    accepted, ci = a["g"], {}
    if mc_runs:
        mc = _monte_carlo(workload, spec, costs, b, a["rounds"], int(mc_runs), int(seed), a["level_weights"],
                          progress, a.get("bucket"))
        throughput, accepted, ci = mc["throughput_tok_s"], mc["accepted_tokens_per_round"], mc["ci95"]
    return SimResult(policy=spec.name, mode=spec.mode, params=spec.to_dict(), workload=workload.name,
                     batch_size=b, method=f"monte_carlo x{mc_runs}" if mc_runs else "analytic",
                     accepted_tokens_per_round=accepted, mean_nodes_per_seq=a["n"],
                     round_latency_us=a["total_us"] / a["rounds"], draft_us=a["draft_us"],
                     verify_us=a["verify_us"], throughput_tok_s=throughput, per_seq_tok_s=throughput / b,
                     rounds=a["rounds"], speedup_vs_none=throughput / none_tput,
                     speedup_vs_linear=throughput / lin_tput, linear_budget=lin_d, ci95=ci,
                     synthetic=bool(costs.meta.get("synthetic", False)),
                     model=str(costs.meta.get("model", "")), notes=notes, nodes_std_per_seq=a["nodes_std"],
                     deployment=str(costs.meta.get("deployment") or "tp=1"),
                     communication=_comm_label(costs.meta))

