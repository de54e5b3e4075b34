"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

Plain data, no torch: the scheduler reads ``lora_int_id`` (the prefix cache's key and the count of
distinct adapters a step may run) and the worker loads ``lora_path``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: ``LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))``.

    Attributes:
        lora_name: a name for messages and outputs.
        lora_int_id: the adapter's id, an int >= 1, unique per adapter for the life of an ``LLM``
            (the prefix cache keys blocks by it; one id given two paths is a ValueError).
        lora_path: a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``
            or ``adapter_model.bin``), as ``save_pretrained`` writes it.

    Raises:
        TypeError: a field of the wrong type (``lora_int_id`` an int, the others str / path).
        ValueError: ``lora_int_id`` < 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str):
            raise TypeError(f"LoRARequest lora_name must be a str, got {type(self.lora_name).__name__}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"LoRARequest {self.lora_name!r} lora_int_id must be an int, got {type(self.lora_int_id).__name__}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r} lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
        if not isinstance(self.lora_path, (str, os.PathLike)):
            raise TypeError(f"LoRARequest {self.lora_name!r} lora_path must be a folder path, got {type(self.lora_path).__name__}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def adapter_id(self) -> int:
        """vLLM's other name of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
