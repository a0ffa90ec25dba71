"""DeepSeek-V4 checkpoints (``model_type`` "deepseek_v4"): config.json -> ModelShape, and the
safetensors weights -> the runtime's weight names (``simtree.kernels.layers.v4``).

    shape = simtree.models.shape_from_config(folder)   # through shape_fields below
    w = load_weights(folder, shape, device="cuda", dtype=torch.bfloat16, ep_rank=0, ep_ranks=8)

Weights are read by the key names transformers reads and writes for this model type: the
released checkpoint's (``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight``,
``embed.weight``, ``head.weight``, ``hc_head_fn``, ...; transformers' conversion mapping renames
them on load, and ``DeepseekV4ForCausalLM.save_pretrained`` writes them back, under a
``model.`` prefix, which is ignored here).  The MTP layer: ``mtp.0.*`` in the same names plus
``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, ``hc_head_*`` (SGLang's
``deepseek_v4_nextn.py`` reads the same); ``save_pretrained`` drops them, and the runtime then
draws a random MTP layer and says so.

Layout changes made here, so that the kernels compute V4's semantics exactly:
- V4 rotates interleaved pairs (2i, 2i + 1) of each head's trailing ``rope_dim`` channels; the
  kernels rotate half-split pairs (i, i + rope_dim / 2).  Every projection that writes a rope
  slice (q_b_proj, kv_proj, the compressors' kv / gate / position bias, the indexer's q_b_proj)
  has its rope rows permuted to evens-then-odds, the norms over those channels alike, and the
  output projection's columns (o_a_proj reads the rotated latent back) the same way.  Dot
  products and RMS norms are unchanged by a shared permutation.
- q_a_proj, kv_proj (and the indexer's weights_proj on CSA layers) are one fused GEMM.
- The shared expert's gate and up projections are stacked [gate | up] like the experts'.
- Quantised checkpoints (``quantization_config``: block-scaled FP8, the experts FP8 or MXFP4
  ``expert_dtype`` fp4): a 1-byte weight ``X.weight`` comes with its scales ``X.scale`` (the
  released checkpoint) or ``X.weight_scale_inv`` (transformers).  The routed and shared experts
  stay FP8 (:mod:`.quantized`: ``from_checkpoint``; FP4 through ``fp4_to_fp8``), stored as
  ``name`` and ``name_scale_inv``; so do the attention's linears (wq_a | wkv, wq_b, the indexer's
  wq_b, wo_a, wo_b: the shape's ``v4.attn_proj_dtype`` fp8, which a quantised config sets) where
  their blocks survive the layout changes above (every rope slice inside one 128-row block, wo_a's
  groups whole blocks, wq_a whole blocks ahead of wkv: so at V4-Flash's sizes), the indexer's head
  weights then a GEMM of their own; any other FP8 weight is dequantised to the model's dtype.
  Experts stored in one format and run in the other (a float checkpoint on an FP8 shape) are
  converted; w1 and w3 stacked [gate | up] keep their blocks where I is a multiple of 128
  (V4's 2048), else they are requantised together.
- An expert-parallel rank reads only its experts (rows ``ep_rank * E / ep_ranks`` on), and routes
  over them: its router rows and bias, and the hash table's ids modulo its expert count (a
  stand-in for the dispatch the all-to-all does; exact where ``ep_ranks`` is 1).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from simtree.errors import SimtreeError
from simtree.parallel import parse_deployment
from simtree.quant import (V4_ATTN_LINEARS, attn_proj_dtype_from_hf, expert_dtype, expert_dtype_from_hf,
                           expert_format_from_hf, runtime_attn_proj, scale_blocks)

from . import TensorPlan
from .quantized import (CHECKPOINT_SCALE_SUFFIXES, FP4_GROUP, FP8_BLOCK, SCALE_SUFFIX, Fp8Weight, as_format, cat_rows,
                        dequantize_weight, quantised_reader, stack)

__all__ = ["MODEL_TYPES", "text_config", "shape_fields", "tensor_plan", "runtime_weights", "read_config",
           "dequantised_projection",
           "load_weights", "rope_perm"]

MODEL_TYPE = "deepseek_v4"
MODEL_TYPES = (MODEL_TYPE,)
_KIND = {"sliding_attention": "swa", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_REQUIRED = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
             "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
             "sliding_window", "index_n_heads", "index_head_dim", "index_topk")
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise SimtreeError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SimtreeError(f"{path}: not readable JSON ({exc})") from None


def _layer_kinds(cfg: dict, n: int) -> tuple[list[str], int, int]:
    rates = dict(cfg.get("compress_rates") or {})
    csa = int(rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128)))
    if cfg.get("layer_types") is not None:
        types = list(cfg["layer_types"])[:n]
        bad = sorted({t for t in types if t not in _KIND})
        if bad:
            raise SimtreeError(f"config.json: unknown DeepSeek-V4 layer_types {bad}")
        kinds = [_KIND[t] for t in types]
    elif cfg.get("compress_ratios") is not None:
        ratios = [int(r) for r in cfg["compress_ratios"]][:n]
        nonzero = sorted({r for r in ratios if r})
        if len(nonzero) > 2:
            raise SimtreeError(f"config.json: compress_ratios hold more than two ratios {nonzero}")
        small = min(nonzero) if nonzero else csa
        csa, hca = (small, max(nonzero)) if len(nonzero) == 2 else (csa, hca)
        kinds = ["swa" if r == 0 else "csa" if r == csa else "hca" for r in ratios]
    else:
        raise SimtreeError("config.json: missing layer_types (or compress_ratios)")
    if len(kinds) != n:
        raise SimtreeError(f"config.json: {len(kinds)} layer types for num_hidden_layers {n}")
    return kinds, csa, hca


def _yarn(cfg: dict) -> dict | None:
    rp = cfg.get("rope_parameters") or {}
    comp = rp.get("compress") if isinstance(rp.get("compress"), dict) else None
    if comp is None:
        comp = cfg.get("rope_scaling") or {k: v for k, v in rp.items() if k not in ("main", "compress")}
    kind = comp.get("rope_type", comp.get("type")) if comp else None
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise SimtreeError(f"config.json: compressed layers' RoPE {kind!r}; simtree builds default and yarn")
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")
    return {"rope_type": "yarn", **{k: comp[k] for k in keys if comp.get(k) is not None}}


def text_config(config: dict) -> dict:
    return config


def shape_fields(cfg: dict, name: str | None = None) -> dict:
    """ModelShape's fields from config.json (the package's family interface), every size from
    the config (transformers' defaults where it is silent)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise SimtreeError(f"config.json: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    missing = [k for k in _REQUIRED if cfg.get(k) is None]
    if missing:
        raise SimtreeError(f"config.json: missing {', '.join(missing)} (needed for a DeepSeek-V4 model)")
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise SimtreeError(f"config.json: scoring_func {cfg['scoring_func']!r}; simtree routes V4 by sqrtsoftplus")
    n, D = int(cfg["num_hidden_layers"]), int(cfg["head_dim"])
    kinds, csa, hca = _layer_kinds(cfg, n)
    rope = cfg.get("qk_rope_head_dim")
    rope = int(rope) if rope is not None else int(D * float(cfg.get("partial_rotary_factor") or 64 / 512))
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is None:
        k = int(cfg.get("num_hash_layers", 3))
        mlp_types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    mlp_types = list(mlp_types)[:n]
    theta = cfg.get("rope_theta") or ((cfg.get("rope_parameters") or {}).get("main") or {}).get("rope_theta", 1e4)
    v4 = {"q_heads": int(cfg["num_attention_heads"]), "head_dim": D, "rope_dim": rope,
          "q_lora_rank": int(cfg["q_lora_rank"]), "o_groups": int(cfg["o_groups"]),
          "o_lora_rank": int(cfg["o_lora_rank"]), "window": int(cfg["sliding_window"]), "csa_ratio": csa,
          "hca_ratio": hca, "index_topk": int(cfg["index_topk"]), "index_heads": int(cfg["index_n_heads"]),
          "index_head_dim": int(cfg["index_head_dim"]), "hc_mult": int(cfg.get("hc_mult", 4)),
          "hc_sinkhorn_iters": int(cfg.get("hc_sinkhorn_iters", 20)), "hc_eps": float(cfg.get("hc_eps", 1e-6)),
          "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": float(theta),
          "compress_rope_theta": float(cfg.get("compress_rope_theta", 160000.0)), "mlp_layer_types": mlp_types}
    yarn = _yarn(cfg)
    if yarn:
        v4["rope_scaling"] = yarn
    inter = int(cfg["moe_intermediate_size"])
    mlp = {"kind": "moe", "n_experts": int(cfg["n_routed_experts"]), "experts_per_token": int(cfg["num_experts_per_tok"]),
           "expert_intermediate": inter, "n_shared": int(cfg.get("n_shared_experts", 1)),
           "shared_intermediate": inter, "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.5)),
           "swiglu_limit": float(cfg.get("swiglu_limit", 10.0) or 0.0)}
    mlp["expert_dtype"] = expert_dtype_from_hf(cfg)     # FP8 / FP4 checkpoints run FP8 experts
    v4["attn_proj_dtype"] = attn_proj_dtype_from_hf(cfg)   # and their FP8 attention linears as stored
    dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    return dict(name=name or str(cfg.get("_name_or_path") or "deepseek-v4"), family="v4",
                hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), layer_kinds=tuple(kinds), mlp=mlp,
                dtype=dtype, v4=v4, draft={"attention": "swa", "mlp": "model", "fuse_proj": True}, config=dict(cfg))


# ---- tensors ----------------------------------------------------------------------------------
# the released checkpoint's names of one block's parts (the MTP layer's too)
_NAMES = {"ln1": "attn_norm.weight", "ln2": "ffn_norm.weight", "wq_a": "attn.wq_a.weight",
          "q_norm": "attn.q_norm.weight", "wq_b": "attn.wq_b.weight", "wkv": "attn.wkv.weight",
          "kv_norm": "attn.kv_norm.weight", "wo_a": "attn.wo_a.weight", "wo_b": "attn.wo_b.weight",
          "sink": "attn.attn_sink", "comp.wkv": "attn.compressor.wkv.weight",
          "comp.wgate": "attn.compressor.wgate.weight", "comp.ape": "attn.compressor.ape",
          "comp.norm": "attn.compressor.norm.weight", "idx.wkv": "attn.indexer.compressor.wkv.weight",
          "idx.wgate": "attn.indexer.compressor.wgate.weight", "idx.ape": "attn.indexer.compressor.ape",
          "idx.norm": "attn.indexer.compressor.norm.weight", "idx.wq_b": "attn.indexer.wq_b.weight",
          "idx.weights": "attn.indexer.weights_proj.weight", "router": "ffn.gate.weight",
          "router_bias": "ffn.gate.bias", "tid2eid": "ffn.gate.tid2eid",
          "shared_gate": "ffn.shared_experts.w1.weight", "shared_up": "ffn.shared_experts.w3.weight",
          "shared_down": "ffn.shared_experts.w2.weight",
          **{f"{w}_{p}": f"{w}_{p}" for w in ("hc_attn", "hc_ffn") for p in ("fn", "base", "scale")}}
_INT_DTYPES = ("I64", "I32")

def _saved_by_transformers(config: dict) -> bool:
    """transformers' save_pretrained writes ``layer_types`` into the config and the tensors under
    ``model.`` (except ``head.weight``); the released checkpoint has neither."""
    return config.get("layer_types") is not None


def _dims(shape) -> SimpleNamespace:
    """The sizes the key plan needs, and the rank's experts [lo, hi) of the whole model's E."""
    v, m = shape.v4, shape.mlp
    local = int(m["n_experts"])
    ranks = int(m.get("ep_ranks", 0)) or (parse_deployment(shape.deployment).ep
                                           if parse_deployment(shape.deployment).gpus > 1 else 1)
    rank = int(m.get("ep_rank", 0))
    if not 0 <= rank < ranks:
        raise SimtreeError(f"{shape.name}: expert-parallel rank {rank} of {ranks}")
    hc, h = int(v.get("hc_mult", 4)), shape.hidden
    ratio = {"swa": 0, "csa": int(v["csa_ratio"]), "hca": int(v["hca_ratio"])}
    return SimpleNamespace(h=h, V=shape.vocab, H=int(v["q_heads"]), D=int(v["head_dim"]), rope=int(v["rope_dim"]),
                           qr=int(v["q_lora_rank"]), G=int(v["o_groups"]), orank=int(v["o_lora_rank"]),
                           Hi=int(v["index_heads"]), Di=int(v["index_head_dim"]), ratio=ratio, hc=hc,
                           E=local * ranks, lo=rank * local, hi=(rank + 1) * local, k=int(m["experts_per_token"]),
                           I=int(m["expert_intermediate"]),
                           Is=int(m.get("n_shared", 1)) * int(m.get("shared_intermediate", m["expert_intermediate"])),
                           hashed=_hash_layers(shape), fmt="bf16", scale_suffix=".scale",
                           proj=runtime_attn_proj(v))


def _hash_layers(shape) -> set[int]:
    """The hash-routed layers (``mlp_layer_types``, which shape_fields always writes)."""
    types = shape.v4.get("mlp_layer_types") or ["hash_moe"] * int(shape.v4.get("num_hash_layers", 3))
    return {i for i, t in enumerate(types[:shape.num_layers]) if t == "hash_moe"}


def _quant_dims(config: dict, shape) -> SimpleNamespace:
    """_dims plus the checkpoint's expert format and its scale keys' suffix."""
    d = _dims(shape)
    d.fmt = expert_format_from_hf(config)
    d.scale_suffix = ".weight_scale_inv" if _saved_by_transformers(config) else ".scale"
    return d


def _names(p: str, transformers_saved: bool) -> dict:
    """Part -> key suffix; transformers writes the attention's kv norm back as ``attn.norm``."""
    return {**_NAMES, "kv_norm": "attn.norm.weight"} if transformers_saved and p != "mtp.0." else _NAMES


def _block_keys(p: str, kind: str, d, hashed: bool, n: dict = _NAMES) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: shape} of one block (prefix ``p``: '...layers.<i>.' or 'mtp.0.')."""
    h, D = d.h, d.D
    out = {n["ln1"]: (h,), n["ln2"]: (h,), n["wq_a"]: (d.qr, h), n["q_norm"]: (d.qr,), n["wq_b"]: (d.H * D, d.qr),
           n["wkv"]: (D, h), n["kv_norm"]: (D,), n["wo_a"]: (d.G * d.orank, d.H * D // d.G),
           n["wo_b"]: (h, d.G * d.orank), n["sink"]: (d.H,), n["router"]: (d.E, h),
           n["shared_gate"]: (d.Is, h), n["shared_up"]: (d.Is, h), n["shared_down"]: (h, d.Is)}
    out[n["tid2eid"] if hashed else n["router_bias"]] = (d.V, d.k) if hashed else (d.E,)
    for which in ("hc_attn", "hc_ffn"):
        nmix = (2 + d.hc) * d.hc
        out.update({f"{which}_fn": (nmix, d.hc * h), f"{which}_base": (nmix,), f"{which}_scale": (3,)})
    for pre, dim, ratio in (("comp.", D, d.ratio[kind]), ("idx.", d.Di, d.ratio["csa"])):
        if (pre == "comp." and kind == "swa") or (pre == "idx." and kind != "csa"):
            continue
        c = (2 if ratio == 4 else 1) * dim
        out.update({n[pre + "wkv"]: (c, h), n[pre + "wgate"]: (c, h), n[pre + "ape"]: (ratio, c),
                    n[pre + "norm"]: (dim,)})
    if kind == "csa":
        out.update({n["idx.wq_b"]: (d.Hi * d.Di, d.qr), n["idx.weights"]: (d.Hi, h)})
    for e in range(d.lo, d.hi):
        q = f"ffn.experts.{e}."
        out.update({q + "w1.weight": (d.I, h), q + "w3.weight": (d.I, h), q + "w2.weight": (h, d.I)})
    out.update(_scale_keys(out, d))
    if d.fmt == "fp4":      # two e2m1 values a byte
        out.update({k: (v[0], v[1] // 2) for k, v in out.items() if ".ffn.experts." in "." + k and k.endswith(".weight")})
    return {p + k: v for k, v in out.items()}


def _scale_keys(keys: dict, d) -> dict:
    """The experts' block-scale keys of a quantised checkpoint ({} for a float one): FP8
    [ceil(N / 128), ceil(K / 128)], MXFP4 (routed experts of an fp4 checkpoint) [N, K / 32]."""
    if d.fmt == "bf16":
        return {}
    out = {}
    for k, shape in keys.items():
        if k.startswith(("ffn.experts.", "ffn.shared_experts.")) and k.endswith(".weight"):
            n, kk = shape
            fp4 = d.fmt == "fp4" and k.startswith("ffn.experts.")
            out[k[:-len(".weight")] + d.scale_suffix] = (n, -(-kk // FP4_GROUP)) if fp4 else scale_blocks(n, kk)
    return out


def _quant_dtypes(keys: dict, d) -> dict:
    """Allowed safetensors dtypes of a quantised checkpoint's expert weights and scales."""
    if d.fmt == "bf16":
        return {}
    out = {}
    for k in keys:
        if k.endswith(d.scale_suffix):
            out[k] = ("F32", "BF16", "F8_E8M0", "U8")
        elif ".ffn.experts." in "." + k or ".shared_experts." in k:
            out[k] = ("F8_E4M3", "I8", "U8", "BF16", "F16", "F32") if ".ffn.experts." in "." + k else \
                ("F8_E4M3", "BF16", "F16", "F32")
    return out


def _mtp_keys(d) -> dict[str, tuple[int, ...]]:
    h, p = d.h, "mtp.0."
    return {p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "e_proj.weight": (h, h), p + "h_proj.weight": (h, h),
            p + "norm.weight": (h,), p + "hc_head_fn": (d.hc, d.hc * h), p + "hc_head_base": (d.hc,),
            p + "hc_head_scale": (1,), **_block_keys(p, "swa", d, False)}


def _top_keys(config: dict, d) -> dict[str, str]:
    """The model's own tensors: runtime name -> checkpoint key."""
    if _saved_by_transformers(config):
        out = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
               **{f"hc_head_{k}": f"model.hc_head.hc_{k}" for k in ("fn", "base", "scale")}}
    else:
        out = {"embed": "embed.weight", "norm": "norm.weight", **{f"hc_head_{k}": f"hc_head_{k}"
                                                                   for k in ("fn", "base", "scale")}}
    if not config.get("tie_word_embeddings", False):
        out["lm_head"] = "head.weight"
    return out


def _layers_prefix(config: dict) -> str:
    return "model.layers." if _saved_by_transformers(config) else "layers."


def tensor_plan(config: dict, shape) -> TensorPlan:
    """Every key the rank reads (its own experts only, with their block scales in a quantised
    checkpoint), the MTP layer optional; the scales of other FP8 weights are read with them."""
    d = _quant_dims(config, shape)
    shapes = {"embed": (d.V, d.h), "norm": (d.h,), "lm_head": (d.V, d.h), "hc_head_fn": (d.hc, d.hc * d.h),
              "hc_head_base": (d.hc,), "hc_head_scale": (1,)}
    required = {key: shapes[name] for name, key in _top_keys(config, d).items()}
    lp = _layers_prefix(config)
    for i, kind in enumerate(shape.layer_kinds):
        required.update(_block_keys(f"{lp}{i}.", kind, d, i in d.hashed, _names(lp, _saved_by_transformers(config))))
    mtp = _mtp_keys(d)
    dtypes = {k: _INT_DTYPES for k in required if k.endswith("tid2eid")}
    dtypes.update(_quant_dtypes(required, d))
    dtypes.update(_quant_dtypes(mtp, d))
    planned = set(required) | set(mtp)

    if d.fmt != "bf16":     # any other linear may be FP8 too (dequantised on load)
        dtypes.update({k: ("F8_E4M3", "BF16", "F16", "F32") for k, v in {**required, **mtp}.items()
                       if k not in dtypes and len(v) == 2 and k.endswith(".weight")})

    def companions(key: str) -> bool:
        """The block scales of a planned FP8 weight outside the experts."""
        return any(key.endswith(s) and key[:-len(s)] + ".weight" in planned for s in CHECKPOINT_SCALE_SUFFIXES)

    def ignore(key: str) -> bool:
        """Other ranks' experts, rotary buffers, the MTP layer's copies of the embedding and LM
        head (SGLang's mtp.0.emb / mtp.0.head): the model's own serve it; block scales read as
        companions."""
        return ".ffn.experts." in key or key.endswith("inv_freq") or key.startswith(("mtp.0.emb.", "mtp.0.head.")) \
            or companions(key)
    return TensorPlan(required, {"MTP layer": mtp}, dtypes, ignore, companions)


def rope_perm(width: int, rope: int) -> torch.Tensor:
    """Index over ``width`` channels ending in a rope slice: the slice's evens, then its odds."""
    lo = width - rope
    return torch.cat([torch.arange(lo), lo + torch.arange(0, rope, 2), lo + torch.arange(1, rope, 2)])


def _rows(t: torch.Tensor, block: int, rope: int, dim: int = 0) -> torch.Tensor:
    """t's index ``dim`` read as blocks of ``block`` channels (each ending in a rope slice), permuted."""
    n = t.shape[dim] // block
    idx = (rope_perm(block, rope)[None, :] + block * torch.arange(n)[:, None]).reshape(-1)
    return t.index_select(dim, idx)


def _rows_kept(t, block: int, rope: int, dim: int = 0):
    """:func:`_rows` of a weight that may be FP8: its blocks kept where the permutation moves no
    row (``dim`` 0) or column (``dim`` 1) out of its 128-block (every rope slice inside one
    block, as at V4-Flash's sizes), else dequantised (float32) and permuted."""
    if not isinstance(t, Fp8Weight):
        return _rows(t, block, rope, dim)
    n = t.weight.shape[dim] // block
    idx = (rope_perm(block, rope)[None, :] + block * torch.arange(n)[:, None]).reshape(-1)
    if torch.equal(idx // FP8_BLOCK, torch.arange(idx.numel()) // FP8_BLOCK):
        return Fp8Weight(t.weight.index_select(dim, idx), t.scale_inv)
    return _rows(dequantize_weight(t), block, rope, dim)


def _grouped(t, groups: int, rows: int):
    """A weight [groups * rows, K] as [groups, rows, K]; an FP8 one keeps its blocks where each
    group's rows are whole blocks."""
    if not isinstance(t, Fp8Weight):
        return t.reshape(groups, rows, -1)
    if rows % FP8_BLOCK:
        return dequantize_weight(t).reshape(groups, rows, -1)
    return Fp8Weight(t.weight.reshape(groups, rows, -1), t.scale_inv.reshape(groups, rows // FP8_BLOCK, -1))


_PROJ = V4_ATTN_LINEARS     # the attention's linears (FP8 where the shape says so)


def _block(read, p: str, kind: str, d, hashed: bool, names: dict = _NAMES) -> dict:
    """One block's runtime weights (names of kernels.layers.v4.layer_specs) from ``read``; on an
    FP8-projection shape the attention's linears as the checkpoint stores them (FP8 kept)."""
    def g(part):
        return read(p + names[part])

    def pj(part):
        """An attention linear: FP8 kept on an FP8-projection shape, else dequantised."""
        return getattr(read, "expert", read)(p + names[part]) if d.proj == "fp8" else g(part)
    w = {"ln1": g("ln1"), "q_norm": g("q_norm"), "kv_norm": _rows(g("kv_norm"), d.D, d.rope),
         "wq_b": _rows_kept(pj("wq_b"), d.D, d.rope), "sink": g("sink"), "wo_b": pj("wo_b"), "ln2": g("ln2"),
         "wo_a": _grouped(_rows_kept(pj("wo_a"), d.D, d.rope, dim=1), d.G, d.orank)}
    if d.proj == "fp8":     # the indexer's head weights (bf16 in DeepSeek's checkpoint) stay a separate GEMM
        w["wqkv_a"] = cat_rows([pj("wq_a"), _rows_kept(pj("wkv"), d.D, d.rope)])
        if kind == "csa":
            w["wi_head"] = g("idx.weights")
    else:
        w["wqkv_a"] = torch.cat([g("wq_a"), _rows(g("wkv"), d.D, d.rope)] + ([g("idx.weights")] if kind == "csa"
                                                                             else []))
    for pre, dim in (("comp.", d.D), ("idx.", d.Di)):
        if (pre == "comp." and kind == "swa") or (pre == "idx." and kind != "csa"):
            continue
        w[pre + "wkv"] = _rows(g(pre + "wkv"), dim, d.rope)
        w[pre + "wgate"] = _rows(g(pre + "wgate"), dim, d.rope)
        w[pre + "ape"] = _rows(g(pre + "ape"), dim, d.rope, dim=1)
        w[pre + "norm"] = _rows(g(pre + "norm"), dim, d.rope)
    if kind == "csa":
        w["wq_idx"] = _rows_kept(pj("idx.wq_b"), d.Di, d.rope)
    w["router"] = g("router")[d.lo:d.hi]
    if hashed:
        w["tid2eid"] = g("tid2eid").long() % (d.hi - d.lo)
    else:
        w["router_bias"] = g("router_bias")[d.lo:d.hi]
    ex = getattr(read, "expert", read)     # the experts as stored (FP8 kept), the rest dequantised
    gu, down = [], []
    for e in range(d.lo, d.hi):
        q = f"{p}ffn.experts.{e}."
        gu.append(cat_rows([ex(q + "w1.weight"), ex(q + "w3.weight")]))
        down.append(ex(q + "w2.weight"))
    w["experts_gu"], w["experts_down"] = stack(gu), stack(down)
    w["shared_gu"] = cat_rows([ex(p + names["shared_gate"]), ex(p + names["shared_up"])])
    w["shared_down"] = ex(p + names["shared_down"])
    for which in ("hc_attn", "hc_ffn"):
        for part in ("fn", "base", "scale"):
            w[f"{which}_{part}"] = g(f"{which}_{part}")
    return w


# weights the runtime keeps in fp32 whatever the model's dtype (kernels.layers.v4.model_specs)
_FP32 = ("sink", "router_bias", "_fn", "_base", "_scale", "comp.ape", "comp.norm", "idx.ape", "idx.norm")
_COMP_PROJ = ("comp.wkv", "comp.wgate", "idx.wkv", "idx.wgate")   # fp32 too under v4_comp "fp32"


def _fp32_keys() -> tuple[str, ...]:
    from simtree.quant import comp_proj_storage
    return _FP32 + (_COMP_PROJ if comp_proj_storage() == "fp32" else ())


_EXPERTS = ("experts_gu", "experts_down", "shared_gu", "shared_down")


def runtime_weights(config: dict, shape, read, dtype) -> dict:
    """The rank's runtime weights from checkpoint tensors (``read(key)``; the MTP layer where
    present, else left out for the runtime to draw); the experts at the shape's format (FP8:
    ``name`` float8_e4m3fn and ``name_scale_inv`` float32)."""
    d = _dims(shape)
    read = quantised_reader(read)
    w = {name: read(key) for name, key in _top_keys(config, d).items()}
    if "lm_head" not in w:
        w["lm_head"] = w["embed"]
    lp = _layers_prefix(config)
    for i, kind in enumerate(shape.layer_kinds):
        names = _names(lp, _saved_by_transformers(config))
        w.update({f"layers.{i}.{k}": t for k, t in _block(read, f"{lp}{i}.", kind, d, i in d.hashed, names).items()})
    try:
        read("mtp.0.e_proj.weight")
    except KeyError:
        pass
    else:
        p = "mtp.0."
        w.update({"mtp." + k: read(p + k + ".weight") for k in ("enorm", "hnorm", "e_proj", "h_proj", "norm")})
        w.update({"mtp.hc_head_" + k: read(p + "hc_head_" + k) for k in ("fn", "base", "scale")})
        w.update({"mtp." + k: t for k, t in _block(read, p, "swa", d, False).items()})
    fp = torch.float64 if dtype == torch.float64 else torch.float32
    keep = _fp32_keys()
    want = expert_dtype(shape.mlp)
    for k in [k for k in w if k.endswith(_EXPERTS)]:
        w.update({k + suffix: t for suffix, t in as_format(w.pop(k), want, dtype).items()})
    for k in [k for k in w if k.endswith(_PROJ) and isinstance(w[k], Fp8Weight)]:
        q = w.pop(k)
        w.update({k: q.weight, k + SCALE_SUFFIX: q.scale_inv})
    return {k: t if not t.is_floating_point() or t.element_size() == 1 or k.endswith(SCALE_SUFFIX)
            else t.to(fp if k.endswith(keep) else dtype) for k, t in w.items()}


# ---- a folder, without the package's reader -----------------------------------------------------
class _Files:
    """The checkpoint's tensors by key: model.safetensors, or the shards of its index."""

    def __init__(self, folder):
        from safetensors import safe_open
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise SimtreeError(f"{index}: unreadable index ({exc})") from None
            files = sorted(set(wmap.values()))
        else:
            files, wmap = sorted(p.name for p in folder.glob("*.safetensors")), None
            if not files:
                raise SimtreeError(f"{folder}: no *.safetensors files")
        self.handles, self.where = {}, {}
        for f in files:
            path = folder / f
            if not path.is_file():
                raise SimtreeError(f"{index}: shard {f} is missing")
            try:
                self.handles[f] = safe_open(str(path), framework="pt")
            except Exception as exc:   # truncated or corrupt file: the library's own error text
                raise SimtreeError(f"{path}: not a readable safetensors file ({' '.join(str(exc).split())[:120]})") \
                    from None
            for k in self.handles[f].keys():
                self.where[k] = f
        if wmap is not None:
            lost = sorted(k for k, f in wmap.items() if k not in self.where)
            if lost:
                raise SimtreeError(f"{index}: {lost[0]} is not in its shard {wmap[lost[0]]}")

    def read(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise KeyError(key)
        return self.handles[self.where[key]].get_tensor(key)

    def shape(self, key: str) -> tuple:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())


def load_weights(folder, shape, specs, device="cpu", dtype=torch.bfloat16) -> tuple[dict, bool]:
    """(the rank's weights in the runtime's names on ``device``, whether the MTP layer was in the
    checkpoint), every key, shape and dtype checked (``tensor_plan``) before a tensor is read;
    ``specs``: the rank's parameters (``kernels.layers.v4.model_specs``), which every weight must
    match."""
    config = read_config(folder)
    f = _Files(folder)
    plan = tensor_plan(config, shape)
    planned = dict(plan.required)
    for keys in plan.optional.values():
        planned.update(keys)
    for key in sorted(f.where):
        if key not in planned and not plan.ignore(key):
            raise SimtreeError(f"checkpoint: unexpected tensor {key}")
    missing = sorted(k for k in plan.required if k not in f.where)
    if missing:
        raise SimtreeError(f"checkpoint: missing tensor {missing[0]}")
    mtp = plan.optional["MTP layer"]
    has_mtp = any(k in f.where for k in mtp)
    lacking = sorted(k for k in mtp if k not in f.where)
    if has_mtp and lacking:
        raise SimtreeError(f"checkpoint: missing tensor {lacking[0]} of the MTP layer")
    for key in plan.required | (mtp if has_mtp else {}):
        got = f.shape(key)
        if got != tuple(planned[key]):
            raise SimtreeError(f"checkpoint: tensor {key} has shape {got}, the config needs {tuple(planned[key])}")
    w = runtime_weights(config, shape, f.read, dtype)
    specs = {s.name: s for s in specs}
    out = {}
    for name, t in w.items():
        s = specs.get(name)
        if s is None or tuple(t.shape) != tuple(s.shape):
            raise SimtreeError(f"checkpoint: {name} does not fit a {shape.name} rank")
        if dequantised_projection(name, t, s.dtype):
            out[name] = t.to(device=device, dtype=dtype)
            continue
        if t.dtype != (s.dtype or t.dtype) and (t.element_size() == 1 or (s.dtype and s.dtype.itemsize == 1)):
            raise SimtreeError(f"checkpoint: tensor {name} is {t.dtype}, the rank runs it as {s.dtype}")
        out[name] = t.to(device=device, dtype=s.dtype or dtype)
    return out, has_mtp


def dequantised_projection(name: str, t: torch.Tensor, spec_dtype) -> bool:
    """Whether ``t`` is an attention linear the rank would run FP8 but the checkpoint gives in a
    float dtype (stored so, or its FP8 blocks not kept: :func:`_rows_kept`, :func:`_grouped`):
    it runs as a plain GEMM in the model's dtype, without block scales."""
    return (name.endswith(_PROJ) and t.is_floating_point() and t.element_size() > 1 and spec_dtype is not None
            and spec_dtype.itemsize == 1)
