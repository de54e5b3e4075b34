"""What every reader of a checkpoint folder shares: ``CheckpointError`` and ``read_json``.

Imported by ``loader`` (config.json, generation_config.json) and ``weights`` (the safetensors index),
so that the two import one way: ``loader`` -> ``weights`` -> ``files``.
"""
from __future__ import annotations

import json


class CheckpointError(ValueError):
    """A checkpoint file exists but cannot be used (not JSON, a truncated or corrupt safetensors
    file, fields missing...). ``path`` is the file (or folder) at fault."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path


def read_json(file: str) -> dict:
    """The JSON object in ``file``; CheckpointError naming it when it is not one."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(file, f"is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(file, f"must hold a JSON object, got {type(data).__name__}")
    return data
