"""What ``LLM.generate``, ``LLM.chat`` and ``LLMEngine.step`` return, with vLLM's class and field names
(``vllm.outputs``, ``vllm.logprobs``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pagedgen import _repr


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: natural log of the token's probability under the raw model distribution
            (log-softmax of the logits, before penalties, temperature and top-k/top-p/min-p).
        rank: 1-based rank of the token in that distribution (1 = most likely).
        decoded_token: the token's text, or None with ``detokenize=False``.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: Per generated token: {token id: Logprob} holding the sampled token and the top-k tokens.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token: None for the first token (nothing predicts it), then as ``SampleLogprobs``.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the prompt's ``n`` completions this is (0 .. n-1).
        text: the generated text, detokenized (without the prompt); cut before a stop string, and
            without the text of an EOS/stop token, unless ``include_stop_str_in_output``.
        token_ids: the generated token ids (an EOS or stop token that ended it is included).
        cumulative_logprob: sum of the sampled tokens' logprobs; None unless ``logprobs`` was set.
        logprobs: per generated token, {token id: Logprob} (sampled token + top-k); None unless
            ``logprobs`` was set.
        finish_reason: "stop" (EOS, a stop token or a stop string) or "length" (max_tokens or
            max_model_len reached); "error" (vLLM v1's name) when it failed alone mid-generation
            and the call asked to be told (``on_error``: see ``RequestOutput.error``).
        stop_reason: the stop token id or stop string that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> _repr.Fields:
        fields = [("index", self.index), ("text", _repr.text(self.text)), ("token_ids", _repr.ids(self.token_ids))]
        if self.cumulative_logprob is not None:
            fields.append(("cumulative_logprob", _repr.number(self.cumulative_logprob)))
        if self.logprobs is not None:
            fields.append(("logprobs", _repr.logprobs(self.logprobs)))
        fields.append(("finish_reason", repr(self.finish_reason)))
        if self.stop_reason is not None:
            fields.append(("stop_reason", repr(self.stop_reason)))
        return fields

    def __repr__(self) -> str:
        """Short: long texts and token lists are cut, logprobs summarised (fields stay complete)."""
        return _repr.render("CompletionOutput", self._fields())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        _repr.pretty(p, "CompletionOutput", self._fields(), cycle)


@dataclass
class RequestOutput:
    """The result of one prompt, in the order the prompts were given.

    Attributes:
        request_id: the request's id: its index in the ``generate`` / ``chat`` / ``generate_stream``
            call as a string, or the id given to ``LLMEngine.add_request``.
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the prompt's token ids as fed to the model.
        prompt_logprobs: per prompt token, {token id: Logprob} (the prompt token + top-k); the
            first entry is None. None unless ``prompt_logprobs`` was set.
        outputs: the completions, ordered by ``index``.
        finished: True once every completion has finished.
        num_cached_tokens: prompt tokens found in the prefix cache (not recomputed).
        index: the prompt's position in the ``generate`` / ``chat`` / ``generate_stream`` input
            (None for requests added with ``LLMEngine.add_request``).
        error: why a completion failed mid-generation (a structured-output grammar at a dead end
            or over a parser limit: llguidance's message), when the call passed
            ``on_error="return"`` (or ``"raise"``, which raises it instead); that completion's
            ``finish_reason`` is then "error", its tokens those generated before. None otherwise.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs] = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    index: Optional[int] = None
    error: Optional[str] = None

    def _fields(self) -> _repr.Fields:
        fields: _repr.Fields = [("request_id", repr(self.request_id))]
        if self.index is not None:
            fields.append(("index", self.index))
        fields += [("prompt", _repr.text(self.prompt)), ("prompt_token_ids", _repr.ids(self.prompt_token_ids))]
        if self.prompt_logprobs is not None:
            fields.append(("prompt_logprobs", _repr.logprobs(self.prompt_logprobs)))
        fields += [("outputs", list(self.outputs)), ("finished", self.finished)]
        if self.num_cached_tokens:
            fields.append(("num_cached_tokens", self.num_cached_tokens))
        if self.error is not None:
            fields.append(("error", repr(self.error)))
        return fields

    def __repr__(self) -> str:
        """Short: long prompts, texts and token lists are cut (the fields themselves stay complete)."""
        return _repr.render("RequestOutput", self._fields())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        _repr.pretty(p, "RequestOutput", self._fields(), cycle)
