"""What ``LLM.generate`` returns, with vLLM's class and field names (``vllm.outputs``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the prompt's completions this is (0 for n=1).
        text: the generated text, detokenized (without the prompt).
        token_ids: the generated token ids (an EOS or stop token that ended it is included).
        finish_reason: "stop" (EOS or a stop token) or "length" (max_tokens or max_model_len reached).
        stop_reason: the stop token id that ended it, None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt, in the order the prompts were given.

    Attributes:
        request_id: the request's id (its index in the ``generate`` call, as a string).
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the prompt's token ids as fed to the model.
        outputs: the completions.
        finished: True once every completion has finished.
        num_cached_tokens: prompt tokens found in the prefix cache (not recomputed).
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
