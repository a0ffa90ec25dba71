"""What a mode's drafter adds to one rank's memory, beside the target (:mod:`.memory`'s check).

    use = drafter_use(PolicySpec.from_dict("block", {"budget": 16, "block_len": 7}))
    extra = drafter_memory(get_model("qwen3.6-27b"), use, batch_size=64, context_len=1536)
    extra.weight_bytes, extra.state_bytes, extra.round_bytes, extra.total_bytes

The MTP / EAGLE drafter (``use.family == "mtp"``, every mode but the block drafters') is the
target shape's own draft layer: :meth:`ModelShape.weight_bytes` and ``cache_bytes`` count it
already, so it adds nothing here; plain decoding (one node, no draft) takes its cache off, which
the engine allocates only for a drafting round shape (``runtime/full/engine.py``).  A block drafter (``block``, ``tfm``, ``dspark``:
``simtree.kernels.layers.drafters``, run by ``runtime/full/block_engine.py``) adds what the
block engine allocates for it (``runtime/full/block_drafters.py`` DrafterRound and the engine's
own buffers), all at the model's dtype unless said:

    weights  fc [h, F h] over the F tapped target layers, two norms, ``layers`` Qwen-style
             attention blocks (no output gate) with the target's width, heads and MLP (V4: 16
             query heads, one 512-wide KV head, an MLP as wide as the active experts), and the
             family's head: dspark's Markov W1, W2 [V, r] and confidence head, tfm's adapter
             (in [a, h], embedding [V, a], cell [a, 2a]); the embedding and LM head are the
             target's (shared, not counted again)
    state    per sequence: each draft layer's KV cache of context + 1 rows (row ``max_len``
             the trash row), the A = block_len + 1 context rows of tapped features [A, F h],
             the round's top-K marginals (ids int64, log-probs float32), confidences and
             verified length, the lengths
    rounds   the target's tapped features of the round's verified nodes [nodes, F h] per
             sequence (kept with the verify until the next one, so through the next draft),
             and the draft's peak after the backbone: the LM head's float32 logits over the
             vocabulary for the block's T = batch x block_len rows, and the same again inside
             the log-softmax's logsumexp (ATen's ``(x - max).exp_()``), with the block's top-K
             marginals (tfm: its top-cand_k candidates); dspark holds the block's logits once
             and, row by row, two [batch, V] float32 rows (its Markov logits added, then
             logsumexp's copy), with the chain's marginals and confidences

and the MTP layer's cache, which the target's ``cache_bytes`` counts, is not allocated by a
block engine (``mtp_state_bytes``, taken off).  Not counted: the RoPE table (under a MB), the
backbone's own temporaries (the tree-attention kernel reads the cache in place; its rows are
batch x (2 block_len + 1) wide).  The target's verify buffers, for every drafter alike, are
:mod:`.verify_memory`'s; the draft's peak and the verify's are not held at once (the check
takes the larger of the two beside what both rounds' stages keep).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from simtree.drafters import DRAFTER_FAMILIES, MARGINAL_TOPK, PUBLIC, TFM
from simtree.errors import SimtreeError, check_int
from simtree.models import DTYPE_BYTES, ModelShape

__all__ = ["MTP", "DrafterUse", "DrafterMemory", "drafter_use", "drafter_memory", "drafter_layer_dims"]

MTP = "mtp"     # the target's own MTP / EAGLE draft layer
_SIZES = ("layers", "target_layers", "markov_rank", "cand_k", "adapter_dim")
_F32, _I64 = 4, 8


@dataclass(frozen=True)
class DrafterUse:
    """The drafter a mode runs, as the memory check prices it: ``family`` (``mtp`` or one of
    ``simtree.drafters.DRAFTER_FAMILIES``), ``block_len`` positions a forward drafts, ``nodes``
    verified per sequence (the round's bucket), ``topk`` marginals kept per position; ``sizes``:
    (name, value) pairs overriding the public drafter sizes (layers, target_layers, markov_rank,
    cand_k, adapter_dim), as the block engine's ``sizes`` do (tests: tiny drafters); ``path_rows``:
    the rows a round's accepted path can commit (its deepest node + 1), what the caches hold past
    the context.  ``nodes`` and ``path_rows`` are the round's for every mode (the target's verify
    buffers, :mod:`.verify_memory`); their defaults, a round of the public block (8 nodes, 8 rows),
    stand for a mode not named."""

    family: str = MTP
    block_len: int = PUBLIC["block_len"]
    nodes: int = PUBLIC["block_len"] + 1
    topk: int = MARGINAL_TOPK
    sizes: tuple = ()
    path_rows: int = PUBLIC["block_len"] + 1

    def __post_init__(self) -> None:
        if self.family != MTP and self.family not in DRAFTER_FAMILIES:
            raise SimtreeError(f"unknown drafter {self.family!r} (known: {MTP}, {', '.join(DRAFTER_FAMILIES)})")
        for what in ("block_len", "nodes", "topk", "path_rows"):
            check_int(getattr(self, what), f"drafter {what}", 1)
        unknown = sorted(set(dict(self.sizes)) - set(_SIZES))
        if unknown:
            raise SimtreeError(f"drafter {self.family}: unknown size(s) {', '.join(unknown)} (known: {', '.join(_SIZES)})")

    @property
    def block_drafter(self) -> bool:
        return self.family != MTP

    @property
    def plain(self) -> bool:
        """Plain decoding: one node a round, no draft (its engine allocates no MTP layer state)."""
        return self.family == MTP and self.nodes == 1 and self.path_rows == 1

    def size(self, name: str) -> int:
        public = {**PUBLIC, **TFM}
        return int(dict(self.sizes).get(name, public[name]))


def drafter_use(spec=None, sizes: dict | None = None) -> DrafterUse:
    """The drafter a policy runs: ``spec`` a PolicySpec (its mode, ``max_nodes`` and the depth it
    drafts; a block drafter's ``block_len``) or a drafter family's name (its public block, a chain
    of it verified); None, plain decoding and every MTP-drafted mode: the MTP drafter.  ``sizes``:
    :class:`DrafterUse`'s."""
    extra = tuple(sorted((sizes or {}).items()))
    if spec is None:
        return DrafterUse(sizes=extra)
    if isinstance(spec, str):
        return DrafterUse(spec, sizes=extra)
    rows = int(spec.draft_shape()[0]) + 1        # the deepest node a round drafts, and its root
    if spec.mode not in DRAFTER_FAMILIES:
        return DrafterUse(nodes=int(spec.max_nodes), sizes=extra, path_rows=rows)
    return DrafterUse(spec.mode, int(spec.block_len), int(spec.max_nodes), sizes=extra, path_rows=rows)


@dataclass(frozen=True)
class DrafterMemory:
    """Bytes a drafter adds to one rank of ``batch_size`` sequences (module docstring); all 0
    for the MTP drafter, which the target's shape counts."""

    use: DrafterUse
    weight_bytes: int = 0
    state_bytes: int = 0
    feature_bytes: int = 0       # the verified nodes' tapped features, kept from the verify through the draft
    draft_peak_bytes: int = 0    # the draft's peak after the backbone (not at once with the verify's)
    mtp_state_bytes: int = 0     # the MTP layer's cache the target's count holds, not allocated beside it

    @property
    def round_bytes(self) -> int:
        return self.feature_bytes + self.draft_peak_bytes

    @property
    def held_bytes(self) -> int:
        """What the drafter holds through the whole round (all but the draft's peak)."""
        return self.weight_bytes + self.state_bytes + self.feature_bytes - self.mtp_state_bytes

    @property
    def total_bytes(self) -> int:
        return self.held_bytes + self.draft_peak_bytes


def drafter_layer_dims(shape: ModelShape) -> dict[str, int]:
    """A block drafter's layer shape for target ``shape`` (as ``kernels.layers.drafters.drafter_dims``
    builds it): h, vocab, MLP width I, query heads Hq, KV heads Hkv, head dim D."""
    if shape.family == "v4":      # ASSUMPTION (kernels/layers/drafters/config.py): dense layers as wide
        m = shape.mlp             # as V4's active experts, 16 query heads over one latent KV head
        width = int(m["experts_per_token"]) * int(m["expert_intermediate"]) + \
            int(m.get("n_shared", 0)) * int(m.get("shared_intermediate", 0))
        return dict(h=shape.hidden, V=shape.vocab, I=width, Hq=16, Hkv=1, D=int(shape.v4["head_dim"]))
    a = shape.attn
    return dict(h=shape.hidden, V=shape.vocab, I=int(shape.mlp["intermediate"]), Hq=int(a["q_heads"]),
                Hkv=int(a["kv_heads"]), D=int(a["head_dim"]))


def _weights(use: DrafterUse, d: dict, F: int) -> int:
    """Elements of the drafter's own weights (the target's embedding and LM head shared)."""
    h, V, I, Hq, Hkv, D = (d[k] for k in ("h", "V", "I", "Hq", "Hkv", "D"))
    layer = 2 * h + (Hq * D + 2 * Hkv * D) * h + 2 * D + h * Hq * D + 3 * h * I
    n = h * F * h + 2 * h + use.size("layers") * layer
    if use.family == "dspark":
        r = use.size("markov_rank")
        n += 2 * V * r + (h + r) + 1
    elif use.family == "tfm":
        a = use.size("adapter_dim")
        n += a * h + V * a + 2 * a * a
    return n


def _draft_peak(use: DrafterUse, d: dict, batch: int, dt: int) -> int:
    """The draft's peak bytes after the backbone (module docstring): float32 logits of the
    block's rows and logsumexp's copy of them, with the family's own buffers."""
    B, L, V, K = batch, use.block_len, d["V"], use.topk
    T = B * L
    if use.family == "dspark":
        # the block's logits held while each row adds its Markov logits: at most two [B, V] rows at
        # once (W2's output at dt and its float32 copy; that copy and the sum; the sum and
        # logsumexp's copy), with the row's Markov embedding [B, r] and the chain's confidences
        row = B * V * max(dt + (_F32 if dt != _F32 else 0), 2 * _F32)
        return T * V * _F32 + row + T * K * (_F32 + _I64) + T * _F32 + B * use.size("markov_rank") * dt
    # block: its top-K marginals (log-probs, ids); tfm: its candidates' top-cand_k instead
    top = use.size("cand_k") if use.family == "tfm" else K
    return 2 * T * V * _F32 + T * top * (_F32 + _I64)


def drafter_memory(shape: ModelShape, use, batch_size: int, context_len: int) -> DrafterMemory:
    """What ``use``'s drafter (a :class:`DrafterUse`, or what :func:`drafter_use` takes) adds to a rank of shape ``shape`` (one rank's shape, as
    :func:`simtree.deploy.memory.rank_memory` prices it) holding ``batch_size`` sequences at
    ``context_len`` tokens (module docstring)."""
    use = use if isinstance(use, DrafterUse) else drafter_use(use)
    if not use.block_drafter:      # plain decoding's engine holds no MTP layer state: its cache comes off
        return DrafterMemory(use, mtp_state_bytes=_mtp_cache(shape, batch_size, context_len) if use.plain else 0)
    d, dt = drafter_layer_dims(shape), DTYPE_BYTES.get(shape.dtype, 2)
    B, l, L, K = int(batch_size), int(context_len), use.block_len, use.topk
    F = min(use.size("target_layers"), shape.num_layers)      # the tapped layers (block_engine.feature_layers)
    h, Hkv, D = d["h"], d["Hkv"], d["D"]
    per_seq = (use.size("layers") * (l + 1) * 2 * Hkv * D * dt      # the draft layers' caches
               + (L + 1) * F * h * dt                                 # the context rows' tapped features
               + L * K * (_I64 + _F32) + L * _F32 + 3 * _I64)         # marginals, confidences; lengths, n_new, verified
    return DrafterMemory(use, _weights(use, d, F) * dt, B * per_seq, B * use.nodes * F * h * dt,
                         _draft_peak(use, d, B, dt), _mtp_cache(shape, B, l))


def _mtp_cache(shape: ModelShape, batch_size: int, context_len: int) -> int:
    """The MTP layer's cache the target's ``cache_bytes`` counts (0 for a shape without one)."""
    if not (shape.draft or {}).get("attention"):
        return 0
    without = replace(shape, draft={k: v for k, v in shape.draft.items() if k != "attention"})
    return shape.cache_bytes(int(batch_size), int(context_len)) - without.cache_bytes(int(batch_size), int(context_len))
