"""The MTP layer falling behind during plain rounds, and its catch-up (:class:`DraftLag`).

An engine with a plain and an MTP-drafted round shape (an online controller's tiers) runs a
plain round as the target's decode step alone, as serving engines do while speculation is off.
What the MTP layer will need of that round - its entry (hidden_q, token_q+1): the target's
hidden state at the round's position and the token it produced - goes into a buffer of
``rows`` rows per sequence at the row a device counter names (inside a captured graph: no host
read).  The host counts those rounds; :meth:`DraftLag.catch_up` runs the MTP layer over the
waiting rows in one batch (a causal chain over them, as a speculative round's catch-up runs
over its accepted path) and sets the next draft's first top-k from the last waiting row.  The
rows of one catch-up see each other whole, so ``rows`` is at most the MTP layer's window.

**Buckets.**  A catch-up runs over a few fixed row counts, not over however many rows waited (a
new row count would compile its kernels afresh on the GPU, in the middle of serving): ``n``
waiting rows run as the smallest bucket (1, 2, 4, ... powers of two, and ``rows``) that holds
them (:func:`simtree.control.catchup.bucket_rows`, whose module prices it for the serving
benchmark).  Row i sees rows <= i only (the causal chain), so the n waiting rows
come out as they would alone; the rows past them hold what earlier rounds left (stale, never
read by a waiting row), their positions are the last waiting row's (inside the rope table and
the window), they only touch scratch rows, and their commit goes to the cache's trash row: the
cache gains the n waiting rows and the lengths advance by n.  The waiting count enters as a
device scalar, so one bucket's work is the same kernels whatever ``n`` it holds.

:meth:`DraftLag.prepare` runs every bucket once (the draft state put back; a CUDA engine calls
it when it is built) and, with graphs, captures one CUDA graph per bucket, each in a pool of its own:
a live catch-up then compiles nothing and, captured, replays one graph.
"""
from __future__ import annotations

import contextlib

import torch

from simtree.control.catchup import LAG_ROWS, bucket_rows, catch_up_buckets
from simtree.errors import SimtreeError

__all__ = ["DraftLag", "lag_rows", "LAG_ROWS", "bucket_rows", "catch_up_buckets"]

_nothing = contextlib.nullcontext


def lag_rows(model, scratch_rows: int, rows: int | None = None) -> int:
    """The lag buffer's rows per sequence: ``rows``, by default LAG_ROWS, capped at the draft
    state's ``scratch_rows`` and the MTP layer's window (the rows of one catch-up see each other
    whole); ``rows`` beyond that cap is a one-line error."""
    cap = min(scratch_rows, model.draft_window or scratch_rows)
    R = min(LAG_ROWS, cap) if rows is None else int(rows)
    if not 1 <= R <= cap:
        raise SimtreeError(f"lag_rows must be in [1, {cap}] (the MTP layer's scratch rows and window), got {R}")
    return R


class DraftLag:
    def __init__(self, model, ds, batch_size: int, rows: int | None = None):
        """``rows``: the buffer's rows per sequence (:func:`lag_rows`)."""
        R = self.rows = lag_rows(model, ds.scratch.shape[1], rows)
        dev = ds.lengths.device
        self.buckets = catch_up_buckets(R)
        self.waiting = 0      # plain rounds since the last catch-up (host count)
        self.tokens = torch.zeros(batch_size, R, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(batch_size, R, model.hidden, dtype=model.dtype, device=dev)
        self.at = torch.zeros(1, dtype=torch.int64, device=dev)     # the next row (device)
        self.count = torch.zeros(1, dtype=ds.lengths.dtype, device=dev)   # the rows a catch-up takes (device)
        self.last_bucket = 0  # the rows the last catch-up ran
        self._bits = {}       # bucket -> its causal chain bits
        self._graphs = {}     # bucket -> captured CUDA graph (prepare(graphs=True))

    def keep(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """A plain round's row: the token it produced [B] and the target's hidden state [B, h]
        (device only: capturable)."""
        self.tokens.index_copy_(1, self.at, tokens[:, None])
        self.hidden.index_copy_(1, self.at, hidden[:, None])
        self.at.add_(1).remainder_(self.rows)   # the host catches up before it wraps (capture's warm-up may)

    def _run(self, model, ds, chain_bits, set_first, b: int) -> None:
        """The MTP layer over the first ``b`` buffer rows, ``self.count`` of them waiting (device
        only: capturable)."""
        n = self.count
        B = ds.lengths.shape[0]
        cols = torch.arange(b, device=ds.lengths.device)
        pos = ds.lengths[:, None] + torch.minimum(cols, n - 1)      # rows past n: the last waiting row's position
        rows = cols.expand(B, b)
        bits = self._bits.get(b)
        if bits is None:
            bits = self._bits[b] = chain_bits(b)
        out = model.draft_forward(ds, self.tokens[:, :b].contiguous(), self.hidden[:, :b].contiguous(), pos, rows, bits)
        ds.commit(rows, torch.where(cols < n, pos, ds.max_len))     # rows past n: the trash row
        ds.lengths += n
        set_first(out.index_select(1, n - 1)[:, 0])

    def catch_up(self, model, ds, chain_bits, set_first) -> None:
        """The MTP layer over the waiting rows (``chain_bits(b)``: the causal mask over b scratch
        rows; ``set_first(hidden [B, h])``: the next draft's first top-k from the last waiting
        row): its cache gains them and its lengths advance; ``last_bucket`` says the bucket it
        ran.  A no-op when nothing waits."""
        n = self.waiting
        if n == 0:
            return
        b = bucket_rows(n, self.rows)
        self.count.fill_(n)
        graph = self._graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._run(model, ds, chain_bits, set_first, b)
        self.last_bucket = b
        self.drop()

    @torch.no_grad()
    def prepare(self, model, ds, chain_bits, set_first, kept, graphs: bool = False) -> None:
        """Every bucket once, one waiting row each, then the draft state as it was (its lengths and
        ``kept``: the tensors ``set_first`` writes; the one cache row they wrote lies at the lengths,
        past what any round reads, and the next catch-up overwrites it):
        the first live catch-up of any bucket compiles nothing.  ``graphs``: also one CUDA graph
        per bucket (each its own memory pool), replayed by :meth:`catch_up`."""
        saved = [t.clone() for t in (ds.lengths, *kept)]
        self.count.fill_(1)
        side = torch.cuda.Stream() if graphs else None     # graphs: warm up off the capture's stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else _nothing():
            for b in self.buckets:
                self._run(model, ds, chain_bits, set_first, b)
                ds.lengths.copy_(saved[0])      # each writes the one row the next catch-up overwrites
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            captured = {}
            for b in self.buckets:      # a pool each: buckets replay in any order
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._run(model, ds, chain_bits, set_first, b)
                captured[b] = g
            torch.cuda.synchronize()
            self._graphs = captured
        for t, old in zip((ds.lengths, *kept), saved):
            t.copy_(old)
        self.drop()

    def drop(self) -> None:
        """Nothing waits (after a catch-up, a reset or a new context)."""
        self.waiting = 0
        self.at.zero_()
