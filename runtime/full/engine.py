"""Speculative decoding rounds for a static batch, as a serving engine runs them: the runtime's one
engine, for the tiny default (``simtree run``, :mod:`.generate`) and full-scale ranks alike.

    engine = FullEngine(model, round_shape(spec), batch_size=4, max_len=1024, source=Live())
    engine.capture()                   # CUDA graphs per stage (CUDA + a capturable model)
    engine.prefill(prompts)            # or engine.fill_context(512) for replay runs
    stats = engine.run(rounds=32)      # or run(max_new_tokens=...) for live decoding
    engine.outputs()                   # live: the tokens each sequence produced

One round, every stage on the device with static shapes (B sequences, n nodes each):

    draft    EAGLE-style tree from the MTP layer's top-k (:mod:`.drafting`), or the best-first
             tree over its top-1 chain's marginals (:mod:`.best_first`), each sequence's budget
             chosen on the device by cost_aware's or batch_alloc's rule (:mod:`.allocation`)
    verify   the target over all B trees -> argmax per node; the acceptance source picks each
             sequence's accepted node; its root path, the bonus token, the outputs
    catchup  the MTP layer over the accepted path with the target's hidden states (its cache
             gains those rows; its last row gives the next round's first top-k)
    commit   the target's persistent state: the accepted path only

Plain decoding (budget 1) is one stage: the target's decode step and its argmax.  With CUDA
graphs each stage is one graph replay, captured per (batch, nodes) bucket; the graphs share
one memory pool and replay in capture order.  The host reads nothing inside a round: live runs
read the output lengths once a round (to stop), replays not even that.  Each round's accepted
lengths and tree sizes go to a device log; the host counts the rounds and reads the log once,
after them (``run``, or ``begin``, ``step`` per round and ``stats`` for a caller's own loop).
Without a GPU the same stages run eagerly.  An engine built with more round ``shapes`` switches
between them per round (``use``: an online controller's tiers; each shape replays its own graphs).

Plain rounds of such an engine let the MTP layer fall behind, as serving engines do while
speculation is off: the round is the target's decode step alone (the single-shape plain
engine's stage) plus two device copies of the rows the MTP layer will need (:mod:`.lag`).
One batched catch-up (:meth:`catch_up`) runs between rounds when ``use`` switches to a
speculative shape, before a prefill, and before a plain round that would overflow the buffer
(every ``lag_rows`` plain rounds), over a power-of-two bucket of rows prepared (and captured)
beforehand; ``RunStats.catchup_ms`` times it (with the round it precedes).

Timing, per round: ``draft_ms`` (draft + catchup), ``verify_ms``, ``commit_ms`` from CUDA
events around the stages (perf counters on CPU); ``host_ms`` is the CPU time spent issuing the
round, from its first launch to the return of its last (graph replays: a few launches) - the
host work a round adds, which overlaps the device unless the host is the slower of the two.
Inside a run of back-to-back rounds a launch can wait for the device (the queue is full), so
that issue time would count device time as host work: ``run(host_probe=N)`` times the issue
of N more rounds, each launched onto an idle device, and reports those.  On CPU, where host and device
are the same, ``host_ms`` is the round's wall time outside its stages.  The run's wall time
over all rounds gives the measured round time and throughput.  The round loop, its statistics
and what the host reads back are :mod:`.rounds`'s (:class:`.rounds.EngineRounds`).
"""
from __future__ import annotations

import gc
import math
import traceback

import numpy as np
import torch

from simtree.errors import SimtreeError

from .acceptance import Live
from simtree.kernels.layers.attention import chain_bits
from .best_first import best_first, draft_marginals, lay_chain, lay_out, marginal_candidates
from .drafting import RoundShape, accepted_path, draft_tree, topk_logp
from .lag import DraftLag
from .layout import RoundLayout
from .rounds import LOG_CAP, OUT_CAP, EngineRounds, RunStats

__all__ = ["FullEngine", "RunStats", "PREFILL_CHUNK", "OUT_CAP", "draft_scratch_rows", "sync_device",
           "release_memory"]

PREFILL_CHUNK = 64      # prompt tokens per sequence per prefill verify (the GDN kernels' decode sizes)


def draft_scratch_rows(shapes) -> int:
    """The scratch rows of the MTP layer's draft state in an engine of round ``shapes``: its
    widest MTP-drafted round's, or a prefill chunk's (an engine's lag buffer is at most this:
    :func:`.lag.lag_rows`)."""
    return max([s.scratch_rows for s in shapes if not s.plain and not s.block_drafter] + [PREFILL_CHUNK])


def sync_device(device) -> None:
    """Waits for the work queued on ``device`` (a torch.device or its name; a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory() -> None:
    """A finished engine's CUDA graphs and their memory pools freed before the next is built (a
    full-scale target leaves little room beside its weights)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class FullEngine(EngineRounds):
    # the tensors a round's stages leave on the engine (the accepted nodes, the marginals, ...),
    # read after it (last_round, tests) or by a later stage: a captured shape's replays refill
    # its own, which use() binds again (capture)
    STAGE_OUTPUTS = ("_marginals", "_hidden", "_target_next", "_accepted", "_acc_len", "_path", "_next_tok",
                     "_row_ok", "_base_len", "_plain_root")

    def __init__(self, model, rs: RoundShape, batch_size: int, max_len: int, source=None,
                 graphs: bool | None = None, costs=None, shapes=(), trace_topk: int = 0,
                 lag_rows: int | None = None):
        """``costs``: the cost bundle whose C_d and C_v cost_aware and batch_alloc decide with.
        ``shapes``: more round shapes the rounds may switch to (:meth:`use`: an online
        controller's tiers); each shape's stages are captured (:meth:`capture`).  ``trace_topk`` > 0: a
        traced engine, whose rounds keep what :meth:`last_round` reads (a plain round's root, a
        block drafter's marginals); its linear rounds keep the drafter's top-``trace_topk`` at
        every drafted position, drafting the same chain.  ``lag_rows``: plain rounds the MTP layer may fall behind
        (engines with a plain and an MTP-drafted shape: :class:`.lag.DraftLag`)."""
        self.model, self.B, self.costs = model, int(batch_size), costs
        self.source = source or Live()
        dev = self.device = model.device
        self.st = model.new_state(self.B, max_len)
        every = [rs, *shapes]
        # block drafters (rs.block_drafter) keep their own state (:mod:`.block_engine`)
        speculative = [s for s in every if not s.plain and not s.block_drafter]
        self.trace_topk = int(trace_topk)
        self.traced = self.trace_topk > 0
        self.ds = model.new_draft_state(self.st, draft_scratch_rows(every)) if speculative else None
        self.verify_kw = {}     # extra arguments of the target's verify (a block drafter's layer taps)
        B = self.B
        self.first_k = max([max(s.topk, 1) for s in every] + [self.trace_topk])
        self.roots = torch.zeros(B, dtype=torch.int64, device=dev)
        self.first_logp = torch.zeros(B, self.first_k, dtype=torch.float32, device=dev)
        self.first_ids = torch.zeros(B, self.first_k, dtype=torch.int64, device=dev)
        self.first_hidden = torch.zeros(B, model.hidden, dtype=model.dtype, device=dev)
        self.out_buf = torch.zeros(B, OUT_CAP + 1, dtype=torch.int64, device=dev)
        self.out_len = torch.zeros(B, dtype=torch.int64, device=dev)
        self.acc_log = torch.zeros(LOG_CAP, B, dtype=torch.int32, device=dev)
        self.node_log = torch.zeros(LOG_CAP, B, dtype=torch.int32, device=dev)    # tree sizes, beside
        self.log_at = torch.zeros(1, dtype=torch.int64, device=dev)    # the next log row (in the graphs)
        self.rounds_logged = 0      # rounds the log holds since the last reset: log_at, counted on the host
        self._ctx0 = torch.zeros(B, dtype=torch.int64, device=dev)   # the context at begin()
        self._issued = []           # the rounds since begin(): (stage names, marks, host ms, catch-up marks)
        self._log_first = 0         # the log row of begin()'s first round
        self._layouts = {s: RoundLayout.of(s, B, dev, self._chain_bits(s.path_rows), costs, max_len) for s in every}
        # plain rounds leave the MTP layer's rows for a later catch-up (an MTP shape drafts after them)
        self.lag = DraftLag(model, self.ds, B, lag_rows) if self.ds is not None and any(s.plain for s in every) \
            else None
        self._catchup_marks = []
        if self.lag is not None and dev.type == "cuda":
            self._prepare_lag(graphs=False)     # every catch-up bucket's kernels compiled before serving
        self.use(rs)
        capturable = dev.type == "cuda" and model.capturable
        self.use_graphs = capturable if graphs is None else bool(graphs)
        if self.use_graphs and not capturable:
            raise SimtreeError("CUDA graphs need a CUDA device and a capturable model")
        self.graphs = None        # the captured stages of the round shape in use
        self._shape_graphs = {}   # every round shape's captured stages (capture())
        self._shape_outputs = {}  # every round shape's stage outputs the host reads (capture(), use())
        self.capture_error = None   # why capture() fell back to eager stages, if it did
        self.capture_traceback = None   # where, in full

    def use(self, rs: RoundShape) -> None:
        """The round shape the next rounds run (one given to the constructor)."""
        if rs not in self._layouts:
            raise SimtreeError(f"{rs.name}: not a round shape this engine was built for")
        lay = self._layouts[rs]
        if not rs.plain and getattr(self, "lag", None) is not None:
            self.catch_up()     # drafting resumes: the MTP layer first catches up on the plain rounds
        self.rs, self.tree, self.alloc, self.own_bits = lay.rs, lay.tree, lay.alloc, lay.own_bits
        select = getattr(self.source, "use", None)     # a source per shape (acceptance.ShapeSources)
        if select is not None:
            select(rs)
        self.path_cols, self.chain = lay.path_cols, lay.chain
        if getattr(self, "_shape_graphs", None):
            self.graphs = self._shape_graphs.get(rs)
            for name, value in self._shape_outputs.get(rs, {}).items():
                setattr(self, name, value)   # what the host reads after a replay (last_round): this shape's

    @torch.no_grad()
    def catch_up(self) -> None:
        """The MTP layer over the rows plain rounds left it (:class:`.lag.DraftLag`), eagerly,
        outside the graphs: its lengths equal the target's again and its last row gives the next
        draft's first top-k.  Timed (``RunStats.catchup_ms``: the one-off a switch to a speculative
        shape adds, outside the rounds' stages); a no-op when it is not behind."""
        if self.lag is None or not self.lag.waiting:
            return
        cuda = self.device.type == "cuda"
        start = self._mark(cuda)
        self.lag.catch_up(self.model, self.ds, self._chain_bits, self._set_first)
        self._catchup_marks.append((start, self._mark(cuda)))

    def _prepare_lag(self, graphs: bool) -> None:
        """Every catch-up bucket run once, the draft state put back (:meth:`.lag.DraftLag.prepare`);
        ``graphs``: each bucket captured too."""
        self.lag.prepare(self.model, self.ds, self._chain_bits, self._set_first,
                         (self.first_logp, self.first_ids, self.first_hidden), graphs)

    def _take_lag_row(self) -> None:
        """Before a round: a plain round of a lagging engine takes a buffer row (a full buffer is
        caught up first)."""
        lag = self.lag
        if self.rs.plain and lag is not None:
            if lag.waiting >= lag.rows:
                self.catch_up()
            lag.waiting += 1

    def _chain_bits(self, rows: int) -> torch.Tensor:
        """Causal-chain bits over the first ``rows`` scratch rows, as wide as the scratch."""
        bits = chain_bits(self.B, rows, self.device)
        if self.ds is None:
            return bits
        words = (self.ds.scratch.shape[1] + 63) // 64
        return torch.nn.functional.pad(bits, (0, words - bits.shape[-1]))

    # ---- stages ------------------------------------------------------------------------------
    def _stages(self) -> list:
        if self.rs.plain:
            return [("verify", self._plain)]
        return [("draft", self._draft), ("verify", self._verify), ("catchup", self._catchup), ("commit", self._commit)]

    def _draft(self) -> None:
        scores = getattr(self.source, "scores", None)
        if scores is not None:
            scores.draw(self.B)        # the round's acceptance level, known to the drafter
        rescore = None if scores is None else scores.rescore
        chain = self._keeps_chain_topk()
        k = self.trace_topk if chain else self.rs.topk
        first = (self.first_logp[:, :k], self.first_ids[:, :k], self.first_hidden)
        if not (self.rs.marginal or chain):
            draft_tree(self.model, self.ds, self.rs, self.roots, *first, self.tree, self.own_bits, rescore)
            return
        lp, ids = draft_marginals(self.model, self.ds, self.rs, *first, self.own_bits, rescore)
        self._marginals = (lp, ids)
        if chain:
            lay_chain(self.tree, self.roots, lp[..., 0], ids[..., 0])
            return
        cand = marginal_candidates(lp, ids, self.rs)
        order = best_first(cand, self.rs)
        extra = None
        if self.alloc is not None:   # survival = prefix probabilities in best-first order
            survival = cand[0].gather(1, order).double().exp()
            extra = self.alloc.allocate(survival, self.st.lengths.double().mean())
        lay_out(self.tree, self.roots, cand, order, self.rs.topk, extra)

    def _verify(self) -> None:
        t, m, B, n = self.tree, self.model, self.B, self.rs.nodes
        hidden, self._pend = m.verify(self.st, t.tokens, t.parents, **self.verify_kw)
        self._hidden = hidden.view(B, n, -1)
        target_next = self._target_next = m.greedy(hidden).view(B, n)
        acc = self._accepted = self.source.accept(t, target_next, self.rs)
        acc_len = self._acc_len = t.depth.gather(1, acc[:, None])[:, 0]
        bonus = target_next.gather(1, acc[:, None])[:, 0]
        path = self._path = accepted_path(t.parents, t.depth, acc, self.rs.path_rows)
        # row r of the accepted path is followed by path[r + 1]'s token, its last row by the bonus
        follow = torch.cat([t.tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)
        self._next_tok = torch.where(self.path_cols == acc_len[:, None], bonus[:, None], follow)
        self._row_ok = self.path_cols[None, :] <= acc_len[:, None]
        self._base_len = self.st.lengths.clone()
        self._record(self._next_tok, self._row_ok, acc_len, t.valid.sum(1))
        self.roots.copy_(bonus)
        if self.alloc is not None:
            self.alloc.update((acc_len + 1).sum())

    def _catchup(self) -> None:
        m, ds, B, P = self.model, self.ds, self.B, self.rs.path_rows
        prev = self._hidden.gather(1, self._path[..., None].expand(B, P, self._hidden.shape[-1]))
        pos = self._base_len[:, None] + self.path_cols
        rows = self.path_cols.expand(B, P)
        out = m.draft_forward(ds, self._next_tok, prev, pos, rows, self.chain)
        ds.commit(rows, torch.where(self._row_ok, pos, ds.max_len))
        last = out.gather(1, self._acc_len[:, None, None].expand(B, 1, out.shape[-1]))[:, 0]
        self._set_first(last)
        ds.lengths += self._acc_len + 1

    def _commit(self) -> None:
        self.model.commit(self.st, self._pend, self._accepted)

    def _keeps_chain_topk(self) -> bool:
        """A linear round (a chain of every drafted position) whose marginals are kept (traces)."""
        rs = self.rs
        return bool(self.trace_topk) and rs.topk == 1 and rs.num_steps == rs.budget - 1 and not rs.marginal

    def _plain(self) -> None:
        if self.traced:     # the round's tree, the root alone, for last_round
            self._plain_root = self.roots.clone()
        hidden = self.model.decode(self.st, self.roots)
        nxt = self.model.greedy(hidden)
        ones = torch.ones(self.B, 1, dtype=torch.bool, device=self.device)
        self._record(nxt[:, None], ones, torch.zeros_like(nxt), ones[:, 0])
        self._target_next = nxt[:, None]
        self.roots.copy_(nxt)
        if self.lag is not None:   # the MTP layer's row (hidden_q, token_q+1) waits for its catch-up
            self.lag.keep(nxt, hidden)

    def _set_first(self, hidden: torch.Tensor) -> None:
        lp, ids = topk_logp(self.model.draft_logits(hidden), self.first_k)
        self.first_logp.copy_(lp)
        self.first_ids.copy_(ids)
        self.first_hidden.copy_(hidden)

    def _record(self, tokens, ok, acc_len, nodes) -> None:
        """Tokens a round produced ([B, P], ``ok`` marks them) into the outputs; its accepted
        lengths and tree sizes ([B]) into the device log."""
        pos = self.out_len[:, None] + torch.arange(tokens.shape[1], device=self.device)
        dest = torch.where(ok & (pos < OUT_CAP), pos, OUT_CAP)
        self.out_buf.scatter_(1, dest, tokens)
        self.out_len += ok.sum(1)
        row = self.log_at % LOG_CAP
        self.acc_log.index_copy_(0, row, acc_len.to(torch.int32)[None])
        self.node_log.index_copy_(0, row, nodes.to(torch.int32)[None])
        self.log_at += 1

    # ---- set-up ------------------------------------------------------------------------------
    def reset(self) -> None:
        self.model.reset(self.st, self.ds)
        for lay in self._layouts.values():
            if lay.alloc is not None:
                lay.alloc.reset()
        for t in (self.out_len, self.log_at, self.roots):
            t.zero_()
        self.rounds_logged = 0
        if self.lag is not None:
            self.lag.drop()
        self.rewind_source()

    def rewind_source(self) -> None:
        """A replay's table from its first row again (its ``rewind``; live decoding has none)."""
        rewind = getattr(self.source, "rewind", None)
        if rewind is not None:
            rewind()

    @torch.no_grad()
    def capture(self, warmup: int = 2, shared_pool: bool = True) -> None:
        """Capture one CUDA graph per stage of every round shape the engine was built for (an
        engine with several shapes, such as the controller's tiers, replays the graphs of the
        shape :meth:`use` selects); warm-up runs first (Triton compiles, cached tables), and the
        state is reset afterwards.  A no-op where graphs are off; where capture fails the stages
        run eagerly and ``capture_error`` says why.

        ``shared_pool``: a shape's stages share one memory pool, so a stage's temporaries may
        lie where an earlier-captured stage kept its own; right for whole rounds in stage order,
        wrong for replaying a subset (a profiled draft step replays draft and catch-up without
        the verify whose outputs the catch-up reads): those take one pool per stage.  Shapes
        never share a pool (a round of one shape must not overwrite another's captured memory)."""
        if not self.use_graphs:
            return
        current, captured, outputs = self.rs, {}, {}
        try:
            for rs in self._layouts:
                self.use(rs)
                for name in self.STAGE_OUTPUTS:     # what this shape's stages leave, and nothing else
                    self.__dict__.pop(name, None)
                captured[rs] = self._capture_stages(warmup, shared_pool)
                outputs[rs] = {k: vars(self)[k] for k in self.STAGE_OUTPUTS if k in vars(self)}
            if self.lag is not None:    # the catch-up's buckets: graphs of their own pools
                self._prepare_lag(graphs=True)
        except Exception as exc:   # noqa: BLE001 - not capturable here: the same stages run eagerly
            self.capture_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            self.capture_traceback = traceback.format_exc()
            captured, outputs = {}, {}
        torch.cuda.synchronize()
        self._shape_graphs, self._shape_outputs = captured, outputs
        self.use(current)
        self.reset()

    def _capture_stages(self, warmup: int, shared_pool: bool) -> list:
        """[(stage name, CUDAGraph)] of the round shape in use."""
        stages = self._stages()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                for _, fn in stages:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        graphs = []
        for name, fn in stages:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool if shared_pool else torch.cuda.graph_pool_handle()):
                fn()
            graphs.append((name, g))
        return graphs

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> None:
        """Commit each prompt after what the sequences hold; the target's argmax after it is the
        first output token (and the next round's root), the MTP layer catches up on the prompt.
        Chains of at most PREFILL_CHUNK tokens per sequence per verify, eagerly."""
        if len(prompts) != self.B or any(len(p) == 0 for p in prompts):
            raise SimtreeError(f"prefill needs {self.B} non-empty prompts, got {len(prompts)}")
        self.catch_up()
        chunks = max(math.ceil(len(p) / PREFILL_CHUNK) for p in prompts)
        if min(map(len, prompts)) < chunks:
            raise SimtreeError(f"prompts of {min(map(len, prompts))} to {max(map(len, prompts))} tokens: each "
                               f"needs at least {chunks} tokens (the prefill splits all into {chunks} chunks)")
        pieces = [np.array_split(np.asarray(p, np.int64), chunks) for p in prompts]
        hidden = [[] for _ in prompts]
        for c in range(chunks):
            part = [pc[c] for pc in pieces]
            h, last = self._prefill_target(part)
            for b, x in enumerate(h):
                hidden[b].append(x)
        first = self.model.greedy(last)
        self.roots.copy_(first)
        self.out_buf[:, 0] = first
        self.out_len.fill_(1)
        if self.ds is not None:
            nxt = [np.append(np.asarray(p[1:], np.int64), int(f)) for p, f in zip(prompts, first.tolist())]
            self._prefill_draft([np.array_split(x, chunks) for x in nxt],
                                [torch.cat(h) for h in hidden], [np.cumsum([len(x) for x in pc]) for pc in pieces])

    def _chain(self, part: list[np.ndarray]):
        """(tokens, parents) [B, C] for chains of len(part[b]) tokens; padding = root leaves."""
        C = max(len(x) for x in part)
        tokens = np.zeros((self.B, C), np.int64)
        parents = np.zeros((self.B, C), np.int64)
        for b, x in enumerate(part):
            tokens[b, :len(x)] = x
            parents[b, :len(x)] = np.arange(-1, len(x) - 1)
        dev = self.device
        return torch.as_tensor(tokens, device=dev), torch.as_tensor(parents, device=dev), C

    def _prefill_target(self, part):
        tokens, parents, C = self._chain(part)
        hidden, pend = self.model.verify(self.st, tokens, parents, **self.verify_kw)
        self._pend = pend
        last = torch.as_tensor([len(x) - 1 for x in part], device=self.device)
        self.model.commit(self.st, pend, last)
        hidden = hidden.view(self.B, C, -1)
        return [hidden[b, :len(x)] for b, x in enumerate(part)], hidden[torch.arange(self.B, device=self.device), last]

    def _prefill_draft(self, parts, hidden, ends) -> None:
        """MTP entries (hidden_q, token_q+1) over each prompt, chunk by chunk."""
        ds, dev = self.ds, self.device
        for c in range(len(parts[0])):
            part = [p[c] for p in parts]
            tokens, _, C = self._chain(part)
            lens = torch.as_tensor([len(x) for x in part], device=dev)
            prev = torch.zeros(self.B, C, self.model.hidden, dtype=self.model.dtype, device=dev)
            for b, x in enumerate(part):
                start = int(ends[b][c]) - len(x)
                prev[b, :len(x)] = hidden[b][start:start + len(x)]
            cols = torch.arange(C, device=dev)
            pos = ds.lengths[:, None] + cols
            rows = cols.expand(self.B, C)
            out = self.model.draft_forward(ds, tokens, prev, pos, rows, self._chain_bits(C))
            ds.commit(rows, torch.where(cols[None, :] < lens[:, None], pos, ds.max_len))
            ds.lengths += lens
        self._set_first(out[torch.arange(self.B, device=dev), lens - 1])

    @torch.no_grad()
    def fill_context(self, context_len: int, seed: int = 0) -> None:
        """Replay runs: a context of ``context_len`` tokens per sequence, random content (the
        work does not depend on it) up to the last token, which is prefilled for real."""
        if context_len < 1:
            raise SimtreeError(f"context length must be >= 1 token, got {context_len}")
        self.model.fill_random(self.st, self.ds, context_len - 1, seed)
        if self.ds is not None:
            self.ds.lengths.copy_(self.st.lengths)
        if self.lag is not None:
            self.lag.drop()     # the rows a catch-up waited for are no longer the context
        rng = np.random.default_rng(seed)
        self.prefill([[int(t)] for t in rng.integers(0, self.model.vocab, self.B)])
