"""The files of a Hugging Face checkpoint folder, read and checked before any weight is.

    config = read_config(folder)              # config.json as a dict
    index = read_index(folder)                # {key: TensorInfo} over model.safetensors or its shards
    tensor = TensorReader()(index["lm_head.weight"])

A safetensors file is an 8-byte little-endian header length, a JSON header ``{key: {dtype,
shape, data_offsets: [begin, end]}, "__metadata__": {...}}`` and the data; every header is read
and checked against the file's size (a truncated download is refused by name) before a tensor
is read, so a bad folder is refused before anything is loaded.  A sharded checkpoint's
``model.safetensors.index.json`` maps each key to its shard (``weight_map``); a shard it names
that is missing is refused, as is a key the index puts in one shard that the shard lacks.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from simtree.errors import SimtreeError

__all__ = ["TensorInfo", "TensorReader", "read_config", "read_index", "DTYPE_BYTES", "SINGLE", "INDEX"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Bytes per element of the safetensors dtypes a checkpoint of these families holds.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I64": 8,
               "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its file, dtype (safetensors name), shape and byte range in the
    file (absolute offsets)."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_config(folder: Path) -> dict:
    """config.json of ``folder`` as a dict; one line when the folder or the file is missing or
    the file is not a JSON object."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SimtreeError(f"checkpoint folder {folder} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise SimtreeError(f"{folder} is not a Hugging Face checkpoint: it has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise SimtreeError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise SimtreeError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise SimtreeError(f"{path}: expected a JSON object at the top level")
    return config


def _header(path: Path) -> tuple[dict, int]:
    """(header, offset of the data) of one safetensors file, checked against its size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SimtreeError(f"{path.name} is truncated: {size} bytes, shorter than a safetensors header")
            n = struct.unpack("<Q", head)[0]
            if n > _MAX_HEADER or 8 + n > size:
                raise SimtreeError(f"{path.name} is truncated or not safetensors: header of {n} bytes in a "
                                   f"file of {size}")
            raw = f.read(n)
    except OSError as exc:
        raise SimtreeError(f"cannot read {path}: {exc.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SimtreeError(f"{path.name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise SimtreeError(f"{path.name} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + n


def _file_tensors(path: Path) -> dict[str, TensorInfo]:
    header, start = _header(path)
    size = path.stat().st_size
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = str(meta["dtype"]), tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SimtreeError(f"{path.name}: malformed header entry for tensor {key!r}") from None
        if dtype not in DTYPE_BYTES:
            raise SimtreeError(f"{path.name}: tensor {key!r} has dtype {dtype}, which simtree does not read")
        if int(e) - int(b) != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise SimtreeError(f"{path.name}: tensor {key!r} spans {int(e) - int(b)} bytes, not the "
                               f"{math.prod(shape) * DTYPE_BYTES[dtype]} of {dtype} {list(shape)}")
        if start + int(e) > size:
            raise SimtreeError(f"{path.name} is truncated: tensor {key!r} ends at byte {start + int(e)}, "
                               f"the file has {size}")
        out[key] = TensorInfo(key, path, dtype, shape, start + int(b), start + int(e))
    return out


def read_index(folder: Path) -> dict[str, TensorInfo]:
    """{key: TensorInfo} of every tensor of the checkpoint in ``folder``: model.safetensors, or
    the shards model.safetensors.index.json names (each header read and checked)."""
    folder = Path(folder)
    index_path = folder / INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise SimtreeError(f"{index_path} is not a safetensors index (no 'weight_map' object)") from None
        shards = sorted(set(map(str, weight_map.values())))
        for shard in shards:
            if not (folder / shard).is_file():
                raise SimtreeError(f"{INDEX} names shard {shard}, which is missing from {folder}")
        out: dict[str, TensorInfo] = {}
        for shard in shards:
            tensors = _file_tensors(folder / shard)
            for key, info in tensors.items():
                if weight_map.get(key, shard) != shard:
                    raise SimtreeError(f"tensor {key!r} is in {shard} but {INDEX} puts it in {weight_map[key]}")
                out[key] = info
        for key, shard in weight_map.items():
            if key not in out:
                raise SimtreeError(f"{INDEX} puts tensor {key!r} in {shard}, which does not hold it")
        return out
    if (folder / SINGLE).is_file():
        return _file_tensors(folder / SINGLE)
    raise SimtreeError(f"{folder} has no weights: neither {SINGLE} nor {INDEX}")


class TensorReader:
    """Reads tensors on the host (torch), each file opened once (safetensors maps it)."""

    def __init__(self):
        self._open: dict[Path, object] = {}

    def __call__(self, info: TensorInfo):
        from safetensors import safe_open
        f = self._open.get(info.file)
        if f is None:
            f = self._open[info.file] = safe_open(str(info.file), framework="pt")
        return f.get_tensor(info.key)
