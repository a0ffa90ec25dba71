"""The V4 layer variants profiler/bench/v4_floor.py compares, the layer they run, and the checks
it runs on the device before it times anything: every variant's tree verify + commit against
float64 sequential decoding (tiny shapes, each layer kind), and at the model's shapes the fused
launches against their torch forms and each variant's attention block (and its core's output,
before the residual hides it) against the current path's.  Each check is a row {"check", "ok",
...}; a check that raises is a failed row.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import traceback

import numpy as np
import torch

from simtree.kernels.layers import v4 as V
from simtree.kernels.layers.forms import forms
from simtree.kernels.layers.weights import make_weights
from simtree.kernels.v4 import V4Cache
from simtree.profiler.bench.v4_floor_model import MOE_WEIGHTS, PROJECTIONS

__all__ = ["MODEL", "VARIANTS", "PROJ", "ATTENTION", "BLOCK_VARIANTS", "ATTN_LAUNCHES", "Layer", "variants", "run_checks", "log"]

MODEL = "deepseek-v4-flash"
# the forms each variant runs (kernels/layers/forms.py); "current" is the path before the fusions
VARIANTS = {"current": dict(v4_topk="sort", v4_hc="torch", v4_comp="fp32", v4_pool="whole"),
            "fused": dict(v4_topk="fused"),
            "fused_hc": dict(v4_topk="fused", v4_hc="fused"),
            # the compressors' projections at the checkpoint's bf16 (the layer's weights built so)
            "fused_all": dict(v4_topk="fused", v4_hc="fused", v4_comp="model"),
            # and the compressors' padding rows skipped ("live"), with HCA's windows pooled over
            # (window, channels) programs ("split")
            "fused_live": dict(v4_topk="fused", v4_hc="fused", v4_comp="model", v4_pool="live"),
            "fused_pool": dict(v4_topk="fused", v4_hc="fused", v4_comp="model", v4_pool="split"),
            # fused_pool with the attention's linears in bf16 (the checkpoint's FP8 values dequantised)
            "fused_bf16": dict(v4_topk="fused", v4_hc="fused", v4_comp="model", v4_pool="split"),
            "fused_flashmla": dict(v4_topk="fused")}
# the attention's linears of a variant where not the model's (V4-Flash: FP8, as its checkpoint)
PROJ = {"fused_bf16": "bf16"}
ATTENTION = {"fused_flashmla": "flashmla"}  # the attention core of a variant (default: the Triton one)
BLOCK_VARIANTS = ("current", "fused", "fused_hc", "fused_all", "fused_live", "fused_pool", "fused_bf16", "fused_flashmla")   # the attention block: tree and linear
# launches of the Triton attention core timed alone on the round's lists: name -> the switches of
# kernels/v4/_launched.sparse_attention_launched; the first is sparse_attention's default.  Names:
# bk rows per step, bh heads per program, w warps, s splits (0: the "waves2" rule, w1: the
# "wave1" rule, else that many); swap_*: the products with the rows as their M side, st the
# pipeline's stages; _ns: every block runs its products (no padding-block skip)
def _launch(bk, bh, w, s, swap=False, st=2, skip=True):
    name = f"{'swap_' if swap else ''}bk{bk}_bh{bh}_w{w}_s{s}" + (f"_st{st}" if swap else "") + ("" if skip else "_ns")
    kw = dict(block_k=bk, block_h=bh, num_warps=w, num_splits=s if isinstance(s, int) and s else None,
              split_rule="wave1" if s == "w1" else "waves2", swap=swap, stages=st, skip=skip)
    return name, kw


ATTN_LAUNCHES = dict(_launch(*a, **k) for a, k in (
    ((128, 32, 8, "w1"), dict(swap=True, st=1)),
    ((32, 32, 8, 0), {}), ((32, 32, 8, 0), dict(skip=False)),
    ((32, 32, 8, 1), {}), ((32, 32, 8, 4), {}), ((32, 32, 8, "w1"), {}),
    ((32, 16, 4, "w1"), {}),
    ((64, 32, 8, "w1"), dict(swap=True, st=1)), ((64, 32, 8, "w1"), dict(swap=True, st=2)),
    ((64, 32, 4, "w1"), dict(swap=True, st=2)), ((64, 16, 4, "w1"), dict(swap=True, st=3)),
    ((64, 64, 8, "w1"), dict(swap=True, st=2)),
    # every head in one program (one gather of a query's rows, not two): the default took 10.3x the
    # attention's byte floor at CSA batch 16 n 16 on the H100
    ((128, 64, 8, "w1"), dict(swap=True, st=1)), ((64, 64, 8, "w1"), dict(swap=True, st=1))))


def log(msg: str) -> None:
    print(f"[v4_floor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _base(name: str) -> str:
    return name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name


class Layer:
    """One attention block of a kind at V4-Flash shapes on the device, its caches per batch."""

    def __init__(self, d: V.V4Dims, kind: str, device, dtype=torch.bfloat16, seed: int = 0, comp: str = "fp32"):
        self.d, self.kind, self.device, self.dtype, self.seed, self.comp = d, kind, device, dtype, seed, comp
        self._twins = {}
        with forms(v4_comp=comp):       # the compressors' projections: fp32 copies or the model's bf16
            specs = V.layer_specs("", kind, d, V.residual_gain(43), torch.float32)
        self.w = make_weights([s for s in specs if _base(s.name) not in MOE_WEIGHTS + ("tid2eid",)], device, dtype,
                              seed)
        self.lw = V.layer_weights(self.w, kind, d)
        self.cfg = V.attn_config(d)
        self.ropes = V.rope_tables(d, device, dtype)

    def for_variant(self, variant: str) -> "Layer":
        """This layer, or its twin with the same random draws but the compressors' projections
        stored as the variant's form ``v4_comp`` says (the bf16 roundings of the fp32 draws: the
        two differ by that rounding, ~2e-3 relative, in those weights) and the attention's linears
        as ``PROJ`` says (bf16: the FP8 weights dequantised, the same values); built once."""
        comp, proj = VARIANTS[variant].get("v4_comp", "fp32"), PROJ.get(variant, self.d.proj)
        if (comp, proj) == (self.comp, self.d.proj):
            return self
        if (comp, proj) not in self._twins:
            base = self if comp == self.comp else self._twins.get((comp, self.d.proj)) or \
                Layer(self.d, self.kind, self.device, self.dtype, self.seed, comp)
            self._twins[(comp, self.d.proj)] = base
            self._twins[(comp, proj)] = base if proj == base.d.proj else base.dequantised()
        return self._twins[(comp, proj)]

    def dequantised(self) -> "Layer":
        """This layer with its FP8 attention linears in its dtype (the same values; the
        indexer's head weights back in the fused first GEMM)."""
        from simtree.checkpoints.quantized import Fp8Weight, dequantize_weight
        twin = copy.copy(self)
        twin.d, twin._twins, w = dataclasses.replace(self.d, proj="bf16"), {}, dict(self.w)
        for name in PROJECTIONS:
            if name + "_scale_inv" in w:
                w[name] = dequantize_weight(Fp8Weight(w[name], w.pop(name + "_scale_inv")), self.dtype)
        if "wi_head" in w:
            w["wqkv_a"] = torch.cat([w["wqkv_a"], w.pop("wi_head")])
        twin.w = w
        return twin

    def round(self, b: int, n: int, ctx: int, shape: str, seed: int = 0):
        """(cache, V4Round) of b sequences at ctx tokens, n-node trees of ``shape``."""
        max_len = ctx + 4 * n + 8
        for t in self.ropes.values():
            t.ensure(max_len + 2)
        cache = V4Cache.random(self.cfg, self.lw, b, ctx, max_len, dtype=self.dtype, device=self.device, seed=seed)
        lengths = torch.full((b,), ctx, dtype=torch.int64, device=self.device)
        return cache, self._meta(cache, lengths, b, n, shape, seed, max_len)

    def _meta(self, cache, lengths, b, n, shape, seed, max_len):
        from simtree.kernels.v4.steps import make_tree
        from simtree.trees.tree import TreeBatch
        rng = np.random.default_rng(seed + 17 * n)
        tb = TreeBatch(tuple(make_tree(n, shape, rng) for _ in range(b)))
        parents = torch.as_tensor(np.asarray(tb.parents), device=self.device).view(b, n)
        return V.round_meta(self.ropes, {self.kind: (cache, self.lw)}, lengths, parents, max_len - 1)

    def inputs(self, T: int, copies: int, seed: int):
        g = torch.Generator(device=self.device).manual_seed(seed)
        return [torch.randn(T, self.d.hc, self.d.h, generator=g, device=self.device).to(self.dtype)
                for _ in range(copies)]

    def block(self, x, cache, rm, impl="triton"):
        """The attention block as kernels.layers.v4.layer runs it: streams in, streams out."""
        d, kind, cs = self.d, self.kind, rm.rows(self.kind)
        inp, hc = V.attn_block_pre(self.w, d, kind, x, cs)
        o, _ = V.attn_core(kind, cache, self.lw, inp, rm.plans[kind], impl)
        return V.attn_block_post(self.w, d, x, o, cs, hc)

    def pre(self, x, rm):
        """The block before the core: hc_pre, norms, projections, RoPE."""
        return V.attn_block_pre(self.w, self.d, self.kind, x, rm.rows(self.kind))

    def post(self, x, o, hc, rm):
        """The block after the core: RoPE out of o, the grouped output projections, hc_post."""
        return V.attn_block_post(self.w, self.d, x, o, rm.rows(self.kind), hc)

    def core_inputs(self, x, rm):
        return V.attn_block_pre(self.w, self.d, self.kind, x, rm.rows(self.kind))[0]

    def core(self, inp, cache, rm, impl="triton"):
        return V.attn_core(self.kind, cache, self.lw, inp, rm.plans[self.kind], impl)[0]


def variants(device) -> list[str]:
    """The variants this device runs: fused_flashmla only where sgl-flash-mla works."""
    from simtree.kernels.v4.flashmla import flashmla_available
    ok = device == "cuda" and flashmla_available()[0]
    return [v for v in VARIANTS if ok or ATTENTION.get(v) != "flashmla"]


def run_checks(device, d: V.V4Dims) -> list[dict]:
    """Every check's row (module docstring)."""
    from simtree.kernels.layers.forms import v4_fusions
    from simtree.kernels.v4 import V4AttnConfig
    from simtree.kernels.v4.check import check_against_reference
    out = []

    def record(name, fn):
        try:
            r = fn()
            out.append({"check": name, **r})
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, never the end of the run
            out.append({"check": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            traceback.print_exc()
        log(f"check {name}: {'OK' if out[-1].get('ok') else 'FAIL'} "
            + ", ".join(f"{k}={v}" for k, v in out[-1].items() if k not in ("check", "ok")))

    cfg = V4AttnConfig.tiny(num_heads=16, head_dim=64, rope_dim=16, indexer_dim=32, indexer_heads=8, hidden=48,
                            window=16, hca_ratio=16, topk=6, page_size=8)
    for variant in variants(device):
        if ATTENTION.get(variant):
            continue                    # the FP8 core: check_flashmla_path below
        with forms(**VARIANTS[variant]):
            fus = v4_fusions()
        for kind in ("csa", "hca", "swa"):
            def tiny(kind=kind, fus=fus):
                r = check_against_reference(cfg, kind, [37, 52, 9], nodes=12, seed=1, device=device,
                                            dtype=torch.float32, attention="triton", planner="device", fusions=fus)
                r["ok"] = bool(r["verify_err"] < 2e-3 and r["commit_err"] < 2e-4 and not r["verify_wrote_cache"])
                return r
            record(f"tree_verify_{kind}_{variant}", tiny)
    if "fused_flashmla" in variants(device):
        from simtree.kernels.v4.check import check_flashmla_path
        record("tree_verify_flashmla", lambda: {k: v for k, v in check_flashmla_path(device).items() if k != "check"})
    record("attention_launches_flash", lambda: _check_launches(device, d))
    record("topk_list_flash", lambda: _check_topk(device))
    record("comp_proj_bf16", lambda: _check_comp_proj(device, d))     # form v4_comp "model"
    record("fp8_projections", lambda: _check_fp8_projections(device, d))
    for kind in ("csa", "hca", "swa"):
        record(f"block_{kind}_flash", lambda kind=kind: _check_block(device, d, kind))
    return out


def _check_launches(device, d):
    """Every launch of ATTN_LAUNCHES against the torch form (fp32) on bf16 rows at the model's
    head shapes, 640-row lists with holes.  A launch the GPU refuses (registers, shared memory)
    is listed under "refused" and skipped by the timing too; the default launch must run."""
    from simtree.kernels.v4 import sparse_attention_torch
    from simtree.kernels.v4._launched import sparse_attention_launched
    g = torch.Generator(device=device).manual_seed(6)
    srcs = [torch.randn(n, d.D, generator=g, device=device).to(torch.bfloat16) for n in (300, 24, 2000, 8)]
    idx = torch.randint(-1, 2332, (12, 640), generator=g, device=device)
    q = torch.randn(12, d.H, d.D, generator=g, device=device).to(torch.bfloat16)
    sink = torch.randn(d.H, generator=g, device=device)
    ref = sparse_attention_torch(q.float(), idx, [s.float() for s in srcs], sink, d.D ** -0.5)
    errs, refused = {}, {}
    for name, kw in ATTN_LAUNCHES.items():
        try:
            got = sparse_attention_launched(q, idx, srcs, sink, d.D ** -0.5, **kw).float()
        except Exception as exc:  # noqa: BLE001 - a launch the GPU refuses: listed, not timed
            refused[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        errs[name] = float((got - ref).abs().max())
    default = next(iter(ATTN_LAUNCHES))
    return {"ok": default in errs and all(e < 3e-2 for e in errs.values()), "max_err": errs, "refused": refused}


def _check_comp_proj(device, d):
    """The compressors' projections at the checkpoint's bf16 (form v4_comp "model": the tensor
    cores with an fp32 output, the position bias in the GEMM) against float64 of the same bf16
    operands, at the model's CSA shapes and 1 / 7 / 256 tokens (the block check barely reaches
    them: few new compressed entries land in a round's top-k)."""
    from simtree.kernels.v4.compressor import random_compressor
    from simtree.kernels.v4.verify import project_stacked
    g = torch.Generator().manual_seed(11)
    errs, dtypes = {}, set()
    for dim in (d.D, d.Di):
        p = random_compressor(dim, d.csa, d.h, d.rope, True, g, dtype=torch.float32).to(device)
        p.wkv, p.wgate = p.wkv.bfloat16(), p.wgate.bfloat16()
        for T in (1, 7, 256):
            x = torch.randn(T, d.h, generator=g).bfloat16().to(device)
            pos = torch.arange(T, device=device) % d.csa
            got = project_stacked(p, x, pos)
            dtypes.add(got.dtype)
            got = got.double()
            ref = torch.stack([x.double() @ p.wkv.double().T, x.double() @ p.wgate.double().T
                               + p.ape.double()[pos]])
            errs[f"dim{dim}_T{T}"] = float((got - ref).abs().max() / ref.abs().max())
    return {"ok": dtypes == {torch.float32} and all(e < 1e-5 for e in errs.values()), "max_rel_err": errs}


def _check_topk(device):
    from simtree.kernels.v4._topk_kernel import topk_to_list, topk_to_list_torch
    g = torch.Generator(device=device).manual_seed(4)
    N, B, E, S = 64, 4, 4096, 4
    scores = torch.randn(N, E + S, generator=g, device=device)
    scores[:, -2:] = float("-inf")
    persist = torch.randperm(B * E, generator=g, device=device).view(B, E)
    vis = torch.randint(-1, 40, (N, S), generator=g, device=device)
    seq = torch.randint(0, B, (N,), generator=g, device=device)
    win = torch.randint(-1, 5000, (N, 128), generator=g, device=device)
    got = topk_to_list(scores, 512, win, persist, vis, seq, 9999, 777)
    ref = topk_to_list_torch(scores, 512, win, persist, vis, seq, 9999, 777)
    same = bool(torch.equal(got.sort(1).values, ref.sort(1).values))
    return {"ok": same, "same_set": same}


def _check_block(device, d, kind):
    L = Layer(d, kind, device, seed=5)
    cache, rm = L.round(2, 8, 4096, "random", seed=5)
    x = L.inputs(16, 1, 5)[0]
    inp = L.core_inputs(x, rm)
    blocks, cores = {}, {}
    for variant in variants(device):
        impl = ATTENTION.get(variant, "triton")
        Lv = L.for_variant(variant)
        with forms(**VARIANTS[variant]):
            blocks[variant] = Lv.block(x, cache, rm, impl).float()
            cores[variant] = Lv.core(inp, cache, rm, impl).float()    # o, before the residual hides it
    errs = {f"{scope}_{v}": float((o - outs["current"]).norm() / outs["current"].norm())
            for scope, outs in (("block", blocks), ("core", cores)) for v, o in outs.items() if v != "current"}
    # bf16 outputs agree to rounding; the FP8 attention core within its 6% (check_flashmla_path), and
    # the bf16 linears against the FP8 GEMMs by the activations' FP8 rounding
    return {"ok": all(e < (6e-2 if "flashmla" in k or k.endswith(tuple(PROJ)) else 2e-2) for k, e in errs.items()),
            "rel_err_vs_current": errs}


def _check_fp8_projections(device, d):
    """The attention's FP8 linears (fp8.linear; wo_a's groups as one grouped GEMM) against their
    exact math (activations quantised per 1 x 128, both operands dequantised, float32) at the
    model's shapes and 1 / 16 / 256 tokens."""
    from simtree.kernels.layers import fp8
    from simtree.checkpoints.quantized import quantize_weight
    g = torch.Generator().manual_seed(12)
    errs = {}
    for name, (N, K) in {"wq_b": (d.H * d.D, d.qr), "wqkv_a": (d.qr + d.D, d.h), "wo_b": (d.h, d.G * d.orank)}.items():
        w = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, pow2=True)
        w = fp8.Fp8Weight(w.weight.to(device), w.scale_inv.to(device))
        for T in (1, 16, 256):
            x = torch.randn(T, K, generator=g).bfloat16().to(device)
            got, ref = fp8.linear(x, w).float(), fp8.linear_emulated(x.float(), w)
            errs[f"{name}_T{T}"] = float((got - ref).abs().max() / ref.abs().max())
    wa = quantize_weight(torch.randn(d.G, d.orank, d.H // d.G * d.D, generator=g) * d.D ** -0.5, pow2=True)
    wa = fp8.Fp8Weight(wa.weight.to(device), wa.scale_inv.to(device))
    for T in (1, 16, 256):
        x = torch.randn(d.G * T, wa.shape[-1], generator=g).bfloat16().to(device)
        offs = torch.arange(1, d.G + 1, device=device, dtype=torch.int32) * T
        got = fp8.grouped_linear(x, wa, offs).float()
        ref = torch.cat([fp8.linear_emulated(x[i * T:(i + 1) * T].float(), fp8.Fp8Weight(wa.weight[i], wa.scale_inv[i]))
                         for i in range(d.G)])
        errs[f"wo_a_T{T}"] = float((got - ref).abs().max() / ref.abs().max())
    return {"ok": all(e < 2e-2 for e in errs.values()), "max_rel_err": errs}
