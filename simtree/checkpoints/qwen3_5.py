"""Qwen3.5 / Qwen3.6 checkpoints (dense GDN hybrid): config -> shape, keys -> the runtime's weights.

Model types: ``qwen3_5`` (the published vision-language wrapper: ``text_config`` and the
``model.language_model.*`` weights; ``model.visual.*`` is left), ``qwen3_5_text`` (what
``Qwen3_5ForCausalLM.save_pretrained`` writes: ``model.*``).  The MoE variants
(``qwen3_5_moe``) are refused: simtree's Qwen layers have a dense MLP.

Key names are transformers' (``modeling_qwen3_5.py``); the MTP layer's are the published
checkpoints' as SGLang's ``qwen3_5_mtp.py`` reads them (transformers drops ``mtp.*``):
``mtp.fc`` [h, 2h] over [pre_fc_norm_embedding(embed); pre_fc_norm_hidden(hidden)],
``mtp.layers.0.*`` (one full-attention decoder layer) and ``mtp.norm``.

The runtime's weights (``simtree.kernels.layers.qwen.layer_specs``) fuse what one GEMM reads:
GDN ``in_proj`` = [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a], attention ``qkv`` =
[q_proj (query | gate per head); k_proj; v_proj], MLP ``gate_up`` = [gate_proj; up_proj].  The
zero-centred RMSNorms of Qwen3.5 (``x * (1 + w)``: the layer norms, q/k norms, final norm and
the MTP norms) are stored as their effective scale ``1 + w``, computed in float32 once at load;
the GDN output norm (``RMSNormGated``: ``x * w``) is stored as is.
"""
from __future__ import annotations

from simtree.errors import SimtreeError

from . import TensorPlan, missing_field

__all__ = ["MODEL_TYPES", "text_config", "shape_fields", "tensor_plan", "runtime_weights"]

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
_KIND = {"linear_attention": "gdn", "full_attention": "attn"}


def text_config(config: dict) -> dict:
    """The language model's config: the wrapper's ``text_config`` (qwen3_5), else config."""
    mt = config.get("model_type")
    if mt in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise SimtreeError(f"model_type {mt!r}: simtree's Qwen layers have a dense MLP; the MoE variant is "
                           "not supported")
    if mt == "qwen3_5":
        tc = config.get("text_config")
        if not isinstance(tc, dict):
            raise SimtreeError("config.json of model_type 'qwen3_5' lacks its 'text_config' object")
        return tc
    return config


def _vl(config: dict) -> bool:
    return config.get("model_type") == "qwen3_5"


def _int(tc: dict, key: str) -> int:
    value = missing_field(tc, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SimtreeError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _rope(tc: dict, head_dim: int) -> tuple[float, int]:
    """(rope_theta, rotated dims) as transformers reads them: ``rope_parameters`` (or the older
    top-level rope_theta / partial_rotary_factor); text-only positions make M-RoPE's three
    sections equal, i.e. plain rotate-half RoPE on the first int(head_dim * factor) dims."""
    rp = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise SimtreeError(f"config.json: rope_type {rope_type!r} is not supported (simtree applies default RoPE)")
    theta = rp.get("rope_theta", tc.get("rope_theta"))
    if theta is None:
        raise SimtreeError("config.json lacks 'rope_theta' (in rope_parameters), which the model needs")
    factor = float(rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25)))
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise SimtreeError(f"config.json: partial_rotary_factor {factor} gives {dim} rotated dims of head_dim "
                           f"{head_dim}; simtree needs an even number >= 2")
    return float(theta), dim


def _layer_kinds(tc: dict, n: int) -> tuple[str, ...]:
    types = tc.get("layer_types")
    if types is None:
        every = tc.get("full_attention_interval")
        if every is None:
            raise SimtreeError("config.json lacks 'layer_types' (or 'full_attention_interval'), which the model needs")
        types = ["full_attention" if (i + 1) % int(every) == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise SimtreeError(f"config.json: {len(types)} layer_types for num_hidden_layers {n}")
    bad = sorted(set(types) - set(_KIND))
    if bad:
        raise SimtreeError(f"config.json: unknown layer type {bad[0]!r} (known: {', '.join(_KIND)})")
    return tuple(_KIND[t] for t in types)


def shape_fields(config: dict, name: str) -> dict:
    """ModelShape's fields from config.json (see the module docstring)."""
    tc = text_config(config)
    if tc.get("hidden_act", "silu") != "silu":
        raise SimtreeError(f"config.json: hidden_act {tc['hidden_act']!r} is not supported (silu)")
    if tc.get("attention_bias"):
        raise SimtreeError("config.json: attention_bias true is not supported (Qwen3.5 has none)")
    mtp_layers = int(tc.get("mtp_num_hidden_layers", 1) or 1)
    if mtp_layers != 1:
        raise SimtreeError(f"config.json: mtp_num_hidden_layers {mtp_layers}; simtree drafts with one MTP layer")
    h, n, D = _int(tc, "hidden_size"), _int(tc, "num_hidden_layers"), _int(tc, "head_dim")
    theta, rope_dim = _rope(tc, D)
    kinds = _layer_kinds(tc, n)
    attn = dict(q_heads=_int(tc, "num_attention_heads"), kv_heads=_int(tc, "num_key_value_heads"), head_dim=D,
                output_gate=bool(tc.get("attn_output_gate", True)), rope_dim=rope_dim, rope_theta=theta)
    gdn = {}
    if "gdn" in kinds:
        gdn = dict(key_heads=_int(tc, "linear_num_key_heads"), value_heads=_int(tc, "linear_num_value_heads"),
                   key_dim=_int(tc, "linear_key_head_dim"), value_dim=_int(tc, "linear_value_head_dim"),
                   conv_kernel=_int(tc, "linear_conv_kernel_dim"))
        if gdn["value_heads"] % gdn["key_heads"]:
            raise SimtreeError(f"config.json: linear_num_value_heads {gdn['value_heads']} is not a multiple of "
                               f"linear_num_key_heads {gdn['key_heads']}")
    if attn["q_heads"] % attn["kv_heads"]:
        raise SimtreeError(f"config.json: num_attention_heads {attn['q_heads']} is not a multiple of "
                           f"num_key_value_heads {attn['kv_heads']}")
    dtype = tc.get("dtype") or tc.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return dict(name=name, family="gdn_hybrid", hidden=h, vocab=_int(tc, "vocab_size"), layer_kinds=kinds,
                mlp=dict(kind="dense", intermediate=_int(tc, "intermediate_size")), dtype=_DTYPES.get(dtype, "bf16"),
                attn=attn, gdn=gdn, draft=dict(attention="attn", mlp="model", fuse_proj=True),
                config=dict(tc, rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
                            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                                tc.get("tie_word_embeddings", False)))))


# ---- tensors --------------------------------------------------------------------------------
def _prefix(config: dict) -> str:
    return "model.language_model." if _vl(config) else "model."


def _block_keys(p: str, kind: str, shape) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys of one decoder layer (prefix ``p`` = '...layers.<i>.') and their shapes."""
    h, I, a, g = shape.hidden, int(shape.mlp["intermediate"]), shape.attn, shape.gdn
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
           p + "mlp.gate_proj.weight": (I, h), p + "mlp.up_proj.weight": (I, h), p + "mlp.down_proj.weight": (h, I)}
    if kind == "gdn":
        H, HV, K, V, W = (int(g[k]) for k in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"))
        C, q = 2 * H * K + HV * V, p + "linear_attn."
        out.update({q + "in_proj_qkv.weight": (C, h), q + "in_proj_z.weight": (HV * V, h),
                    q + "in_proj_b.weight": (HV, h), q + "in_proj_a.weight": (HV, h), q + "conv1d.weight": (C, 1, W),
                    q + "A_log": (HV,), q + "dt_bias": (HV,), q + "norm.weight": (V,),
                    q + "out_proj.weight": (h, HV * V)})
    else:
        Hq, Hkv, D = int(a["q_heads"]), int(a["kv_heads"]), int(a["head_dim"])
        q = p + "self_attn."
        out.update({q + "q_proj.weight": (Hq * D * (2 if a.get("output_gate") else 1), h),
                    q + "k_proj.weight": (Hkv * D, h), q + "v_proj.weight": (Hkv * D, h),
                    q + "o_proj.weight": (h, Hq * D), q + "q_norm.weight": (D,), q + "k_norm.weight": (D,)})
    return out


def _mtp_keys(shape) -> dict[str, tuple[int, ...]]:
    h = shape.hidden
    return {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
            **_block_keys("mtp.layers.0.", "attn", shape)}


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", text_config(config).get("tie_word_embeddings", False)))


def tensor_plan(config: dict, shape) -> TensorPlan:
    if getattr(shape, "ranks", 1) != 1:
        raise SimtreeError(f"{shape.name}: a Qwen3.5 checkpoint loads whole on one device, not as one rank of "
                           f"{shape.deployment}")
    p, h, V = _prefix(config), shape.hidden, shape.vocab
    required = {p + "embed_tokens.weight": (V, h), p + "norm.weight": (h,)}
    if not _tied(config):
        required["lm_head.weight"] = (V, h)
    for i, kind in enumerate(shape.layer_kinds):
        required.update(_block_keys(f"{p}layers.{i}.", kind, shape))
    visual = ("model.visual.", "visual.") if _vl(config) else ()
    return TensorPlan(required, {"MTP layer": _mtp_keys(shape)},
                      ignore=lambda key: key.startswith(visual) or key.endswith("rotary_emb.inv_freq"))


def runtime_weights(config: dict, shape, read, dtype) -> dict:
    """The runtime's weights (names of kernels.layers.qwen.model_specs) from checkpoint tensors."""
    import torch

    def w(key):
        return read(key).to(dtype)

    def centred(key):   # Qwen3_5RMSNorm: x * (1 + w), with 1 + w in float32
        return (1.0 + read(key).float()).to(dtype)

    def block(src: str, dst: str, kind: str) -> dict:
        out = {dst + "ln1": centred(src + "input_layernorm.weight"),
               dst + "ln2": centred(src + "post_attention_layernorm.weight"),
               dst + "gate_up": torch.cat([w(src + "mlp.gate_proj.weight"), w(src + "mlp.up_proj.weight")]),
               dst + "down": w(src + "mlp.down_proj.weight")}
        if kind == "gdn":
            q = src + "linear_attn."
            out.update({dst + "in_proj": torch.cat([w(q + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")]),
                        dst + "conv": w(q + "conv1d.weight")[:, 0, :].contiguous(),
                        dst + "A_log": read(q + "A_log").float(), dst + "dt_bias": read(q + "dt_bias").float(),
                        dst + "gnorm": w(q + "norm.weight"), dst + "out": w(q + "out_proj.weight")})
        else:
            q = src + "self_attn."
            out.update({dst + "qkv": torch.cat([w(q + f"{x}_proj.weight") for x in ("q", "k", "v")]),
                        dst + "q_norm": centred(q + "q_norm.weight"), dst + "k_norm": centred(q + "k_norm.weight"),
                        dst + "o": w(q + "o_proj.weight")})
        return out

    p = _prefix(config)
    out = {"embed": w(p + "embed_tokens.weight"), "norm": centred(p + "norm.weight")}
    out["lm_head"] = out["embed"] if _tied(config) else w("lm_head.weight")
    for i, kind in enumerate(shape.layer_kinds):
        out.update(block(f"{p}layers.{i}.", f"layers.{i}.", kind))
    try:
        mtp = {"mtp.enorm": centred("mtp.pre_fc_norm_embedding.weight"),
               "mtp.hnorm": centred("mtp.pre_fc_norm_hidden.weight"), "mtp.fc": w("mtp.fc.weight"),
               "mtp.norm": centred("mtp.norm.weight"), **block("mtp.layers.0.", "mtp.", "attn")}
    except KeyError:    # the checkpoint has no MTP layer (transformers' save_pretrained drops it)
        mtp = {}
    return {**out, **mtp}
