"""Model shape registry: layer pattern and dimensions of the target models (timing only).

Shapes live as YAML in ``simtree/data/models/<name>.yaml`` (package data, read through
:func:`simtree.data.data_path`; ``scenarios/models/`` links to the same files). Only dimensions are described, never weights: the
profiler times random-weight layers at these shapes.

    shape = get_model("qwen3.6-27b")
    shape.layer_kinds        # ("gdn", "gdn", "gdn", "attn", ...)  64 entries
    shape.layer_counts()     # {"gdn": 48, "attn": 16}

Layer kinds: ``gdn`` (Gated DeltaNet), ``attn`` (full attention, GQA), ``swa`` / ``csa`` /
``hca`` (DeepSeek-V4 sliding-window-only, ratio-4 sparse, ratio-128 compressed attention).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from simtree.data import data_path
from simtree.errors import SimtreeError, check_int
from simtree.fileio import read_yaml

__all__ = ["ModelShape", "get_model", "list_models", "load_model_file", "MODEL_DIR",
           "LAYER_KINDS", "VERIFY_STAGE", "COMMIT_STAGE", "ROUND_STAGE", "DECODE_STAGE",
           "MODEL_ROUND_STAGE"]

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
_SECTION_FOR_KIND = {"gdn": "gdn", "attn": "attn", "swa": "v4", "csa": "v4", "hca": "v4"}


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
    return ModelShape(name=str(data["name"]), family=str(data["family"]), hidden=data["hidden"],
                      vocab=data["vocab"], layer_kinds=kinds, mlp=dict(mlp),
                      dtype=str(data.get("dtype", "bf16")), attn=dict(data.get("attn") or {}),
                      gdn=dict(data.get("gdn") or {}), v4=dict(data.get("v4") or {}),
                      draft=dict(data.get("draft") or {}), source=str(path))


def list_models() -> list[str]:
    """Names of the shipped model shapes."""
    return sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))


def get_model(name: str) -> ModelShape:
    """The shipped shape called ``name`` (or a path to a model YAML)."""
    if name.endswith((".yaml", ".yml")) and Path(name).exists():
        return load_model_file(name)
    path = MODEL_DIR / f"{name}.yaml"
    if not path.exists():
        raise SimtreeError(f"unknown model {name!r}; known: {', '.join(list_models())}")
    return load_model_file(path)
