"""The MTP layer falling behind during plain rounds, and its catch-up (:class:`DraftLag`).

An engine with a plain and an MTP-drafted round shape (an online controller's tiers) runs a
plain round as the target's decode step alone, as serving engines do while speculation is off.
What the MTP layer will need of that round - its entry (hidden_q, token_q+1): the target's
hidden state at the round's position and the token it produced - goes into a buffer of
``rows`` rows per sequence at the row a device counter names (inside a captured graph: no host
read).  The host counts those rounds; :meth:`DraftLag.catch_up` runs the MTP layer over all
waiting rows in one batch (a causal chain over them, as a speculative round's catch-up runs
over its accepted path), eagerly, and returns the last row for the next draft's first top-k.
The rows of one catch-up see each other whole, so ``rows`` is at most the MTP layer's window.
"""
from __future__ import annotations

import torch

from simtree.errors import SimtreeError

__all__ = ["DraftLag", "LAG_ROWS"]

LAG_ROWS = 64           # plain rounds the MTP layer may fall behind before a catch-up


class DraftLag:
    def __init__(self, model, ds, batch_size: int, rows: int | None = None):
        """``rows``: the buffer's rows per sequence (default LAG_ROWS, capped at the draft state's
        scratch rows and the MTP layer's window)."""
        scratch = ds.scratch.shape[1]
        cap = min(scratch, model.draft_window or scratch)
        R = min(LAG_ROWS, cap) if rows is None else int(rows)
        if not 1 <= R <= cap:
            raise SimtreeError(f"lag_rows must be in [1, {cap}] (the MTP layer's scratch rows and window), got {R}")
        dev = ds.lengths.device
        self.rows = R
        self.waiting = 0      # plain rounds since the last catch-up (host count)
        self.tokens = torch.zeros(batch_size, R, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros(batch_size, R, model.hidden, dtype=model.dtype, device=dev)
        self.at = torch.zeros(1, dtype=torch.int64, device=dev)     # the next row (device)

    def keep(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """A plain round's row: the token it produced [B] and the target's hidden state [B, h]
        (device only: capturable)."""
        self.tokens.index_copy_(1, self.at, tokens[:, None])
        self.hidden.index_copy_(1, self.at, hidden[:, None])
        self.at.add_(1).remainder_(self.rows)   # the host catches up before it wraps (capture's warm-up may)

    def catch_up(self, model, ds, chain_bits) -> torch.Tensor | None:
        """The MTP layer over the waiting rows (``chain_bits(n)``: the causal mask over n scratch
        rows): its cache gains them and its lengths advance; -> the last row's output [B, h]
        (None when nothing waits).  Eager."""
        n = self.waiting
        if n == 0:
            return None
        B = ds.lengths.shape[0]
        cols = torch.arange(n, device=ds.lengths.device)
        pos = ds.lengths[:, None] + cols
        rows = cols.expand(B, n)
        out = model.draft_forward(ds, self.tokens[:, :n].contiguous(), self.hidden[:, :n].contiguous(), pos, rows,
                                  chain_bits(n))
        ds.commit(rows, pos)
        ds.lengths += n
        self.drop()
        return out[:, n - 1]

    def drop(self) -> None:
        """Nothing waits (after a catch-up, a reset or a new context)."""
        self.waiting = 0
        self.at.zero_()
