"""Draft proposals from the small draft model: EAGLE top-k callbacks and greedy marginals.

The draft model is a :class:`HybridLM` with its own :class:`Cache` holding exactly the
tokens the target has committed (everything before the round's root).  Proposals are made by
``verify`` on trees/chains built so far (the draft cache is never touched while drafting);
after acceptance ``catch_up`` folds the accepted path in with one chain verify + commit.

Marginals for best-first / cost-aware / batch_alloc (document of the approximation): the
drafter greedily extends the top-1 chain for P steps; step p's top-K distribution (given
the top-1 prefix) is used as position p's marginal, as a block drafter would emit it.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from simtree.trees.builders import eagle_tree
from simtree.runtime.model import HybridLM
from simtree.trees.tree import DraftTree, TreeBatch

__all__ = ["Drafter"]


def _topk_log_probs(logits: torch.Tensor, topk: int):
    """logits [f, V] -> top-k token ids [f, k] and their log-probs [f, k] (float64), on the host."""
    val, idx = torch.log_softmax(logits.double(), -1).topk(topk, -1)
    return idx.cpu().numpy(), val.cpu().numpy()


class Drafter:
    def __init__(self, model: HybridLM, batch_size: int, max_len: int):
        self.model = model
        self.cache = model.new_cache(batch_size, max_len)

    def prefill(self, prompts: list[list[int]]) -> None:
        self.model.prefill(self.cache, prompts)

    def catch_up(self, paths: list[list[int]]) -> None:
        """Commit each sequence's accepted root path (root token + accepted draft tokens)."""
        batch = TreeBatch([DraftTree.chain(len(p), p) for p in paths])
        _, pend = self.model.verify(batch, self.cache)
        self.model.commit(self.cache, batch, pend, [len(p) - 1 for p in paths])

    def propose_fn(self, b: int, topk: int):
        """EAGLE callback for sequence b: (parents, tokens, frontier) -> top-k tokens [f, k],
        log-probs [f, k] of each frontier node's next token given its path."""
        cache = self.cache.narrow(b)

        def propose(parents, tokens, frontier):
            logits, _ = self.model.verify(TreeBatch([DraftTree(parents, tokens)]), cache)
            return _topk_log_probs(logits[torch.as_tensor(frontier)], topk)

        return propose

    def eagle_trees(self, roots: list[int], num_steps: int, topk: int, budget: int) -> list[DraftTree]:
        """One ``simtree.trees.builders.eagle_tree`` per sequence, their proposals batched: every
        builder runs in its own thread and blocks in its propose callback until one draft
        ``verify`` has scored all B partial trees (each EAGLE step asks exactly once per tree,
        so the builders move in lockstep)."""
        B = len(roots)
        requests, results, trees, errors = [None] * B, [None] * B, [None] * B, []
        barrier = threading.Barrier(B + 1)

        def worker(b):
            def propose(parents, tokens, frontier):
                requests[b] = (parents, tokens, frontier)
                barrier.wait()  # request posted
                barrier.wait()  # result ready
                return results[b]
            try:
                trees[b] = eagle_tree(propose, num_steps, topk, budget, roots[b])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(b,), daemon=True) for b in range(B)]
        for t in threads:
            t.start()
        try:
            for _ in range(num_steps):
                barrier.wait()
                batch = TreeBatch([DraftTree(p, t) for p, t, _ in requests])
                logits, _ = self.model.verify(batch, self.cache)
                # every sequence's frontier rows at once: one top-k and one host copy per step
                rows = np.concatenate([f + batch.cu_nodes[b] for b, (_, _, f) in enumerate(requests)])
                idx, val = _topk_log_probs(logits[torch.as_tensor(rows)], topk)
                ends = np.cumsum([len(f) for _, _, f in requests])[:-1]
                results[:] = zip(np.split(idx, ends), np.split(val, ends))
                barrier.wait()
        except threading.BrokenBarrierError:
            pass  # a builder failed and aborted the barrier: its error is raised below
        except BaseException:
            barrier.abort()  # release the builders before re-raising
            raise
        finally:
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return trees

    def greedy_marginals(self, roots: list[int], positions: int, topk: int):
        """Top-1 chain of ``positions`` steps for every sequence at once.

        Returns tokens [B, P, K] int64 and probs [B, P, K] float64 (sorted desc per position);
        [:, :, 0] is the greedy chain itself.
        """
        chains = [[int(r)] for r in roots]
        toks = np.zeros((len(roots), positions, topk), np.int64)
        probs = np.zeros((len(roots), positions, topk))
        for p in range(positions):
            batch = TreeBatch([DraftTree.chain(len(c), c) for c in chains])
            logits, _ = self.model.verify(batch, self.cache)
            last = torch.as_tensor(batch.cu_nodes[1:] - 1)
            pr = torch.softmax(logits[last].double(), -1)
            val, idx = pr.topk(topk, -1)
            toks[:, p], probs[:, p] = idx.cpu().numpy(), val.cpu().numpy()
            for c, t in zip(chains, toks[:, p, 0].tolist()):
                c.append(t)
        return toks, probs
