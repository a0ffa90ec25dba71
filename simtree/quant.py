"""Weight formats of the experts: what a checkpoint ships and what it costs in bytes.

DeepSeek's FP8 checkpoints store a linear weight [out, in] as ``float8_e4m3fn`` with one float32
scale per 128 x 128 block (``weight_scale_inv`` [ceil(out / 128), ceil(in / 128)]; the weight is
``fp8 * scale``); activations are quantised at run time per token and 128 input channels
(1 x 128 groups).  A model shape names its experts' format in ``mlp.expert_dtype`` (``bf16``,
the default, or ``fp8``); the routed experts and the shared expert follow it, every other weight
stays at the model's dtype.

    expert_dtype(shape.mlp)                               # "fp8"
    expert_params(2 * I, h, "fp8", groups=E)              # [(E*2I*h, 1), (E*16*32, 4)]
    expert_dtype_from_hf(config)                          # what simtree runs for a config.json
    expert_format_from_hf(config)                         # what its files hold: bf16, fp8, fp4
"""
from __future__ import annotations

from simtree.errors import SimtreeError

__all__ = ["FP8_BLOCK", "EXPERT_DTYPES", "SCALE_BYTES", "expert_dtype", "scale_blocks", "expert_params",
           "expert_dtype_from_hf", "expert_format_from_hf", "DEFAULT_COMP_PROJ", "comp_proj_storage", "set_comp_proj_storage",
           "ATTN_PROJ_DTYPES", "attn_proj_dtype", "attn_proj_dtype_from_hf", "runtime_attn_proj", "attn_proj_storage",
           "set_attn_proj_storage", "V4_AUTO", "V4_ATTN_LINEARS"]

FP8_BLOCK = 128                 # the weights' block (both axes) and the activations' group
EXPERT_DTYPES = ("bf16", "fp8")
SCALE_BYTES = 4                 # one float32 scale per block (UE8M0 scales are widened on load)

# How a V4 rank stores its compressors' projections (wkv, wgate): "fp32" copies, or "model" - the
# model's dtype, as the checkpoint ships them.  The layer form v4_comp (kernels/layers/forms.py)
# sets it; the registry's weight bytes and the checkpoint loader read it here.
DEFAULT_COMP_PROJ = "model"     # the form's "auto" (kernels.layers.forms.V4_AUTO reads it)
# What the V4 layer forms' "auto" runs (kernels/layers/forms.py: V4_AUTO is this dict), here so that
# the core can say which path the runtime runs (simtree/costs/runtime_path.py).  Every fused form
# measured faster on the H100 (docs/math/v4_compression.md, reports/h100/floor.csv): v4_pool
# "split" equals "live" where no window completes and is faster where one does (HCA at 4223).
# v4_proj: how a V4 rank runs the attention's linears a checkpoint stores in FP8: "fp8", kept so (the
# checkpoint's dtype), or "bf16", dequantised on load (on an H100 the bf16 GEMMs measured 1.21-1.69x
# faster per block than the FP8 Triton ones: docs/math/v4_compression.md).
V4_AUTO = {"v4_topk": "fused", "v4_hc": "fused", "v4_comp": DEFAULT_COMP_PROJ, "v4_pool": "split", "v4_proj": "fp8"}
# the attention's linears of a V4 layer (runtime names; FP8 in DeepSeek's checkpoints)
V4_ATTN_LINEARS = ("wqkv_a", "wq_b", "wq_idx", "wo_a", "wo_b")
# the storage each weight-making form sets (kernels/layers/forms.set_forms): form -> (allowed, [value])
_STORAGE = {"v4_comp": (("fp32", "model"), [DEFAULT_COMP_PROJ]), "v4_proj": (("fp8", "bf16"), [V4_AUTO["v4_proj"]])}


def _set_storage(form: str, value: str) -> None:
    allowed, cell = _STORAGE[form]
    if value not in allowed:
        raise SimtreeError(f"V4 {form} storage {value!r}: use {' or '.join(allowed)}")
    cell[0] = value


def attn_proj_storage() -> str:
    return _STORAGE["v4_proj"][1][0]


def set_attn_proj_storage(value: str) -> None:
    _set_storage("v4_proj", value)


def comp_proj_storage() -> str:
    return _STORAGE["v4_comp"][1][0]


def set_comp_proj_storage(value: str) -> None:
    _set_storage("v4_comp", value)


def expert_dtype(mlp: dict) -> str:
    """The experts' format of an ``mlp`` section (``bf16`` unless it says otherwise)."""
    value = str(mlp.get("expert_dtype", "bf16"))
    if value not in EXPERT_DTYPES:
        raise SimtreeError(f"mlp.expert_dtype {value!r}: use one of {', '.join(EXPERT_DTYPES)}")
    return value


ATTN_PROJ_DTYPES = ("bf16", "fp8")


def attn_proj_dtype(v4: dict) -> str:
    """How a V4 shape stores its attention's linears (``v4.attn_proj_dtype``: ``bf16``, the
    default, or ``fp8``: block-scaled as DeepSeek's checkpoints ship wq_a, wkv, wq_b, the
    indexer's wq_b, wo_a and wo_b)."""
    value = str(v4.get("attn_proj_dtype", "bf16"))
    if value not in ATTN_PROJ_DTYPES:
        raise SimtreeError(f"v4.attn_proj_dtype {value!r}: use one of {', '.join(ATTN_PROJ_DTYPES)}")
    return value


def runtime_attn_proj(v4: dict, storage: str | None = None) -> str:
    """How the runtime holds a V4 shape's attention linears: FP8 where the shape stores them so
    and the form v4_proj keeps them (``storage``, default :func:`attn_proj_storage`), else bf16."""
    keep = attn_proj_storage() if storage is None else storage
    return "fp8" if attn_proj_dtype(v4) == "fp8" and keep == "fp8" else "bf16"


def attn_proj_dtype_from_hf(config: dict) -> str:
    """A V4 config's attention linears: ``fp8`` where the checkpoint is block-scaled FP8 (its
    ``quantization_config``), else ``bf16``."""
    return "bf16" if expert_format_from_hf(config) == "bf16" else "fp8"


def scale_blocks(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of a weight's block-scale grid: [ceil(out / 128), ceil(in / 128)]."""
    return -(-int(out_features) // FP8_BLOCK), -(-int(in_features) // FP8_BLOCK)


def expert_params(out_features: int, in_features: int, dtype: str, groups: int = 1) -> list[tuple[int, int]]:
    """(numel, bytes per element; 0 = the model's dtype) of ``groups`` expert weights [out, in]
    stored as ``dtype``: the weight, and for FP8 its float32 block scales."""
    n = int(groups) * int(out_features) * int(in_features)
    if dtype == "bf16":
        return [(n, 0)]
    so, si = scale_blocks(out_features, in_features)
    return [(n, 1), (int(groups) * so * si, SCALE_BYTES)]


def expert_dtype_from_hf(config: dict) -> str:
    """The experts' format simtree runs for a Hugging Face config: ``bf16`` without a
    quantization config, else ``fp8`` (the checkpoint's FP4 experts converted on load, as
    SGLang runs them on Hopper: :func:`expert_format_from_hf` says which the files hold)."""
    return "bf16" if expert_format_from_hf(config) == "bf16" else "fp8"


def expert_format_from_hf(config: dict) -> str:
    """The experts' format a checkpoint's files hold: ``bf16`` without a quantization config,
    ``fp8`` for DeepSeek's block-scaled FP8 (``quant_method`` fp8, 128 x 128 blocks, dynamic
    activation scales), ``fp4`` where its ``expert_dtype`` says so (MXFP4: e2m1 pairs, a scale per
    32 channels); anything else is refused in one line."""
    q = config.get("quantization_config")
    if not q:
        return "bf16"
    if not isinstance(q, dict):
        raise SimtreeError("config.json: quantization_config must be a mapping")
    method = str(q.get("quant_method", ""))
    if method != "fp8":
        raise SimtreeError(f"config.json: quant_method {method!r} is not supported (simtree runs block-scaled fp8)")
    block = q.get("weight_block_size")
    if list(block or []) != [FP8_BLOCK, FP8_BLOCK]:
        raise SimtreeError(f"config.json: weight_block_size {block!r}: simtree's FP8 GEMMs take "
                           f"[{FP8_BLOCK}, {FP8_BLOCK}] blocks")
    if str(q.get("activation_scheme", "dynamic")) != "dynamic":
        raise SimtreeError(f"config.json: activation_scheme {q.get('activation_scheme')!r}: only dynamic "
                           "(per-token 1 x 128 groups) activation scales are supported")
    experts = str(q.get("expert_dtype") or config.get("expert_dtype") or "fp8")
    if experts not in ("fp8", "fp4"):
        raise SimtreeError(f"config.json: expert_dtype {experts!r}: simtree reads fp8 or fp4 (MXFP4) experts")
    return experts
