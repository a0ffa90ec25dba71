"""Model shape registry: layer pattern and dimensions of the target models (timing only).

Shapes live as YAML in ``simtree/data/models/<name>.yaml`` (package data, read through
:func:`simtree.data.data_path`; ``scenarios/models/`` links to the same files). Only dimensions are described, never weights: the
profiler times random-weight layers at these shapes.

    shape = get_model("qwen3.6-27b")
    shape.layer_kinds        # ("gdn", "gdn", "gdn", "attn", ...)  64 entries
    shape.layer_counts()     # {"gdn": 48, "attn": 16}
    shape.weight_bytes()     # bytes of its weights (target + draft layer) at shape.dtype
    rank = get_model("deepseek-v4-flash").shard("ep=8")   # one rank's shape: 32 local experts
    rank.cache_bytes(batch_size=8, context_len=4096)       # KV cache + recurrent state of 8 sequences

Layer kinds: ``gdn`` (Gated DeltaNet), ``attn`` (full attention, GQA), ``swa`` / ``csa`` /
``hca`` (DeepSeek-V4 sliding-window-only, ratio-4 sparse, ratio-128 compressed attention).
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from simtree.data import data_path
from simtree.parallel import DEFAULT_DEPLOYMENT, Deployment, parse_deployment
from simtree.errors import SimtreeError, check_int
from simtree.fileio import read_yaml
from simtree.quant import expert_dtype, expert_params, runtime_attn_proj

__all__ = ["ModelShape", "get_model", "list_models", "load_model_file", "MODEL_DIR", "DTYPE_BYTES",
           "LAYER_KINDS", "VERIFY_STAGE", "COMMIT_STAGE", "ROUND_STAGE", "DECODE_STAGE",
           "MODEL_ROUND_STAGE", "HASH_MLP_STAGE", "hash_layers"]

MODEL_DIR = data_path("models")
LAYER_KINDS = ("gdn", "attn", "swa", "csa", "hca")
# The profile-table stage that times the attention core of each layer kind.
VERIFY_STAGE = {"gdn": "gdn_tree_verify", "attn": "attn_tree_verify", "swa": "v4_swa_verify",
                "csa": "v4_csa_verify", "hca": "v4_hca_verify"}
# Layer kinds whose accepted-path commit is work of its own, once per layer per round (GDN: the
# recurrent state rewritten along the accepted path; attention: the accepted rows' KV written;
# V4: window rows, compressed entries and compressor buffers refreshed), and its stage.
COMMIT_STAGE = {"gdn": "gdn_tree_commit", "attn": "attn_kv_commit", "swa": "v4_swa_commit",
                "csa": "v4_csa_commit", "hca": "v4_hca_commit"}
# Layer kinds with per-round work shared by all their layers (GDN: the tree metadata the
# kernels read), built once per round, and its profile-table stage.
ROUND_STAGE = {"gdn": "gdn_round_meta"}
# Layer kinds whose plain decoding step (one token per sequence, no tree) is a fused kernel of
# its own (GDN: the state read, updated and written once), and its profile-table stage: at
# n = 1 it stands in for the tree verify plus the commit, which read the state twice.
DECODE_STAGE = {"gdn": "gdn_decode_step"}
# A round's metadata for every layer kind at once (positions, RoPE rows, tree tables, V4 device
# plans, the commit's rows), built once per round, plain decoding included: one model-level stage.
MODEL_ROUND_STAGE = "round_meta_step"
# V4's hash-routed MoE layers (the expert ids a table lookup of the token), timed apart from
# ``mlp_step`` (the routed MoE): one model-level stage, times the number of hash layers.
HASH_MLP_STAGE = "hash_mlp_step"
_SECTION_FOR_KIND = {"gdn": "gdn", "attn": "attn", "swa": "v4", "csa": "v4", "hca": "v4"}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of one model. Dict sections hold the YAML's numbers as given."""

    name: str
    family: str
    hidden: int
    vocab: int
    layer_kinds: tuple[str, ...]
    mlp: dict
    dtype: str = "bf16"
    attn: dict = field(default_factory=dict)
    gdn: dict = field(default_factory=dict)
    v4: dict = field(default_factory=dict)
    draft: dict = field(default_factory=dict)
    source: str = ""
    deployment: str = DEFAULT_DEPLOYMENT   # the deployment whose rank this shape is ("tp=1": whole model)
    config: dict = field(default_factory=dict)   # the Hugging Face (text) config it was read from, if any

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layer_counts(self) -> dict[str, int]:
        """{kind: number of layers of that kind}, in first-appearance order."""
        return dict(Counter(self.layer_kinds))

    def kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_counts())

    def gdn_dims(self) -> dict[str, int]:
        """The GDN layer's key / value heads and dims as the kernels take them: dict(H, HV, K,
        V)."""
        g = self.gdn
        if not g:
            raise SimtreeError(f"model {self.name!r} has no GDN layers")
        return dict(H=int(g["key_heads"]), HV=int(g["value_heads"]), K=int(g["key_dim"]),
                    V=int(g["value_dim"]))

    @property
    def ranks(self) -> int:
        """GPUs of the deployment this shape is one rank of (1 for the whole model)."""
        return parse_deployment(self.deployment).gpus

    def shard(self, deployment: "str | Deployment") -> "ModelShape":
        """The shape one rank of ``deployment`` holds (see :func:`_shard`); refuses, one line,
        a split that does not divide the heads, MLP columns or experts."""
        return _shard(self, parse_deployment(deployment))

    def weight_bytes(self) -> int:
        """Bytes of the weights of this shape (target layers, embedding, LM head and the draft
        layer) at ``dtype``, with the parameters the runtime keeps in fp32 (GDN decay, V4
        attention sink, the compressors' position bias and norm, and their projections unless the form
        v4_comp keeps them at the model's dtype) at 4 bytes and FP8 experts (``mlp.expert_dtype``) at 1
        byte plus a float32 scale per 128 x 128 block: what one rank allocates."""
        return sum(n * b for n, b in _params(self))

    def cache_bytes(self, batch_size: int, context_len: int) -> int:
        """Bytes of the persistent per-sequence state of ``batch_size`` sequences at
        ``context_len`` tokens: KV cache of full attention, the V4 window ring, compressed
        entries, indexer keys and compressor buffers, GDN recurrent and conv state (draft layer
        included)."""
        return int(batch_size) * _seq_state_bytes(self, int(context_len))

    def stack(self, num_layers: int) -> tuple[str, ...]:
        """The first ``num_layers`` kinds of the pattern, skipping a prefix of one kind if the
        pattern has others later (so an 8-layer V4 stack holds SWA, CSA and HCA layers)."""
        kinds = list(self.layer_kinds)
        if num_layers >= len(kinds):
            return tuple(kinds)
        out = kinds[:num_layers]
        missing = [k for k in self.kinds() if k not in out]
        for k in missing:  # swap in one layer of each missing kind at the end
            idx = next(i for i in range(len(out) - 1, -1, -1) if out.count(out[i]) > 1)
            out[idx] = k
        return tuple(out)


def _expand_layers(spec, where: str) -> tuple[str, ...]:
    if not isinstance(spec, list) or not spec:
        raise SimtreeError(f"{where}: 'layers' must be a non-empty list of {{kinds, repeat}}")
    kinds: list[str] = []
    for seg in spec:
        if not isinstance(seg, dict) or "kinds" not in seg:
            raise SimtreeError(f"{where}: each 'layers' entry needs 'kinds' (and optional 'repeat')")
        repeat = check_int(seg.get("repeat", 1), f"{where}: layer repeat")
        for k in seg["kinds"]:
            if k not in LAYER_KINDS:
                raise SimtreeError(f"{where}: unknown layer kind {k!r} (known: {', '.join(LAYER_KINDS)})")
        kinds.extend(list(seg["kinds"]) * repeat)
    return tuple(kinds)


def load_model_file(path: str | Path) -> ModelShape:
    """Parse one model YAML (``yaml.safe_load``) into a validated :class:`ModelShape`."""
    path = Path(path)
    data = read_yaml(path, "model")
    where = path.name
    if not isinstance(data, dict):
        raise SimtreeError(f"{where}: expected a mapping at the top level")
    for key in ("name", "family", "hidden", "vocab", "layers", "mlp"):
        if key not in data:
            raise SimtreeError(f"{where}: missing key {key!r}")
    for key in ("hidden", "vocab"):
        check_int(data[key], f"{where}: {key}")
    kinds = _expand_layers(data["layers"], where)
    for kind in set(kinds):
        section = _SECTION_FOR_KIND[kind]
        if not isinstance(data.get(section), dict):
            raise SimtreeError(f"{where}: layer kind {kind!r} needs a {section!r} section")
    mlp = data["mlp"]
    if not isinstance(mlp, dict) or mlp.get("kind") not in ("dense", "moe"):
        raise SimtreeError(f"{where}: mlp.kind must be 'dense' or 'moe'")
    need = ("intermediate",) if mlp["kind"] == "dense" else ("n_experts", "experts_per_token", "expert_intermediate")
    for key in need:
        check_int(mlp.get(key), f"{where}: mlp.{key}")
    try:
        expert_dtype(mlp)
    except SimtreeError as exc:
        raise SimtreeError(f"{where}: {exc}") from None
    return ModelShape(name=str(data["name"]), family=str(data["family"]), hidden=data["hidden"],
                      vocab=data["vocab"], layer_kinds=kinds, mlp=dict(mlp),
                      dtype=str(data.get("dtype", "bf16")), attn=dict(data.get("attn") or {}),
                      gdn=dict(data.get("gdn") or {}), v4=dict(data.get("v4") or {}),
                      draft=dict(data.get("draft") or {}), source=str(path))


def shape_from_config(folder: str | Path, name: str | None = None) -> ModelShape:
    """The shape a Hugging Face config.json describes (a checkpoint folder, or a shipped
    config: ``simtree/data/models/<name>/config.json``); see ``simtree.checkpoints``."""
    from simtree.checkpoints import read_shape_fields
    fields = read_shape_fields(folder, name)
    return ModelShape(**fields, source=str(Path(folder) / "config.json"))


@functools.lru_cache(maxsize=1)
def _shipped_configs() -> tuple[str, ...]:
    """Names of the shipped Hugging Face configs (``<name>/config.json`` of a model type
    simtree.checkpoints reads; the tiny runtime's own checkpoints are not shapes)."""
    from simtree.checkpoints import FAMILIES
    out = []
    for path in MODEL_DIR.glob("*/config.json"):
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("model_type") in FAMILIES:
                out.append(path.parent.name)
        except (OSError, ValueError, AttributeError):
            continue
    return tuple(out)


def list_models() -> list[str]:
    """Names of the shipped model shapes (YAML files and Hugging Face configs)."""
    return sorted({p.stem for p in MODEL_DIR.glob("*.yaml")} | set(_shipped_configs()))


def get_model(name: str) -> ModelShape:
    """The shipped shape called ``name``, a path to a model YAML, or a checkpoint folder (its
    config.json: ``--model PATH``)."""
    if name.endswith((".yaml", ".yml")) and Path(name).exists():
        return load_model_file(name)
    if "/" not in name and name in _shipped_configs():
        return shape_from_config(MODEL_DIR / name, name)
    path = MODEL_DIR / f"{name}.yaml"
    if path.exists():
        return load_model_file(path)
    if Path(name).expanduser().is_dir():
        return shape_from_config(name)
    raise SimtreeError(f"unknown model {name!r}; known: {', '.join(list_models())} (or a model YAML, or a "
                       "checkpoint folder)")


# ---- sharding and sizes --------------------------------------------------------------------------
def _split(value: int, ways: int, what: str, shape: ModelShape, dep: Deployment) -> int:
    if value % ways:
        raise SimtreeError(f"{shape.name} at {dep}: {value} {what} do not split {ways} ways")
    return value // ways


def _shard(shape: ModelShape, dep: Deployment) -> ModelShape:
    """One rank's shape.  Tensor parallelism over t (``dep.tp``): attention heads (GQA query
    heads; KV heads too, replicated once t exceeds them, as engines do; GDN key and value
    heads; V4 query heads and output groups), dense MLP columns, each expert's columns when
    experts are not split, the shared expert's columns and the vocabulary (embedding and LM
    head, padded up) split t ways; V4's one latent KV head, its indexer and compressors stay
    whole.  Expert parallelism over e (``dep.ep``): e-th of the routed experts per rank (each
    token still picks ``experts_per_token`` of them: under uniform routing a rank's experts
    see as many (token, expert) pairs as the rank has tokens times that), attention as
    tensor parallelism over t within each data-parallel group."""
    if shape.ranks != 1:
        raise SimtreeError(f"{shape.name} is already one rank of {shape.deployment}: shard the whole model")
    t, e = dep.tp, dep.ep
    mlp, attn, gdn, v4 = dict(shape.mlp), dict(shape.attn), dict(shape.gdn), dict(shape.v4)
    if e > 1:
        if mlp["kind"] != "moe":
            raise SimtreeError(f"{shape.name} at {dep}: expert parallelism needs an MoE model; "
                               f"{shape.name} has a dense MLP (use tp=N)")
        mlp["n_experts"] = _split(int(mlp["n_experts"]), e, "routed experts", shape, dep)
        if mlp["n_experts"] < int(mlp["experts_per_token"]):
            raise SimtreeError(f"{shape.name} at {dep}: {mlp['n_experts']} experts per rank, fewer than the "
                               f"{mlp['experts_per_token']} a token picks")
    if t > 1:
        if attn:
            attn["q_heads"] = _split(int(attn["q_heads"]), t, "query heads", shape, dep)
            kv = int(attn["kv_heads"])
            attn["kv_heads"] = _split(kv, t, "KV heads", shape, dep) if t <= kv else 1
            if t > kv and t % kv:
                raise SimtreeError(f"{shape.name} at {dep}: {kv} KV heads cannot be replicated over {t} ranks")
        if gdn:
            gdn["key_heads"] = _split(int(gdn["key_heads"]), t, "GDN key heads", shape, dep)
            gdn["value_heads"] = _split(int(gdn["value_heads"]), t, "GDN value heads", shape, dep)
        if v4:
            v4["q_heads"] = _split(int(v4["q_heads"]), t, "query heads", shape, dep)
            v4["o_groups"] = _split(int(v4["o_groups"]), t, "output groups", shape, dep)
        if mlp["kind"] == "dense":
            mlp["intermediate"] = _split(int(mlp["intermediate"]), t, "MLP columns", shape, dep)
        else:
            if e == 1:
                mlp["expert_intermediate"] = _split(int(mlp["expert_intermediate"]), t, "expert columns", shape, dep)
            if mlp.get("shared_intermediate"):
                mlp["shared_intermediate"] = _split(int(mlp["shared_intermediate"]), t, "shared-expert columns",
                                                    shape, dep)
    vocab = -(-shape.vocab // t)
    return replace(shape, vocab=vocab, mlp=mlp, attn=attn, gdn=gdn, v4=v4, deployment=dep.name)


def _mixer_params(shape: ModelShape, kind: str, fp32: int) -> list[tuple[int, int]]:
    """(numel, bytes per element) of one layer's attention block of ``kind``, as the runtime
    allocates it (runtime/full: qwen.py, v4_rank.py)."""
    h = shape.hidden
    if kind == "gdn":
        g = shape.gdn
        H, HV, K, V = (int(g[k]) for k in ("key_heads", "value_heads", "key_dim", "value_dim"))
        W, conv = int(g.get("conv_kernel", 4)), 2 * H * K + HV * V
        return [((conv + HV * V) * h + 2 * HV * h + conv * W + V + h * HV * V, 0), (2 * HV, fp32)]
    if kind == "attn":
        a = shape.attn
        Hq, Hkv, D = int(a["q_heads"]), int(a["kv_heads"]), int(a["head_dim"])
        q_out = Hq * D * (2 if a.get("output_gate") else 1)
        return [(q_out * h + 2 * Hkv * D * h + 2 * D + h * Hq * D, 0)]
    v = shape.v4
    H, D, qr, G, orank = (int(v[k]) for k in ("q_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank"))
    pj = runtime_attn_proj(v)       # the attention's linears: bf16, or FP8 with their block scales (form v4_proj)

    def lin(out_f: int, in_f: int, groups: int = 1) -> list[tuple[int, int]]:
        return expert_params(out_f, in_f, pj, groups)
    out = [(qr + D, 0), *lin(qr + D, h), *lin(H * D, qr), *lin(orank, H // G * D, G), *lin(h, G * orank), (H, fp32)]
    from simtree.quant import comp_proj_storage
    proj = 0 if comp_proj_storage() == "model" else fp32      # kernels.layers.v4.comp_proj_dtype

    def compressor(dim: int, ratio: int) -> list[tuple[int, int]]:
        c = (2 if ratio == 4 else 1) * dim   # a ratio-4 compressor's windows overlap: 2x channels
        return [(2 * c * h, proj), (ratio * c + dim, fp32)]   # projections as v4_comp says; bias, norm fp32
    if kind == "csa":
        Hi, Di, r = int(v["index_heads"]), int(v["index_head_dim"]), int(v["csa_ratio"])
        out += [*compressor(D, r), *compressor(Di, r), *lin(Hi * Di, qr), (Hi * h, 0)]
    elif kind == "hca":
        out += compressor(D, int(v["hca_ratio"]))
    return out


def _mlp_params(shape: ModelShape, mlp: dict) -> list[tuple[int, int]]:
    """(numel, bytes per element; 0 = the model's dtype) of one MLP block: the router, the
    routed and shared experts at ``mlp.expert_dtype`` (FP8: 1 byte and the block scales)."""
    h = shape.hidden
    if mlp["kind"] == "dense":
        return [(3 * h * int(mlp["intermediate"]), 0)]
    E, I = int(mlp["n_experts"]), int(mlp["expert_intermediate"])
    shared = int(mlp.get("n_shared", 0)) * int(mlp.get("shared_intermediate", 0))
    xdt = expert_dtype(mlp)
    out = [(E * h, 0), *expert_params(2 * I, h, xdt, E), *expert_params(h, I, xdt, E)]
    if shared:
        out += [*expert_params(2 * shared, h, xdt), *expert_params(h, shared, xdt)]
    return out


def _params(shape: ModelShape) -> list[tuple[int, int]]:
    """(numel, bytes per element) of every weight group of the shape (the draft layer too)."""
    dt, fp32, h = DTYPE_BYTES.get(shape.dtype, 2), 4, shape.hidden
    out = [(2 * shape.vocab * h + h, dt)]
    d = shape.draft or {}
    draft_mlp = {"kind": "dense", "intermediate": d["intermediate"]} if "intermediate" in d else shape.mlp
    blocks = [(k, shape.mlp) for k in shape.layer_kinds]
    if d.get("attention"):
        blocks += [(d["attention"], draft_mlp)] * int(d.get("layers", 1))
        out.append((2 * h + 2 * h * h + h if d.get("fuse_proj") else h, dt))
    for kind, mlp in blocks:
        out.append((2 * h, dt))
        out += [(n, b or dt) for n, b in _mlp_params(shape, mlp) + _mixer_params(shape, kind, fp32)]
    if shape.family == "v4":
        out += _v4_extra_params(shape, len(blocks) - shape.num_layers)
    return out


def hash_layers(shape: ModelShape) -> tuple[int, ...]:
    """Indices of a V4 shape's hash-routed MoE layers (``v4.mlp_layer_types`` "hash_moe"; without
    it the first ``v4.num_hash_layers``, 3 by default as in transformers); () for other families."""
    if shape.family != "v4":
        return ()
    v, n = shape.v4, shape.num_layers
    types = v.get("mlp_layer_types")
    if types is None:
        return tuple(range(min(n, int(v.get("num_hash_layers", 3)))))
    return tuple(i for i, t in enumerate(types[:n]) if t == "hash_moe")


def _v4_extra_params(shape: ModelShape, draft_layers: int) -> list[tuple[int, int]]:
    """DeepSeek-V4's weights beyond the blocks' GEMMs (runtime: kernels/layers/v4.py): two
    hyper-connections a block and the final collapse (model and MTP layer), fp32; the router's
    selection bias (fp32) or, on a hash-routed layer, the token-to-expert table (int64)."""
    v, h, fp32 = shape.v4, shape.hidden, 4
    hc, n = int(v.get("hc_mult", 4)), shape.num_layers
    hashed = len(hash_layers(shape))
    E = int(shape.mlp["n_experts"])
    blocks = n + draft_layers
    hc_block = 2 * ((2 + hc) * hc * hc * h + (2 + hc) * hc + 3)
    head = hc * hc * h + hc + 1
    return [(blocks * hc_block + (1 + draft_layers) * head, fp32),
            ((blocks - hashed) * E, fp32), (hashed * shape.vocab * int(shape.mlp["experts_per_token"]), 8)]


def _seq_state_bytes(shape: ModelShape, l: int) -> int:
    """Persistent state of one sequence at context ``l`` over every layer and the draft layer
    (the runtime's caches: runtime/full/qwen.py QwenState, kernels/v4/cache.py V4Cache, and each
    model's ``new_draft_state``)."""
    dt, fp32 = DTYPE_BYTES.get(shape.dtype, 2), 4
    total = 0
    if (shape.draft or {}).get("attention"):
        # the MTP layer's cache holds every position (l + 1 rows): K and V of a Qwen attention layer,
        # V4's one latent - its SWA reads a window of it, but the runtime keeps them all
        width = int(shape.v4["head_dim"]) if shape.family == "v4" else \
            2 * int(shape.attn["kv_heads"]) * int(shape.attn["head_dim"])
        total += int(shape.draft.get("layers", 1)) * width * (l + 1) * dt
    for kind in shape.layer_kinds:
        if kind == "attn":
            a = shape.attn
            total += 2 * int(a["kv_heads"]) * int(a["head_dim"]) * (l + 1) * dt
        elif kind == "gdn":
            g = shape.gdn
            H, HV, K, V = (int(g[k]) for k in ("key_heads", "value_heads", "key_dim", "value_dim"))
            total += HV * K * V * fp32 + (2 * H * K + HV * V) * (int(g.get("conv_kernel", 4)) - 1) * dt
        else:   # V4: window ring, compressed entries, indexer keys, the compressors' partial windows
            v = shape.v4
            D, W = int(v["head_dim"]), int(v["window"])
            total += W * D * dt
            if kind in ("csa", "hca"):
                r = int(v["csa_ratio"] if kind == "csa" else v["hca_ratio"])
                slots, width = (2 * r, 2 * D) if r == 4 else (r, D)
                total += (l // r + 1) * D * dt + 2 * slots * width * fp32
            if kind == "csa":
                r, Di = int(v["csa_ratio"]), int(v["index_head_dim"])
                slots, width = (2 * r, 2 * Di) if r == 4 else (r, Di)
                total += (l // r + 1) * Di * dt + 2 * slots * width * fp32
    return total
