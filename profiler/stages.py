"""Stage adapters: (stage, variant) -> a builder of one timed step at a grid point
(:class:`~simtree.costs.steps.Point`, :class:`~simtree.costs.steps.Workload`).

    wl = build_workload(ctx, point)      # raises Unavailable if the variant cannot run here
    step, instance_bytes = wl.make()     # one copy on its own random inputs

Stages (profile-table names): ``gdn_tree_verify``, ``attn_tree_verify``, ``v4_swa_verify``,
``v4_csa_verify``, ``v4_hca_verify`` (attention cores of one layer); ``gdn_tree_commit`` (the
accepted-path state commit of one GDN layer, once per round); ``gdn_round_meta`` (the tree
metadata all GDN layers of a round share, built once per round); ``<kind>_proj_step``
(the rest of that layer's attention block: projections, norms, conv, gates); ``mlp_step``
(MLP / MoE + its norm); ``lm_head_step`` (final norm, vocab GEMM, greedy pick); ``draft_step``
(``num_steps`` sequential steps of a one-layer draft head at b * topk tokens);
``draft_block``, ``draft_tfm``, ``draft_dspark`` (one round of a block drafter family over its
own axes, variant ``round``: the runtime's round code, profiler/drafter_pieces.py); ``stack_verify_step`` (a measured stack of real layers, variant ``stack<L>``, to validate
the composition). Variants the profiler does not build itself come from the caller as
``builders`` ({variant: :class:`~simtree.costs.steps.StepBuilder`}): `simtree profile` hands
in the runtime's ``runtime_tiny`` (``model_verify_step`` / ``draft_step`` of its shipped
models). A missing kernel makes its variant raise :class:`Unavailable`.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import numpy as np
import torch

from simtree.costs.steps import Point, StepBuilder, Unavailable, Workload
from simtree.errors import SimtreeError
from simtree.models import COMMIT_STAGE, DECODE_STAGE, MODEL_ROUND_STAGE, ROUND_STAGE, VERIFY_STAGE

from . import pieces
from .drafter_pieces import DRAFTER_STAGES, ROUND_VARIANT, check_drafter, drafter_workload
from .layer_pieces import LAYERS_VARIANT, check_layers, layers_workload
from .pieces import Ctx, nbytes, tree_batch

__all__ = ["Point", "Workload", "Unavailable", "build_workload", "default_variants",
           "check_variant", "STAGE_KIND", "VARIANT_PREFERENCE", "NO_BUILDERS"]

NO_BUILDERS: Mapping[str, StepBuilder] = MappingProxyType({})

STAGE_KIND = {v: k for k, v in VERIFY_STAGE.items()}
# The variant the composition / stack uses per stage, best first (attention cores; the round
# metadata's CUDA-graph replay over its eager issue).
VARIANT_PREFERENCE = ("layers", "triton_tree", "flashmla_tree", "torch_sdpa", "torch_gather", "torch_ref", "fla_chunk",
                      "torch_graph", "triton_recurrent")


def is_one_variant_stage(stage: str) -> bool:
    """Stages the profiler times with plain torch ops only (variant "torch"; a caller's
    builders may add variants, e.g. the runtime's draft step)."""
    return stage in ("mlp_step", "hash_mlp_step", "lm_head_step", "draft_step") or stage.endswith("_proj_step")


# stages the profiler has no variant of its own for: only a caller's builders time them
BUILDER_ONLY_STAGES = ("model_verify_step",)
# stages only the full runtime's layer code (variant layers) has
LAYERS_ONLY_STAGES = (MODEL_ROUND_STAGE, "attn_kv_commit", "v4_swa_commit", "v4_csa_commit", "v4_hca_commit")


def _no_builder(p: Point) -> Unavailable:
    return Unavailable(f"no step builder for {p.stage} variant {p.variant!r} here: a variant the profiler does "
                       "not build itself comes from the caller (`simtree profile` adds the runtime's runtime_tiny)")


def default_variants(stage: str, device: str) -> tuple[str, ...]:
    """The variants a sweep times for ``stage`` when its YAML does not list them."""
    cuda = str(device).startswith("cuda")
    if stage in DRAFTER_STAGES:
        return (ROUND_VARIANT,)
    if stage in LAYERS_ONLY_STAGES:
        return (LAYERS_VARIANT,)
    if stage == "gdn_tree_verify":
        return ("triton_tree", "fla_chunk") if cuda else ("torch_ref",)
    if stage == "gdn_tree_commit":
        return ("triton_tree",) if cuda else ("torch_ref",)
    if stage == "gdn_round_meta":
        return ("torch_graph", "torch", "host") if cuda else ("torch",)
    if stage == "gdn_decode_step":
        return ("triton_recurrent",) if cuda else ("torch_ref",)
    if stage == "attn_tree_verify":
        return ("torch_sdpa",)
    if stage in ("v4_swa_verify", "v4_csa_verify", "v4_hca_verify"):
        return ("torch_gather",)
    if stage.startswith("stack"):
        return ("stack8",)
    return ("torch",)


# ---- GDN ------------------------------------------------------------------------------------
def _gdn_round_meta_workload(ctx: Ctx, p: Point) -> Workload:
    """The GDN kernels' per-round tree metadata (``verify_round_meta``: ancestor bits, depth,
    the verify launch's node order and sub-chunk pairs, for trees in the runtime's order),
    built once per round and read by every GDN layer: tens of small torch ops.  ``torch``:
    issued eagerly from Python and timed so (a runtime that launches them one by one pays the
    host's issue time);
    ``torch_graph``: the same ops replayed from a CUDA graph (their GPU time: what a runtime
    that captures the round's metadata build, as serving engines capture their steps, pays);
    ``host``: built from the trees on the host (``verify_round_meta_host``: numpy, one copy to
    the device), what simtree's runtime does, timed eagerly with the copy."""
    from simtree.kernels import gdn as kg
    if p.variant not in ("torch", "torch_graph", "host"):
        raise Unavailable(f"unknown gdn_round_meta variant {p.variant!r}")
    g = ctx.model.gdn

    def make():
        tb = _gdn_trees(p.batch_size, p.nodes_per_seq, p.tree_shape, ctx.seed)
        if p.variant == "host":
            parents, cu = tb.parents, tb.cu_nodes
            return (lambda: kg.verify_round_meta_host(parents, cu, tb.max_nodes, g["value_heads"],
                                                      g["value_dim"], ctx.device,
                                                      tb.known_depth_first)), \
                parents.nbytes + cu.nbytes
        meta = {k: v.to(ctx.device) for k, v in tb.to_torch().items()}
        return (lambda: kg.verify_round_meta(meta["parents"], meta["cu_nodes"], tb.max_nodes,
                                             g["value_heads"], g["value_dim"], tb.known_depth_first)), \
            nbytes(*meta.values())
    return Workload(make, eager=p.variant != "torch_graph")


def _gdn_commit_workload(ctx: Ctx, p: Point) -> Workload:
    """The accepted-path commit of one GDN layer after a verify (state rewritten in place),
    each tree's deepest node accepted (``TreeBatch.deepest_nodes``: the longest path to fold,
    the commit's most expensive case)."""
    from simtree.kernels import gdn as kg
    from simtree.kernels.gdn import _launch as rule, _launched as kgl
    if p.variant not in ("triton_tree", "torch_ref"):
        raise Unavailable(f"unknown gdn_tree_commit variant {p.variant!r}")
    backend = "triton" if p.variant == "triton_tree" else "torch"
    if backend == "triton" and ctx.device.type != "cuda":
        raise Unavailable("triton_tree times on CUDA only (the interpreter is for tests)")

    def make():
        tb, meta, args = _gdn_inputs(ctx, p.batch_size, p.nodes_per_seq, p.tree_shape)
        tm = kg.tree_meta(meta["parents"], meta["cu_nodes"], max_nodes=tb.max_nodes,
                          validate=False, depth_first=tb.known_depth_first)
        _, cache = kgl.launched_verify(*args, meta["parents"], meta["cu_nodes"],
                                      launch=rule.VerifyLaunch(backend=backend), meta=tm, check=False)
        accepted = torch.as_tensor(tb.deepest_nodes, device=ctx.device)
        state, k = args[5], args[1]
        launch = rule.CommitLaunch(backend=backend)
        return (lambda: kgl.launched_commit(state, k, cache, meta["parents"], meta["cu_nodes"],
                                           accepted, launch=launch, check=False)), \
            nbytes(state, k, cache.u, cache.G)
    return Workload(make)


def _gdn_trees(b: int, n: int, shape: str, seed: int):
    """The GDN stages' trees, in the order the runtime hands them to the GDN kernels: stored
    depth-first where that pays (``kernels.gdn.depth_first_pays``), else as built."""
    from simtree.kernels.gdn import depth_first_pays
    tb = tree_batch(b, n, shape, seed)
    return tb.depth_first() if depth_first_pays(n, b) else tb


def _gdn_decode_workload(ctx: Ctx, p: Point) -> Workload:
    """One GDN layer's plain decoding step: one token per sequence, the state read, updated
    and written once (what a serving engine runs when it drafts nothing; the tree path would
    verify and then commit, reading the state twice).  ``triton_recurrent``: the per-node
    recurrent kernel on one-node trees, the new state written to a buffer of its own;
    ``torch_ref``: the runtime's torch step (CPU), state updated in place."""
    from simtree.kernels.gdn import _launched as kgl
    if p.nodes_per_seq != 1:
        raise Unavailable(f"gdn_decode_step is one token per sequence, not {p.nodes_per_seq}")
    if p.variant not in ("triton_recurrent", "torch_ref"):
        raise Unavailable(f"unknown gdn_decode_step variant {p.variant!r}")
    if p.variant == "triton_recurrent" and ctx.device.type != "cuda":
        raise Unavailable("triton_recurrent times on CUDA only (the interpreter is for tests)")

    def make():
        tb, meta, (q, k, v, gdec, beta, state) = _gdn_inputs(ctx, p.batch_size, 1, "linear")
        if p.variant == "torch_ref":
            from simtree.kernels.gdn.ops import recurrent_step
            return (lambda: recurrent_step(q, k, v, gdec, beta, state)), nbytes(q, k, v, state)
        new = torch.empty_like(state)
        return (lambda: kgl.launched_recurrent(q, k, v, gdec, beta, state, meta["parents"],
                                                     meta["cu_nodes"], node_states=new,
                                                     check=False)), nbytes(q, k, v, state, new)
    return Workload(make)


def _gdn_inputs(ctx: Ctx, b: int, n: int, shape: str, salt: int = 0):
    H, HV, K, V = ctx.model.gdn_dims().values()
    tb = _gdn_trees(b, n, shape, ctx.seed + salt)
    meta = {k: v.to(ctx.device) for k, v in tb.to_torch().items()}
    N = tb.total_nodes
    q, k = ctx.randn(N, H, K, salt=21 + salt), ctx.randn(N, H, K, salt=22 + salt)
    v = ctx.randn(N, HV, V, salt=23 + salt)
    gdec = -torch.nn.functional.softplus(ctx.randn(N, HV, dtype=torch.float32, salt=24 + salt)) * 0.1
    beta = torch.sigmoid(ctx.randn(N, HV, dtype=torch.float32, salt=25 + salt))
    state = ctx.randn(b, HV, K, V, dtype=torch.float32, scale=0.1, salt=26 + salt)
    return tb, meta, (q, k, v, gdec, beta, state)


def _gdn_workload(ctx: Ctx, p: Point) -> Workload:
    try:
        from simtree.kernels import gdn as kg
        from simtree.kernels.gdn import _launch as rule, _launched as kgl
    except Exception as exc:  # kernel package missing or broken
        raise Unavailable(f"simtree.kernels.gdn not importable ({type(exc).__name__}: {exc})") from None
    b, n = p.batch_size, p.nodes_per_seq
    if p.variant in ("triton_tree", "torch_ref"):
        backend = "triton" if p.variant == "triton_tree" else "torch"
        if backend == "triton" and ctx.device.type != "cuda":
            raise Unavailable("triton_tree times on CUDA only (the interpreter is for tests)")

        def make():
            tb, meta, args = _gdn_inputs(ctx, b, n, p.tree_shape)
            tm = kg.tree_meta(meta["parents"], meta["cu_nodes"], max_nodes=tb.max_nodes,
                              validate=False, depth_first=tb.known_depth_first)
            launch = rule.VerifyLaunch(backend=backend)
            return (lambda: kgl.launched_verify(*args, meta["parents"], meta["cu_nodes"], launch=launch,
                                               meta=tm, check=False)), nbytes(*args)
        return Workload(make)
    if p.variant == "recurrent_baseline":
        if ctx.device.type != "cuda":
            raise Unavailable("recurrent_baseline is a Triton kernel: CUDA only")

        def make():
            tb, meta, args = _gdn_inputs(ctx, b, n, p.tree_shape)
            g = ctx.model.gdn
            states = torch.empty((tb.total_nodes, g["value_heads"], g["key_dim"], g["value_dim"]),
                                 dtype=torch.float32, device=ctx.device)
            return (lambda: kgl.launched_recurrent(*args, meta["parents"], meta["cu_nodes"],
                                                         node_states=states, check=False)), nbytes(*args, states)
        return Workload(make)
    if p.variant in ("fla_chunk", "fla_recurrent"):
        if p.tree_shape not in ("linear", "chain"):
            raise Unavailable(f"{p.variant} runs chains only (tree_shape linear), not {p.tree_shape}")
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        except Exception as exc:
            raise Unavailable(f"fla not importable ({type(exc).__name__}: {exc})") from None
        fn = chunk_gated_delta_rule if p.variant == "fla_chunk" else fused_recurrent_gated_delta_rule

        def make():
            _, _, (q, k, v, gdec, beta, state) = _gdn_inputs(ctx, b, n, "linear")
            HV, H = v.shape[1], q.shape[1]
            # fla takes [B, T, HV, K]; key heads are repeated to the value heads (GVA).
            qf = q.view(b, n, H, -1).repeat_interleave(HV // H, dim=2).contiguous()
            kf = k.view(b, n, H, -1).repeat_interleave(HV // H, dim=2).contiguous()
            vf, gf, bf = v.view(b, n, HV, -1), gdec.view(b, n, HV), beta.view(b, n, HV)
            return (lambda: fn(qf, kf, vf, g=gf, beta=bf, initial_state=state, output_final_state=False,
                               use_qk_l2norm_in_kernel=True)), nbytes(qf, kf, vf, gf, bf, state)
        return Workload(make)
    raise Unavailable(f"unknown gdn variant {p.variant!r}")


# ---- V4 -------------------------------------------------------------------------------------
def _v4_workload(ctx: Ctx, p: Point) -> Workload:
    kind = STAGE_KIND[p.stage]
    if p.variant == "torch_gather":
        return Workload(lambda: pieces.v4_core_piece(ctx, kind, p.batch_size, p.nodes_per_seq,
                                                     p.context_len, p.tree_shape))
    if p.variant not in ("triton_tree", "torch_tree"):
        raise Unavailable(f"unknown V4 variant {p.variant!r}")
    if p.variant == "triton_tree" and ctx.device.type != "cuda":
        raise Unavailable("triton_tree times on CUDA only (the interpreter is for tests)")
    try:
        from simtree.kernels.v4.config import V4AttnConfig
        from simtree.kernels.v4.steps import make_verify_step
    except Exception as exc:  # kernel package missing or broken
        raise Unavailable(f"simtree.kernels.v4 not importable ({type(exc).__name__}: {exc})") from None
    v = ctx.model.v4
    cfg = V4AttnConfig(num_heads=v["q_heads"], head_dim=v["head_dim"], rope_dim=v["rope_dim"],
                       window=v["window"], csa_ratio=v["csa_ratio"], hca_ratio=v["hca_ratio"],
                       topk=v["index_topk"], indexer_heads=v["index_heads"],
                       indexer_dim=v["index_head_dim"], hidden=ctx.model.hidden)

    def make():
        step = make_verify_step(cfg, kind, p.batch_size, p.nodes_per_seq, p.context_len,
                                tree_shape=p.tree_shape, device=ctx.device, dtype=ctx.dtype,
                                seed=ctx.seed, attention="triton" if p.variant == "triton_tree" else "torch")
        return step.verify, 0
    return Workload(make)


# ---- the rest ------------------------------------------------------------------------------
def _draft_workload(ctx: Ctx, p: Point) -> Workload:
    """num_steps sequential draft-head steps, each at b * topk tokens: fuse projection,
    attention block of the draft's kind over context l, MLP, LM head + top-k."""
    b, k, s, l = p.batch_size, max(p.topk, 1), max(p.num_steps, 1), p.context_len
    kind = ctx.model.draft.get("attention", "attn")
    h = ctx.model.hidden

    def make():
        T = b * k
        parts = [pieces.proj_piece(ctx, kind, T), pieces.mlp_piece(ctx, T), pieces.lm_head_piece(ctx, T, topk=k)]
        if kind == "attn":
            parts.append(pieces.attn_core_piece(ctx, b, k, l, "eagle"))
        else:
            parts.append(pieces.v4_core_piece(ctx, "swa", b, k, l, "eagle"))
        if ctx.model.draft.get("fuse_proj"):
            x2, w = ctx.randn(T, 2 * h, salt=31), ctx.weight("draft_fuse", 2 * h, h)
            parts.append(((lambda: x2 @ w), nbytes(x2)))
        fns = [f for f, _ in parts]

        def step():
            for _ in range(s):
                for f in fns:
                    f()
        return step, sum(nb for _, nb in parts)
    return Workload(make)


def stack_core_variant(stage: str, device: str) -> str:
    """The attention core a measured stack uses and its validation pins: the kernel the shipped
    composition prefers (VARIANT_PREFERENCE), so the stack validates what is shipped."""
    if str(device).startswith("cuda") and stage in ("v4_swa_verify", "v4_csa_verify", "v4_hca_verify"):
        return "triton_tree"
    return default_variants(stage, device)[0]


def _layer_parts(ctx: Ctx, kind: str, p: Point, variant: str):
    """proj + attention core + MLP of one layer of ``kind`` at the point's shape."""
    core = build_workload(ctx, Point(VERIFY_STAGE[kind], variant, p.model, p.batch_size,
                                     p.nodes_per_seq, p.context_len, p.tree_shape))
    return [pieces.proj_piece(ctx, kind, p.tokens), core.make(), pieces.mlp_piece(ctx, p.tokens)]


def _stack_workload(ctx: Ctx, p: Point) -> Workload:
    try:
        L = int(p.variant.removeprefix("stack"))
    except ValueError:
        raise Unavailable(f"stack variant must be stack<layers>, got {p.variant!r}") from None
    kinds = ctx.model.stack(L)
    core_variants = ctx.notes.get("core_variant", {})

    def make():
        parts = []
        for kind in kinds:
            variant = core_variants.get(VERIFY_STAGE[kind]) or stack_core_variant(VERIFY_STAGE[kind], str(ctx.device))
            parts += _layer_parts(ctx, kind, p, variant)
        parts.append(pieces.lm_head_piece(ctx, p.tokens))
        fns = [f for f, _ in parts]

        def step():
            for f in fns:
                f()
        return step, sum(nb for _, nb in parts)
    return Workload(make)


def build_workload(ctx: Ctx, p: Point, builders: Mapping[str, StepBuilder] = NO_BUILDERS) -> Workload:
    """The workload for one grid point; raises Unavailable / SimtreeError on bad requests.
    ``builders``: {variant: StepBuilder} for variants the profiler does not build itself."""
    if p.batch_size < 1 or p.nodes_per_seq < 1:
        raise SimtreeError(f"grid point needs batch_size and nodes_per_seq >= 1, got {p}")
    if p.variant in builders:
        return builders[p.variant].workload(ctx, p)
    if p.stage in DRAFTER_STAGES:
        return drafter_workload(ctx, p)
    if p.variant == LAYERS_VARIANT:
        return layers_workload(ctx, p)
    if p.stage in LAYERS_ONLY_STAGES:
        raise Unavailable(f"{p.stage} is timed by variant {LAYERS_VARIANT!r} only, not {p.variant!r}")
    if p.stage in BUILDER_ONLY_STAGES:
        raise _no_builder(p)
    if is_one_variant_stage(p.stage) and p.variant != "torch":
        if p.stage == "draft_step":   # the runtime's draft step is a builder's
            raise _no_builder(p)
        raise Unavailable(f"{p.stage} has one implementation, 'torch'; got variant {p.variant!r}")
    kinds = ctx.model.kinds()
    if p.stage in STAGE_KIND:
        kind = STAGE_KIND[p.stage]
        if kind not in kinds:
            raise Unavailable(f"model {ctx.model.name} has no {kind} layers")
        if kind == "gdn":
            return _gdn_workload(ctx, p)
        if kind == "attn":
            if p.variant != "torch_sdpa":
                raise Unavailable(f"unknown attention variant {p.variant!r}")
            return Workload(lambda: pieces.attn_core_piece(ctx, p.batch_size, p.nodes_per_seq,
                                                           p.context_len, p.tree_shape))
        return _v4_workload(ctx, p)
    if p.stage.endswith("_proj_step"):
        kind = p.stage.removesuffix("_proj_step")
        if kind not in kinds:
            raise Unavailable(f"model {ctx.model.name} has no {kind} layers")
        return Workload(lambda: pieces.proj_piece(ctx, kind, p.tokens))
    if p.stage == "mlp_step":
        return Workload(lambda: pieces.mlp_piece(ctx, p.tokens))
    if p.stage == "lm_head_step":
        return Workload(lambda: pieces.lm_head_piece(ctx, p.tokens))
    if p.stage == "draft_step":
        return _draft_workload(ctx, p)
    if p.stage == "stack_verify_step":
        return _stack_workload(ctx, p)
    for per_kind, builders in ((COMMIT_STAGE, {"gdn": _gdn_commit_workload}),
                               (ROUND_STAGE, {"gdn": _gdn_round_meta_workload}),
                               (DECODE_STAGE, {"gdn": _gdn_decode_workload})):
        kind = next((k for k, stage in per_kind.items() if stage == p.stage), None)
        if kind is not None:
            if kind not in kinds:
                raise Unavailable(f"model {ctx.model.name} has no {kind} layers")
            if kind not in builders:
                raise Unavailable(f"{p.stage} is timed by variant {LAYERS_VARIANT!r} only, not {p.variant!r}")
            return builders[kind](ctx, p)
    raise SimtreeError(f"unknown stage {p.stage!r}")


# ---- correctness checks (run once per stage/variant before timing) ---------------------------
def check_variant(ctx: Ctx, stage: str, variant: str, builders: Mapping[str, StepBuilder] = NO_BUILDERS) -> str:
    """Compare a variant with a reference at a small shape on ctx.device. Returns a one-line
    verdict ("ok ..." or "no reference"); raises AssertionError on a mismatch."""
    if variant in builders:
        return builders[variant].check(ctx, stage)
    if stage in DRAFTER_STAGES:
        return check_drafter(ctx, stage)
    if variant == LAYERS_VARIANT:
        return check_layers(ctx, stage)
    dev = ctx.device
    if stage == "attn_tree_verify":
        small = Ctx(ctx.model, dev, ctx.dtype, ctx.seed)
        a = ctx.model.attn
        b, n, l = 2, 6, 40
        tb = tree_batch(b, n, "eagle", 1)
        D, Hq, Hkv = a["head_dim"], a["q_heads"], a["kv_heads"]
        q = small.randn(b, Hq, n, D, salt=1)
        kc, vc, kt, vt = (small.randn(b, Hkv, m, D, salt=s) for m, s in ((l, 2), (l, 3), (n, 4), (n, 5)))
        mask = torch.as_tensor(np.stack([t.ancestor_mask for t in tb.trees]), device=dev)
        bias = torch.zeros(b, 1, n, n, device=dev).masked_fill_(~mask.unsqueeze(1), float("-inf"))
        out = pieces.tree_attention(q, kc, vc, kt, vt, bias, D ** -0.5).float()
        G = Hq // Hkv
        K = torch.cat([kc, kt], 2).float().repeat_interleave(G, 1)
        V = torch.cat([vc, vt], 2).float().repeat_interleave(G, 1)
        full = torch.cat([torch.ones(b, 1, n, l, dtype=torch.bool, device=dev), mask.unsqueeze(1)], -1)
        s = (q.float() @ K.transpose(-1, -2)) * D ** -0.5
        ref = torch.softmax(s.masked_fill(~full, float("-inf")), -1) @ V
        err = float((out - ref).abs().max() / ref.abs().max())
        assert err < 3e-2, f"tree attention differs from the dense masked reference: rel err {err:.2e}"
        return f"ok (rel err {err:.1e} vs dense masked attention)"
    if stage == "gdn_tree_verify" and variant in ("triton_tree", "torch_ref", "recurrent_baseline"):
        from simtree.kernels import gdn as kg
        from simtree.kernels.gdn import _launch as rule, _launched as kgl
        tb, meta, args = _gdn_inputs(ctx, 2, 8, "eagle", salt=5)
        if variant == "recurrent_baseline":
            out = kg.gdn_tree_verify_recurrent(*args, meta["parents"], meta["cu_nodes"])[0]
        else:
            backend = "triton" if variant == "triton_tree" else "torch"
            out = kgl.launched_verify(*args, meta["parents"], meta["cu_nodes"],
                                     launch=rule.VerifyLaunch(backend=backend))[0]
        ref = kg.gdn_tree_verify_ref(*[a.double() for a in args], meta["parents"], meta["cu_nodes"])
        ref = ref[0] if isinstance(ref, tuple) else ref
        err = float((out.double() - ref).abs().max() / ref.abs().max())
        assert err < 3e-2, f"gdn {variant} differs from gdn_tree_verify_ref: rel err {err:.2e}"
        return f"ok (rel err {err:.1e} vs gdn_tree_verify_ref, float64)"
    if stage == "gdn_decode_step" and variant == "triton_recurrent":
        from simtree.kernels import gdn as kg
        from simtree.kernels.gdn.ops import recurrent_step
        _, meta, (q, k, v, gdec, beta, state) = _gdn_inputs(ctx, 3, 1, "linear", salt=7)
        out, new = kg.gdn_tree_verify_recurrent(q, k, v, gdec, beta, state, meta["parents"],
                                                meta["cu_nodes"])
        want_state = state.double().clone()
        want = recurrent_step(q.double(), k.double(), v.double(), gdec.double(), beta.double(),
                              want_state)
        err = max(float((out.double() - want).abs().max() / want.abs().max()),
                  float((new.double() - want_state).abs().max() / want_state.abs().max()))
        assert err < 3e-2, f"gdn decode (triton) differs from the torch step: rel err {err:.2e}"
        return f"ok (rel err {err:.1e} vs the runtime's torch step, float64)"
    if stage == "gdn_tree_commit" and variant == "triton_tree":
        from simtree.kernels import gdn as kg
        from simtree.kernels.gdn import _launch as rule, _launched as kgl
        tb, meta, args = _gdn_inputs(ctx, 2, 8, "eagle", salt=6)
        accepted = torch.as_tensor(tb.deepest_nodes, device=ctx.device)
        states = []
        for backend in ("triton", "torch"):
            _, cache = kgl.launched_verify(*args, meta["parents"], meta["cu_nodes"],
                                          launch=rule.VerifyLaunch(backend=backend))
            state = args[5].clone()
            kgl.launched_commit(state, args[1], cache, meta["parents"], meta["cu_nodes"], accepted,
                               launch=rule.CommitLaunch(backend=backend))
            states.append(state.double())
        err = float((states[0] - states[1]).abs().max() / states[1].abs().max())
        assert err < 3e-2, f"gdn commit (triton) differs from the torch commit: rel err {err:.2e}"
        return f"ok (rel err {err:.1e} vs the torch commit, float64)"
    if stage in ("v4_swa_verify", "v4_csa_verify", "v4_hca_verify") and variant == "torch_gather":
        q = ctx.randn(3, 2, 8, dtype=torch.float64, salt=1)
        kv = ctx.randn(10, 8, dtype=torch.float64, salt=2)
        idx = torch.tensor([[0, 3, -1], [5, 9, 2], [-1, -1, 7]], device=dev)
        sink = ctx.randn(2, dtype=torch.float64, salt=3)
        out = pieces.v4_gather_attention(q, kv, idx, sink, 0.5)
        for r in range(3):
            rows = idx[r][idx[r] >= 0]
            s = torch.cat([(q[r] @ kv[rows].T) * 0.5, sink.view(-1, 1)], 1)
            ref = torch.softmax(s, -1)[:, :-1] @ kv[rows]
            assert torch.allclose(out[r], ref, atol=1e-9), "v4 gather attention differs from the per-row loop"
        return "ok (gather attention == per-row loop, float64)"
    return "no reference (timing only)"
