"""Hugging Face checkpoint folders: ``config.json`` gives the model's shape, the safetensors files
its weights, under the names the full-scale runtime uses.

    ckpt = open_checkpoint("~/models/Qwen3.6-27B")    # config.json + every shard's header, checked
    fields = ckpt.shape_fields()                       # ModelShape's fields (simtree.models.get_model(path))
    weights, notes = ckpt.load(shape, torch.bfloat16, "cuda")  # {runtime name: tensor}, checked before read

Model types: ``qwen3_5`` (the published Qwen3.5 / 3.6 vision-language wrapper: its
``text_config`` and ``model.language_model.*`` weights; the vision tower is left), ``qwen3_5_text``
(``Qwen3_5ForCausalLM.save_pretrained``), ``deepseek_v4``.  Everything a folder can get wrong
is refused, one line naming it, before any weight is read: no config.json, an unknown
model_type, a config field missing, a missing or extra tensor, a wrong shape or dtype, a
truncated file, an index naming a missing shard.

Family modules
--------------
One module per family (``qwen3_5.py``, ``deepseek_v4.py``) with this interface; the package
dispatches on ``config["model_type"]`` through :data:`FAMILIES` and does the file work
(headers, checks, reading) itself:

``MODEL_TYPES: tuple[str, ...]``
    the ``model_type`` values the module reads.
``text_config(config: dict) -> dict``
    the language model's config (a VL wrapper's ``text_config``; else ``config``).
``shape_fields(config: dict, name: str) -> dict``
    keyword arguments of :class:`simtree.models.ModelShape` (name, family, hidden, vocab,
    layer_kinds, mlp, dtype, attn, gdn, v4, draft, config: the text config itself), read from the
    text config; a missing field -> ``missing_field(config, key)`` (one line).
``tensor_plan(config: dict, shape) -> TensorPlan``
    every checkpoint key the runtime reads for ``shape`` (a ModelShape, possibly one rank of a
    deployment: an expert-parallel rank lists only its own experts), with its expected shape
    and dtypes; groups of keys that may be absent together (``optional``: the MTP layer, the
    only group a checkpoint may lack: the runtime then drafts with a random one and says so); keys
    to skip (``ignore``: a vision tower, other ranks' experts).
``runtime_weights(config: dict, shape, read, dtype) -> dict[str, torch.Tensor]``
    the runtime's weights (names as ``simtree.runtime.full``'s ``param_specs(shape)``) from
    ``read(key)`` (a checkpoint tensor, as stored, on the target device); only planned keys are read;
    an absent optional group is simply not read (its runtime weights left out: the runtime
    initialises them at random and says so).

Weights that are not checkpoint tensors (derived once, e.g. fused projections) are the family
module's business; the runtime checks every returned tensor against its parameter list.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from simtree.errors import SimtreeError

from .files import TensorInfo, TensorReader, read_config, read_index

__all__ = ["Checkpoint", "TensorPlan", "open_checkpoint", "read_shape_fields", "missing_field", "FAMILIES",
           "FLOAT_DTYPES", "TensorInfo"]

# model_type -> family module (simtree.checkpoints.<module>)
FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
            "deepseek_v4": "deepseek_v4"}
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass
class TensorPlan:
    """The checkpoint keys a runtime model reads: ``required`` {key: shape}; ``optional``
    {group: {key: shape}} (a group is read whole or not at all); ``dtypes`` {key: allowed
    safetensors dtypes} where not FLOAT_DTYPES; ``ignore(key)`` True for keys that are in the
    checkpoint but not read (anything else unplanned is an error); ``companions(key)`` True for
    unplanned keys read with a planned tensor where present (an FP8 weight's block scales)."""

    required: dict[str, tuple[int, ...]]
    optional: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ignore: Callable[[str], bool] = lambda key: False
    companions: Callable[[str], bool] = lambda key: False


def missing_field(config: dict, key: str, where: str = "config.json"):
    """``config[key]``, or a one-line SimtreeError naming the missing field."""
    if key not in config or config[key] is None:
        raise SimtreeError(f"{where} lacks {key!r}, which the model needs")
    return config[key]


def _family(model_type):
    name = FAMILIES.get(model_type)
    if name is None:
        raise SimtreeError(f"unknown model_type {model_type!r} in config.json (simtree reads "
                           f"{', '.join(sorted(FAMILIES))})")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{name}":
            raise SimtreeError(f"model_type {model_type!r}: this simtree has no checkpoint reader for it yet") from None
        raise


class Checkpoint:
    """One checkpoint folder: its config, family module and tensor index (headers only)."""

    def __init__(self, path: Path, config: dict, index: dict[str, TensorInfo]):
        self.path, self.config, self.index = path, config, index
        self.model_type = config.get("model_type")
        self.family = _family(self.model_type)

    @property
    def name(self) -> str:
        return self.path.name

    def text_config(self) -> dict:
        return self.family.text_config(self.config)

    def shape_fields(self) -> dict:
        return self.family.shape_fields(self.config, self.name)

    def check(self, shape) -> tuple[dict[str, TensorInfo], list[str]]:
        """The planned tensors present ({key: info}) after checking every key, shape and dtype;
        notes (absent optional groups).  One line on the first problem."""
        plan = self.family.tensor_plan(self.config, shape)
        planned = dict(plan.required)
        for keys in plan.optional.values():
            planned.update(keys)
        for key in sorted(self.index):
            if key not in planned and not plan.ignore(key):
                raise SimtreeError(f"{self.name}: unexpected tensor {key!r} (not part of a "
                                   f"{self.model_type} model of this config)")
        missing = sorted(k for k in plan.required if k not in self.index)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise SimtreeError(f"{self.name}: tensor {missing[0]!r}{more} missing from the checkpoint")
        notes, present = [], {k: self.index[k] for k in plan.required}
        for group, keys in plan.optional.items():
            have = [k for k in keys if k in self.index]
            if not have:
                notes.append(group)
                continue
            lacking = sorted(k for k in keys if k not in self.index)
            if lacking:
                raise SimtreeError(f"{self.name}: tensor {lacking[0]!r} of the {group} missing from the checkpoint")
            present.update({k: self.index[k] for k in keys})
        present.update({k: info for k, info in self.index.items() if k not in planned and plan.companions(k)})
        for key, info in present.items():
            if key not in planned:
                continue
            if tuple(info.shape) != tuple(planned[key]):
                raise SimtreeError(f"{self.name}: tensor {key!r} has shape {list(info.shape)}, the config "
                                   f"needs {list(planned[key])}")
            allowed = plan.dtypes.get(key, FLOAT_DTYPES)
            if info.dtype not in allowed:
                raise SimtreeError(f"{self.name}: tensor {key!r} has dtype {info.dtype}, expected "
                                   f"{' or '.join(allowed)}")
        return present, notes

    def load(self, shape, dtype, device="cpu") -> tuple[dict, list[str]]:
        """({runtime name: tensor on ``device``}, absent optional groups) for ``shape`` at
        ``dtype``, every check done before the first tensor is read.  Each checkpoint tensor
        goes to ``device`` as it is read (the host holds one at a time, not the model)."""
        present, notes = self.check(shape)
        reader = TensorReader()

        def read(key: str):
            if key not in present:
                raise KeyError(key)
            return reader(present[key]).to(device)
        return self.family.runtime_weights(self.config, shape, read, dtype), notes


def _model_type(path: Path, config: dict):
    if "model_type" not in config:
        raise SimtreeError(f"{path / 'config.json'} lacks 'model_type'")
    return config["model_type"]


def read_shape_fields(path, name: str | None = None) -> dict:
    """ModelShape's fields from the config.json of folder ``path`` alone (no weights needed:
    a shipped config, or a checkpoint whose shape is all a command needs)."""
    path = Path(path).expanduser()
    config = read_config(path)
    return _family(_model_type(path, config)).shape_fields(config, name or path.name)


def open_checkpoint(path) -> Checkpoint:
    """The checkpoint folder ``path``: config.json read, model_type known, every safetensors
    header read and checked (one line on the first problem; no weight read yet)."""
    path = Path(path).expanduser()
    config = read_config(path)
    _family(_model_type(path, config))
    return Checkpoint(path, config, read_index(path))
