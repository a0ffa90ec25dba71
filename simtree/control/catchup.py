"""The drafter's catch-up after plain rounds: its row buckets and its price.

An engine that switches between plain decoding and drafting (an online controller's tiers)
runs a plain round as the target's decode step alone; the MTP layer falls behind and, when
drafting resumes (or every ``LAG_ROWS`` plain rounds, when its buffer is full), catches up in
one forward over the rows that waited, rounded up to a bucket (1, 2, 4, ... powers of two, and
``LAG_ROWS``) so a GPU engine runs a few fixed shapes, prepared and captured beforehand
(``runtime/full/lag.py``).

Its price (:func:`catch_up_us`): one MTP forward over ``bucket * b`` rows of a batch of ``b``
sequences, taken from the fitted draft cost as one draft step of top-1 at ``bucket * b``
sequences, ``C_d(1, 1, bucket * b)``.  That step is what the profile measured of a draft step
(the MTP forward over one row per sequence, its head, and the catch-up over the accepted path
that a drafted round runs), so it prices the rows' forward with the head's cost on every row;
past the draft surface's measured batch range (64 on the shipped bundles) the surface
extrapolates linearly at its last slope (non-decreasing), more than an MTP layer over that many
rows costs where it turns compute-bound.  :class:`CatchUpClock` follows one engine's rounds and
says what each pays.
"""
from __future__ import annotations

import warnings

from simtree.errors import SimtreeError

__all__ = ["LAG_ROWS", "catch_up_buckets", "bucket_rows", "catch_up_us", "CatchUpClock"]

LAG_ROWS = 64           # plain rounds the MTP layer may fall behind before a catch-up


def catch_up_buckets(rows: int) -> tuple[int, ...]:
    """The row counts a catch-up runs at: powers of two below ``rows``, and ``rows``."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return (*out, int(rows))


def bucket_rows(n: int, rows: int = LAG_ROWS) -> int:
    """The bucket ``n`` waiting rows run as (the smallest of :func:`catch_up_buckets` >= n)."""
    if not 1 <= n <= rows:
        raise SimtreeError(f"a catch-up holds 1 to {rows} rows, got {n}")
    return next(b for b in catch_up_buckets(rows) if b >= n)


def catch_up_us(costs, waiting: int, batch_size: int, rows: int = LAG_ROWS) -> float:
    """Microseconds of the catch-up over ``waiting`` plain rounds' rows (0: none) at
    ``batch_size``: ``C_d(1, 1, bucket * batch_size)`` (module docstring)."""
    if waiting <= 0:
        return 0.0
    with warnings.catch_warnings():     # past the measured batches by design (module docstring)
        warnings.simplefilter("ignore")
        return float(costs.draft.predict(1, 1, bucket_rows(int(waiting), rows) * int(batch_size)))


class CatchUpClock:
    """One engine's lag: ``step_us(plain, b)`` before each round -> the catch-up that round pays
    (a speculative round after plain ones: the rows that waited; a plain round on a full buffer:
    ``rows`` of them), and counts the round."""

    def __init__(self, costs, rows: int = LAG_ROWS):
        self.costs, self.rows = costs, int(rows)
        self.waiting = 0
        self.total_us = 0.0
        self.count = 0

    def step_us(self, plain: bool, batch_size: int) -> float:
        due = 0
        if plain:
            if self.waiting >= self.rows:
                due, self.waiting = self.waiting, 0
            self.waiting += 1
        elif self.waiting:
            due, self.waiting = self.waiting, 0
        us = catch_up_us(self.costs, due, batch_size, self.rows)
        self.total_us += us
        self.count += due > 0
        return us
