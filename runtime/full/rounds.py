"""An engine's rounds driven from the host: the round loop (``run``; ``begin``, ``step`` and
``stats`` for a caller's own loop), its timing and statistics (:class:`RunStats`), and what the
host reads back after rounds (``last_accepted``, ``last_round``, ``outputs``).
:class:`.engine.FullEngine` inherits them; its module docstring says what a round computes and
how its stages are timed.

Each round's accepted lengths and tree sizes go to a device log (written inside the round's
stages, ``log_at`` its next row); the host counts the rounds it issues (``rounds_logged``) and
reads the log once, after them.  A live run reads the output lengths once a round, to stop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from simtree.errors import SimtreeError

__all__ = ["EngineRounds", "RunStats", "OUT_CAP", "LOG_CAP", "to_host"]

OUT_CAP = 4096          # output tokens kept per sequence (live runs)
LOG_CAP = 1 << 14       # rounds whose accepted lengths the device log keeps


def to_host(tensors: dict) -> dict:
    """{name: numpy array} of the device ``tensors`` in one device -> host copy: their bytes
    packed into one buffer, each read back at its own dtype and shape (the values unchanged)."""
    flat = [t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()]
    buf = torch.cat(flat).cpu().numpy() if flat else np.zeros(0, np.uint8)
    out, at = {}, 0
    for (name, t), f in zip(tensors.items(), flat):
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        out[name] = buf[at:at + f.numel()].view(dtype).reshape(tuple(t.shape)).copy()    # copy: aligned
        at += f.numel()
    return out


@dataclass
class RunStats:
    """Per round (arrays of ``rounds``): accepted draft tokens per sequence [R, B], stage times
    (ms) and host issue time (ms); ``wall_s`` over all rounds; ``context_lens`` [R] the mean
    context at each round's start; ``nodes`` [R, B] the tree size per sequence (root included,
    padding excluded); ``catchup_ms`` [R] the MTP layer's catch-ups issued with each round
    (:meth:`FullEngine.catch_up`)."""

    rounds: int
    batch_size: int
    accepted: np.ndarray
    draft_ms: np.ndarray
    verify_ms: np.ndarray
    commit_ms: np.ndarray
    host_ms: np.ndarray
    wall_s: float
    context_lens: np.ndarray
    notes: list = field(default_factory=list)
    nodes: np.ndarray | None = None
    catchup_ms: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        return int(self.accepted.sum()) + self.rounds * self.batch_size

    @property
    def round_ms(self) -> float:
        return self.wall_s * 1e3 / max(self.rounds, 1)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def accepted_tokens_per_round(self) -> float:
        """Tokens a sequence gains per round, the bonus included."""
        return 1.0 + float(self.accepted.mean()) if self.rounds else float("nan")


class EngineRounds:
    """The host's side of :class:`.engine.FullEngine`'s rounds (module docstring); it reads the
    engine's ``device``, ``B``, ``st``, ``graphs``, ``_stages()``, ``_take_lag_row()``, its logs
    (``acc_log``, ``node_log``, ``rounds_logged``, ``_ctx0``) and output buffers."""

    @torch.no_grad()
    def run(self, rounds: int | None = None, max_new_tokens: int | None = None, host_probe: int = 0) -> RunStats:
        """``rounds`` rounds, or (live) until every sequence has ``max_new_tokens`` outputs;
        ``host_probe`` more rounds on CUDA, each issued onto an idle device, give ``host_ms``
        (module docstring); they come after the timed rounds and are not in the statistics."""
        if (rounds is None) == (max_new_tokens is None):
            raise SimtreeError("run needs rounds or max_new_tokens (one of them)")
        limit = rounds if rounds is not None else max_new_tokens
        if limit > LOG_CAP or (max_new_tokens is not None and max_new_tokens > OUT_CAP):
            raise SimtreeError(f"at most {LOG_CAP} rounds and {OUT_CAP} output tokens per run")
        cuda = self.device.type == "cuda"
        self.begin()
        t_start = time.perf_counter()
        for _ in range(limit):
            self.step()
            if max_new_tokens is not None and int(self.out_len.min()) >= max_new_tokens:
                break
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t_start
        probe = None
        if cuda and host_probe > 0 and self._issued:
            times = []
            for _ in range(host_probe):
                times.append(self._issue(self._live_stages(), cuda, idle=True)[1])
            torch.cuda.synchronize()
            probe = float(np.median(times))
        return self.stats(wall, probe)

    def begin(self) -> None:
        """Start counting rounds for :meth:`stats` (the context now: a device copy, read there)."""
        self._issued, self._catchup_marks, self._log_first = [], [], self.rounds_logged
        self._ctx0.copy_(self.st.lengths)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        """One round of the shape in use, issued with no host read; what :meth:`stats` reports
        of it (stage marks, issue time, the catch-ups issued since the last round) is kept."""
        stages = self._live_stages()
        cuda = self.device.type == "cuda"
        stamps, host_ms = self._issue(stages, cuda)
        marks, self._catchup_marks = self._catchup_marks, []
        self._issued.append(([name for name, _ in stages], stamps, host_ms, marks))

    def _live_stages(self) -> list:
        return [(name, g.replay) for name, g in self.graphs] if self.graphs else self._stages()

    def _issue(self, stages, cuda: bool, idle: bool = False):
        """(stage marks, host issue ms) of one round of ``stages`` (``idle``: onto an idle device)."""
        self._take_lag_row()
        if idle:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stamps = [self._mark(cuda)]
        for _, fn in stages:
            fn()
            stamps.append(self._mark(cuda))
        host_ms = (time.perf_counter() - t0) * 1e3
        self.rounds_logged += 1
        return stamps, host_ms

    def last_accepted(self) -> np.ndarray:
        """int64 [B]: the last round's accepted draft tokens per sequence (one read)."""
        return self.acc_log[(self.rounds_logged - 1) % LOG_CAP].cpu().numpy().astype(np.int64)

    def last_target_next(self) -> torch.Tensor:
        """The last round's target argmax at every node, [B, n] on the device (no host read; a
        captured round refills the same tensor)."""
        return self._target_next

    @staticmethod
    def _mark(cuda: bool):
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.device.type == "cuda" else (b - a) * 1e3

    def stats(self, wall_s: float, host_ms: float | None = None) -> RunStats:
        """The rounds since :meth:`begin`, read from the device once (after they finish);
        ``wall_s``: their wall time; ``host_ms``: every round's issue time (a probe's) instead of
        the measured one."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        issued, rounds = self._issued, len(self._issued)
        if rounds > LOG_CAP:
            raise SimtreeError(f"at most {LOG_CAP} rounds between begin() and stats()")
        zero = np.zeros(rounds)
        col = {name: zero.copy() for name in ("draft", "catchup", "verify", "commit")}
        spans, catchup = np.zeros(rounds), np.zeros(rounds)
        for i, (names, stamps, _, marks) in enumerate(issued):
            for name, a, b in zip(names, stamps[:-1], stamps[1:]):
                col[name][i] = self._elapsed_ms(a, b)
                spans[i] += col[name][i]
            catchup[i] = sum(self._elapsed_ms(a, b) for a, b in marks)
        idx = torch.as_tensor((self._log_first + np.arange(rounds)) % LOG_CAP, device=self.device)
        accepted = self.acc_log[idx].cpu().numpy().astype(np.int64)
        nodes = self.node_log[idx].cpu().numpy().astype(np.int64)
        gained = (accepted + 1).mean(1)
        ctx0 = float(self._ctx0.double().mean())
        ctx = ctx0 + np.concatenate([[0.0], np.cumsum(gained)[:-1]])
        if host_ms is not None:
            host = np.full(rounds, host_ms)
        elif cuda:
            host = np.array([h for _, _, h, _ in issued])
        else:    # host and device are one: the host's share is the time outside the stages
            host = np.maximum(wall_s * 1e3 / rounds - spans, 0.0) if rounds else zero
        return RunStats(rounds, self.B, accepted, col["draft"] + col["catchup"], col["verify"], col["commit"], host,
                        wall_s, ctx, nodes=nodes, catchup_ms=catchup)

    def last_round(self) -> dict:
        """The last round on the host (one copy; live runs' traces): ``tokens``, ``parents``,
        ``score`` (cumulative draft log-prob), ``valid`` [B, n]; ``accepted`` [B] (local node);
        ``target_next`` [B, n] (the target's argmax at every node); ``marginals`` (log-probs,
        ids [B, P, K] along the drafter's chain) for the marginal modes, else None; ``drafter``
        the round shape's ("mtp", or a block drafter's family, whose rounds add what its
        ``_round_tensors`` names).  Plain rounds: the root alone (:mod:`.round_trace` makes trace
        records of it).  A traced engine's (``trace_topk`` > 0)."""
        if not self.traced:
            raise SimtreeError("last_round reads a traced engine's rounds (built with trace_topk > 0)")
        rec = to_host(self._round_tensors())
        if self.rs.plain:   # a tree of the root alone
            root = rec["tokens"]
            rec.update(parents=np.full_like(root, -1), score=np.zeros(root.shape, np.float32),
                       valid=np.ones(root.shape, bool), accepted=np.zeros(root.shape[0], np.int64))
        marginals = (rec.pop("marginal_lp"), rec.pop("marginal_ids")) if "marginal_lp" in rec else None
        return {**rec, "marginals": marginals, "drafter": self.rs.drafter}

    def _round_tensors(self) -> dict:
        """The device tensors of the last round that :meth:`last_round` reads, by its names
        (``marginal_lp``, ``marginal_ids``: its ``marginals``)."""
        if self.rs.plain:
            return {"tokens": self._plain_root[:, None], "target_next": self._target_next}
        t = self.tree
        out = {"tokens": t.tokens, "parents": t.parents, "score": t.score, "valid": t.valid,
               "accepted": self._accepted, "target_next": self._target_next}
        marg = getattr(self, "_marginals", None) if self.rs.marginal or self._keeps_chain_topk() else None
        if marg is not None:
            out["marginal_lp"], out["marginal_ids"] = marg
        return out

    def outputs(self) -> list[list[int]]:
        """Live runs: each sequence's output tokens (the first from the prefill)."""
        lens = self.out_len.clamp(max=OUT_CAP).tolist()
        buf = self.out_buf.cpu().numpy()
        return [buf[b, :n].tolist() for b, n in enumerate(lens)]
