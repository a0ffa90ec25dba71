"""DeepSeek-V4 checkpoints (``model_type`` "deepseek_v4"): config.json -> ModelShape, and the
safetensors weights -> the runtime's weight names (``simtree.kernels.layers.v4``).

    shape = shape_from_config(read_config(folder))
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
from simtree.models import ModelShape, hash_layers

__all__ = ["MODEL_TYPE", "read_config", "shape_from_config", "load_weights", "rope_perm"]

MODEL_TYPE = "deepseek_v4"
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


def shape_from_config(cfg: dict, name: str | None = None, source: str = "") -> ModelShape:
    """The model's shape, every size from the config (transformers' defaults where it is silent)."""
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
    dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bf16")
    return ModelShape(name=name or str(cfg.get("_name_or_path") or "deepseek-v4"), family="v4",
                      hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), layer_kinds=tuple(kinds), mlp=mlp,
                      dtype=dtype, v4=v4, draft={"attention": "swa", "mlp": "model", "fuse_proj": True},
                      source=source)


# ---- tensors ----------------------------------------------------------------------------------
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
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            wmap = None
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
                self.where[k.removeprefix("model.")] = (f, k)
        if wmap is not None:
            lost = sorted(k for k, f in wmap.items() if k.removeprefix("model.") not in self.where)
            if lost:
                raise SimtreeError(f"{index}: {lost[0]} is not in its shard {wmap[lost[0]]}")
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key, rows: slice | None = None) -> torch.Tensor:
        """The tensor of ``key`` (or of the first present of a tuple of names), rows ``rows``."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        key = next((k for k in keys if k in self.where), None)
        if key is None:
            raise SimtreeError(f"checkpoint: missing tensor {keys[0]}")
        self.used.add(key)
        f, name = self.where[key]
        h = self.handles[f]
        try:
            return h.get_slice(name)[rows] if rows is not None else h.get_tensor(name)
        except Exception as exc:
            raise SimtreeError(f"checkpoint: tensor {key} unreadable ({' '.join(str(exc).split())[:120]})") from None


def rope_perm(width: int, rope: int) -> torch.Tensor:
    """Index over ``width`` channels ending in a rope slice: the slice's evens, then its odds."""
    lo = width - rope
    return torch.cat([torch.arange(lo), lo + torch.arange(0, rope, 2), lo + torch.arange(1, rope, 2)])


def _rows(t: torch.Tensor, block: int, rope: int, dim: int = 0) -> torch.Tensor:
    """t's index ``dim`` read as blocks of ``block`` channels (each ending in a rope slice), permuted."""
    n, rest = divmod(t.shape[dim], block)
    if rest or not n:                   # a misshapen tensor: left as is, for the shape check to name
        return t
    idx = (rope_perm(block, rope)[None, :] + block * torch.arange(n)[:, None]).reshape(-1)
    return t.index_select(dim, idx)


def _expect(t: torch.Tensor, key: str, shape: tuple) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise SimtreeError(f"checkpoint: tensor {key} has shape {tuple(t.shape)}, the config needs {tuple(shape)}")
    if t.dtype.is_floating_point and t.element_size() == 1:
        raise SimtreeError(f"checkpoint: tensor {key} is {t.dtype}; FP8 weights need the FP8 weight path")
    return t


def _layer(f: _Files, p: str, kind: str, d, hashed: bool, lo: int, hi: int, names: dict) -> dict:
    """One block's weights in simtree's names; ``names``: the checkpoint's key of each part."""
    def g(part):
        n = names[part]
        return f.get(p + n if isinstance(n, str) else tuple(p + x for x in n))
    w = {"ln1": g("ln1"), "q_norm": g("q_norm"), "kv_norm": _rows(g("kv_norm"), d.D, d.rope),
         "wq_b": _rows(g("wq_b"), d.D, d.rope), "sink": g("sink"), "wo_b": g("wo_b"), "ln2": g("ln2")}
    a = [g("wq_a"), _rows(g("wkv"), d.D, d.rope)]
    if kind == "csa":
        a.append(g("idx.weights"))
    w["wqkv_a"] = torch.cat(a, 0)
    wo_a = g("wo_a")
    w["wo_a"] = _rows(wo_a, d.D, d.rope, dim=1).reshape(d.G, d.orank, -1)
    for pre, dim, ratio in (("comp.", d.D, d.ratio(kind)), ("idx.", d.Di, d.csa)):
        if (pre == "comp." and kind == "swa") or (pre == "idx." and kind != "csa"):
            continue
        w[pre + "wkv"] = _rows(g(pre + "wkv"), dim, d.rope)
        w[pre + "wgate"] = _rows(g(pre + "wgate"), dim, d.rope)
        w[pre + "ape"] = _rows(g(pre + "ape"), dim, d.rope, dim=1)
        w[pre + "norm"] = _rows(g(pre + "norm"), dim, d.rope)
    if kind == "csa":
        w["wq_idx"] = _rows(g("idx.wq_b"), d.Di, d.rope)
    w["router"] = f.get(p + names["router"], slice(lo, hi))
    if hashed:
        w["tid2eid"] = g("tid2eid").long() % (hi - lo)
    else:
        w["router_bias"] = f.get(p + names["router_bias"], slice(lo, hi))
    _experts(f, p, lo, hi, w)
    w["shared_gu"] = torch.cat([g("shared_gate"), g("shared_up")], 0)
    w["shared_down"] = g("shared_down")
    for which in ("hc_attn", "hc_ffn"):
        for part in ("fn", "base", "scale"):
            w[f"{which}_{part}"] = g(f"{which}_{part}")
    return w


def _experts(f, p, lo, hi, w):
    gu, down = [], []
    for e in range(lo, hi):
        q = f"{p}ffn.experts.{e}."
        gu.append(torch.cat([f.get(q + "w1.weight"), f.get(q + "w3.weight")], 0))
        down.append(f.get(q + "w2.weight"))
    w["experts_gu"], w["experts_down"] = torch.stack(gu), torch.stack(down)


# the released checkpoint's names (what transformers' save_pretrained writes back, "model." first)
_NAMES = {"ln1": "attn_norm.weight", "ln2": "ffn_norm.weight", "wq_a": "attn.wq_a.weight",
          "q_norm": "attn.q_norm.weight", "wq_b": "attn.wq_b.weight", "wkv": "attn.wkv.weight",
          "kv_norm": ("attn.kv_norm.weight", "attn.norm.weight"), "wo_a": "attn.wo_a.weight",
          "wo_b": "attn.wo_b.weight", "sink": "attn.attn_sink",
          "comp.wkv": "attn.compressor.wkv.weight", "comp.wgate": "attn.compressor.wgate.weight",
          "comp.ape": "attn.compressor.ape", "comp.norm": "attn.compressor.norm.weight",
          "idx.wkv": "attn.indexer.compressor.wkv.weight", "idx.wgate": "attn.indexer.compressor.wgate.weight",
          "idx.ape": "attn.indexer.compressor.ape", "idx.norm": "attn.indexer.compressor.norm.weight",
          "idx.wq_b": "attn.indexer.wq_b.weight", "idx.weights": "attn.indexer.weights_proj.weight",
          "router": "ffn.gate.weight", "router_bias": "ffn.gate.bias", "tid2eid": "ffn.gate.tid2eid",
          "shared_gate": "ffn.shared_experts.w1.weight", "shared_up": "ffn.shared_experts.w3.weight",
          "shared_down": "ffn.shared_experts.w2.weight",
          **{f"{w}_{p}": f"{w}_{p}" for w in ("hc_attn", "hc_ffn") for p in ("fn", "base", "scale")}}


def _dims(shape: ModelShape) -> SimpleNamespace:
    v = shape.v4
    return SimpleNamespace(D=int(v["head_dim"]), rope=int(v["rope_dim"]), G=int(v["o_groups"]),
                           orank=int(v["o_lora_rank"]), Di=int(v["index_head_dim"]), csa=int(v["csa_ratio"]),
                           ratio=lambda k: {"swa": 0, "csa": int(v["csa_ratio"]), "hca": int(v["hca_ratio"])}[k],
                           hash_layers=set(hash_layers(shape)))


def load_weights(folder, shape: ModelShape, specs, device="cpu", dtype=torch.bfloat16, ep_rank: int = 0,
                 ep_ranks: int = 1) -> tuple[dict, bool]:
    """(weights in the runtime's names on ``device``, whether the MTP layer was in the checkpoint).
    ``specs``: the rank's parameters (name, shape, dtype; ``kernels.layers.v4.model_specs``), which
    every tensor must match; floating weights take ``dtype`` where the spec has none (the
    runtime keeps hyper-connections, sinks, router bias and compressors in fp32); every key of
    the checkpoint must be used."""
    d = _dims(shape)
    E = int(shape.mlp["n_experts"])
    local = E // ep_ranks
    if not 0 <= ep_rank < ep_ranks or E % ep_ranks:
        raise SimtreeError(f"expert-parallel rank {ep_rank} of {ep_ranks}: {E} experts do not split so")
    lo, hi = ep_rank * local, (ep_rank + 1) * local
    f = _Files(folder)
    w = {"embed": f.get(("embed.weight", "embed_tokens.weight")), "norm": f.get("norm.weight"),
         **{f"hc_head_{k}": f.get((f"hc_head_{k}", f"hc_head.hc_{k}")) for k in ("fn", "base", "scale")}}
    heads = ("head.weight", "lm_head.weight")
    w["lm_head"] = f.get(heads) if any(k in f for k in heads) else w["embed"]
    for i, kind in enumerate(shape.layer_kinds):
        for k, t in _layer(f, f"layers.{i}.", kind, d, i in d.hash_layers, lo, hi, _NAMES).items():
            w[f"layers.{i}.{k}"] = t
    has_mtp = "mtp.0.e_proj.weight" in f
    if has_mtp:
        p = "mtp.0."
        for k in ("enorm", "hnorm", "e_proj", "h_proj", "norm"):
            w["mtp." + k] = f.get(p + k + ".weight")
        for k in ("fn", "base", "scale"):
            w["mtp.hc_head_" + k] = f.get(p + "hc_head_" + k)
        for k, t in _layer(f, p, "swa", d, False, lo, hi, _NAMES).items():
            w["mtp." + k] = t
    skipped = sorted(k for k in f.where if k not in f.used and not _other_rank_expert(k))
    if skipped:
        raise SimtreeError(f"checkpoint: unexpected tensor {skipped[0]}" +
                           (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""))
    specs = {s.name: s for s in specs}
    out = {}
    for name, t in w.items():
        s = specs.get(name)
        if s is None:
            raise SimtreeError(f"checkpoint: no place for {name} in a {shape.name} rank")
        out[name] = _expect(t, name, s.shape).to(device=device, dtype=s.dtype or dtype)
    return out, has_mtp


def _other_rank_expert(key: str) -> bool:
    """An expert the rank does not hold (released layout: one key per expert)."""
    return ".ffn.experts." in key
