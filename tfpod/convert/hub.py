"""Hugging Face model folders as published on the Hub: config.json plus safetensors.

A folder holds `model.safetensors`, or shards named by `model.safetensors.index.json`
(its `weight_map`: tensor name -> file). `HubFolder` reads one tensor at a time
(safetensors maps the file; only the tensor asked for is read), so a checkpoint larger
than host memory is never loaded whole. `write_folder` writes config.json and the
tensors, sharded above `max_shard_bytes` with an index as transformers writes it, each
file marked `{"format": "pt"}` (PyTorch names and layouts, what transformers expects).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np

from tfpod import UserError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HubFolder:
    """A Hugging Face model folder on disk.

    Raises:
      UserError: no config.json, no safetensors (or only PyTorch .bin files), or an
        index naming a missing file.
    """

    def __init__(self, path: str):
        self.path = path
        self._files_open = {}  # file name -> its open safetensors handle (the header read once)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise UserError(f"--hf={path}: no config.json there; pass a Hugging Face model folder (config.json and "
                            f"model.safetensors, as downloaded from the Hub)")
        with open(config_path) as f:
            self.config = json.load(f)
        if os.path.isfile(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX)) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(path, SINGLE)):
            self.files = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            bins = [f for f in os.listdir(path) if f.endswith(".bin")]
            hint = (f" (it has PyTorch {', '.join(sorted(bins)[:2])}: convert them to safetensors, e.g. with "
                    "transformers' save_pretrained(safe_serialization=True))") if bins else ""
            raise UserError(f"--hf={path}: no {SINGLE} or {INDEX}{hint}")
        for name in sorted(set(self.files.values())):
            if not os.path.isfile(os.path.join(path, name)):
                raise UserError(f"--hf={path}: {INDEX} names {name}, which is missing")

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def read(self, name: str) -> np.ndarray:
        """One tensor, as a numpy array (float32 for any floating dtype)."""
        value = self._open(self.files[name]).get_tensor(name)
        return value.astype(np.float32) if np.issubdtype(value.dtype, np.floating) else value

    def _open(self, file: str):
        """The file's safetensors handle (it maps the file: a read copies one tensor out)."""
        if file not in self._files_open:
            from safetensors import safe_open

            path = os.path.join(self.path, file)
            try:
                self._files_open[file] = safe_open(path, framework="np")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise UserError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
        return self._files_open[file]


def write_folder(path: str, config: dict, tensors: Iterable[tuple[str, np.ndarray]],
                 max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Writes config.json and the tensors (name, array) into folder `path`; returns the files.

    Tensors are gathered into shards of at most max_shard_bytes (one tensor larger than
    that gets a shard of its own); more than one shard gets an index.
    """
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    shards, current, size = [], {}, 0
    for name, value in tensors:
        value = np.ascontiguousarray(value)
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in shard})
        total += sum(v.nbytes for v in shard.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return files + [INDEX]
