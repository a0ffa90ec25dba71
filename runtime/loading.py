"""Hugging Face style checkpoints: ``config.json`` + ``model.safetensors`` (never pickle).

Config keys are :class:`ModelConfig`'s fields (Qwen3-Next naming: ``layer_types`` of
"linear_attention" / "full_attention", ``linear_num_key_heads``, ...) plus ``model_type``
"simtree_gdn_hybrid" and harmless metadata (``architectures``, ``torch_dtype``,
``num_hidden_layers`` (must equal len(layer_types)), token ids, ``transformers_version``).
Anything else is refused with a one-line SimtreeError: this loader would silently ignore a
feature the architecture lacks otherwise.  Weight names are the module paths of
:class:`HybridLM` (``embed_tokens.weight``, ``layers.0.linear_attn.in_proj_qkv.weight``, ...);
``lm_head.weight`` is omitted when tied.

The two files are written by two atomic replaces (weights first).  ``save_model`` stamps both
with one random ``simtree_save_id`` (config key and safetensors metadata); ``load_model``
refuses a folder whose weights carry an id that config.json does not (a save interrupted
between the two files).  Weights without an id (saved before it existed, or written by
other tools) load as before.
"""
from __future__ import annotations

import dataclasses
import json
import math
import uuid
from pathlib import Path

import torch

from simtree.data import data_path
from simtree.errors import SimtreeError
from simtree.fileio import write_atomic
from simtree.runtime.model import HybridLM, ModelConfig

__all__ = ["load_config", "load_model", "save_model", "read_save_ids", "saves_disagree",
           "DEFAULT_MODELS_DIR"]

ARCHITECTURE = "SimtreeHybridForCausalLM"
METADATA_KEYS = {"architectures", "torch_dtype", "num_hidden_layers", "bos_token_id", "eos_token_id",
                 "pad_token_id", "transformers_version", "_name_or_path", "simtree_training", "simtree_save_id"}
DEFAULT_MODELS_DIR = data_path("models")   # the shipped target/ and draft/ checkpoints


def _config_path(path) -> Path:
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def load_config(path) -> ModelConfig:
    """Read and validate ``config.json`` (a file or the folder holding it)."""
    return _read_config(path)[0]


def _read_config(path) -> tuple[ModelConfig, dict]:
    """``load_config``'s config and the JSON object it was read from."""
    cfg_file = _config_path(path)
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimtreeError(f"cannot read model config {cfg_file}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise SimtreeError(f"{cfg_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise SimtreeError(f"{cfg_file}: a config must be a JSON object")
    if raw.get("model_type") != "simtree_gdn_hybrid":
        raise SimtreeError(f"{cfg_file}: model_type {raw.get('model_type')!r} is not supported "
                           "(expected 'simtree_gdn_hybrid')")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields - METADATA_KEYS)
    if unknown:
        raise SimtreeError(f"{cfg_file}: unknown config key {unknown[0]!r} (this architecture does not support it)")
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in fields})
    if not isinstance(cfg.layer_types, list):
        raise SimtreeError(f"{cfg_file}: layer_types must be a list")
    try:
        cfg.validate()
    except SimtreeError as exc:
        raise SimtreeError(f"{cfg_file}: {exc}") from None
    n = raw.get("num_hidden_layers", len(cfg.layer_types))
    if n != len(cfg.layer_types):
        raise SimtreeError(f"{cfg_file}: num_hidden_layers = {n} but layer_types lists {len(cfg.layer_types)} layers")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise SimtreeError(f"{cfg_file}: {name} = {v!r} must be a positive finite number")
    return cfg, raw


def read_save_ids(path, config: dict) -> tuple | None:
    """(config.json's ``simtree_save_id``, model.safetensors' one) of a checkpoint folder,
    None for either that has none; None when the weights cannot be read.  ``config``: the
    folder's config.json as the caller read it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as fh:
            meta = fh.metadata() or {}
    except (OSError, ValueError, SafetensorError):
        return None
    return _save_ids(config, meta)


def _save_ids(config, metadata: dict) -> tuple:
    return (config.get("simtree_save_id") if isinstance(config, dict) else None), metadata.get("simtree_save_id")


def saves_disagree(ids: tuple | None) -> bool:
    """Whether ``read_save_ids``' pair shows an interrupted save: the weights carry an id that
    config.json does not."""
    return ids is not None and ids[1] is not None and ids[0] != ids[1]


def load_model(path, dtype=torch.float32) -> HybridLM:
    """Build a :class:`HybridLM` from a checkpoint folder (config.json + model.safetensors)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    cfg, raw = _read_config(path)
    weights = path / "model.safetensors"
    try:   # one read of each file: the save ids come from the config and weights loaded here
        with safe_open(str(weights), "pt") as fh:
            meta = fh.metadata() or {}
            state = {k: fh.get_tensor(k) for k in fh.keys()}
    except (OSError, SafetensorError) as exc:
        raise SimtreeError(f"cannot read weights {weights}: {exc}") from None
    if saves_disagree(_save_ids(raw, meta)):
        raise SimtreeError(f"{path}: config.json and model.safetensors come from different saves (a save was "
                           "interrupted between the two files): save or train the model again")
    model = HybridLM(cfg)
    expected = model_weights(model)   # names and shapes a save of this config holds
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        what = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {extra[0]!r}"
        raise SimtreeError(f"{weights}: {what} for this config")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise SimtreeError(f"{weights}: tensor {name!r} has shape {tuple(t.shape)}, config implies "
                               f"{tuple(expected[name].shape)}")
        if not torch.isfinite(t.float()).all():
            raise SimtreeError(f"{weights}: tensor {name!r} contains NaN or infinite values")
    model.load_state_dict(state, strict=False)
    return model.to(dtype).eval()


def model_weights(model) -> dict:
    """The weights a save holds: fp32, contiguous, without a tied lm_head (it is the
    embedding)."""
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
            if not (model.config.tie_word_embeddings and k == "lm_head.weight")}


def save_model(model: HybridLM, path, extra: dict | None = None) -> None:
    """Write model.safetensors (fp32) then config.json, each atomically (temp file +
    os.replace), both stamped with one new save id (see the module docstring)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.asdict(model.config)
    cfg.update(architectures=[ARCHITECTURE], num_hidden_layers=len(cfg["layer_types"]), torch_dtype="float32",
               bos_token_id=256, eos_token_id=257, pad_token_id=258, simtree_save_id=uuid.uuid4().hex)
    if extra:
        cfg["simtree_training"] = extra
    state = model_weights(model)
    meta = {"format": "pt", "simtree_save_id": cfg["simtree_save_id"]}
    write_atomic(path / "model.safetensors", lambda tmp: save_file(state, tmp, metadata=meta))
    text = json.dumps(cfg, indent=2) + "\n"
    write_atomic(path / "config.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
