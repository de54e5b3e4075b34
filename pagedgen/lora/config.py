"""``LoRAConfig``: the adapter limits of one ``LLM`` (vLLM's ``LoRAConfig`` fields), checked once."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRAConfig:
    """Attributes:
        max_loras: adapter slots on the device: the most distinct adapters one step runs (the
            scheduler keeps a request waiting while its adapter would be one more).
        max_lora_rank: the largest rank ``r`` an adapter may have (slots are this wide).
        max_cpu_loras: adapters kept loaded in host memory (LRU), >= ``max_loras``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    @classmethod
    def from_args(cls, max_loras, max_lora_rank, max_cpu_loras: Optional[int]) -> "LoRAConfig":
        """The checked config of ``LLM(enable_lora=True, max_loras=, max_lora_rank=, max_cpu_loras=)``:
        TypeError (not an int) / ValueError (< 1, or ``max_cpu_loras`` < ``max_loras``) naming the field."""
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank), ("max_cpu_loras", max_cpu_loras)):
            if value is None and name == "max_cpu_loras":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"LLM {name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"LLM {name} must be >= 1, got {value}")
        cpu = int(max_loras) if max_cpu_loras is None else int(max_cpu_loras)
        if cpu < max_loras:
            raise ValueError(f"LLM max_cpu_loras must be >= max_loras ({max_loras}), got {cpu}")
        return cls(int(max_loras), int(max_lora_rank), cpu)
