"""HF model directories: ``config.json`` + ``*.safetensors``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class HFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config = self.path / "config.json"
        if not config.is_file():
            raise ValueError(f"{self.path}: not a model directory (no config.json)")
        try:
            self.config = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config}: invalid JSON ({e})") from None
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{self.path}: no *.safetensors weights")

    def hf_config(self) -> dict[str, Any]:
        return self.config

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        yield name, f.get_tensor(name)
            except Exception as e:
                raise ValueError(f"{file}: cannot read safetensors ({e})") from None
