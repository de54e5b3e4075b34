"""``--task score``: each row's pair (``--prompt-field``, default ``text_1``; ``--pair-field``,
default ``text_2``) scored as ``LLM.score`` scores it (engine/pooling.py): a cross-encoder (a
classification head with one label) reads the pair as one prompt, the tokenizer's pair encoding,
and gives sigmoid(logit); an embedding model embeds both texts, two engine requests (``"<row>"`` and
``"<row>/2"``), and gives the cosine of the two vectors. The output field holds the score, a float.
"""
from __future__ import annotations

from typing import Optional

from pagedgen.cli.errors import BadRow
from pagedgen.engine.pooling import cosine, pair_encoding
from pagedgen.pooling_outputs import ScoringOutput, ScoringRequestOutput

#: the fields a score row's two texts are read from, unless --prompt-field / --pair-field say otherwise
DEFAULT_FIELDS = ("text_1", "text_2")


def pair_of(fields: dict, first: str, second: str) -> dict:
    """A row's pair as ``{"text_1": str, "text_2": str}``; BadRow naming the flag of a missing or non-string field."""
    pair = {}
    for key, name, flag in (("text_1", first, "--prompt-field"), ("text_2", second, "--pair-field")):
        if name not in fields:
            raise BadRow(f"no field {name!r} (fields: {', '.join(map(str, fields))}); --task score reads each row's texts "
                         f"from {flag} (default {DEFAULT_FIELDS[key == 'text_2']!r})")
        if not isinstance(fields[name], str):
            raise BadRow(f"{name} must be a string (--task score scores two texts), got {type(fields[name]).__name__}")
        pair[key] = fields[name]
    return pair


class PairScorer:
    """Adds a row's pair to the engine and turns what the engine gives back into the row's
    ``ScoringRequestOutput`` (its ``prompt_token_ids``: the pair's prompt, or both texts' joined).

    Args:
        engine: an ``LLMEngine`` of a pooling model: a cross-encoder (one label) or an embedding model.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cross = bool(engine.pooling.num_labels)
        self._halves: dict[int, dict[str, object]] = {}  # an embedding model's rows: "1" / "2" -> the finished half

    def request_ids(self, index: int) -> list[str]:
        """The engine request ids of row ``index`` (for aborting it)."""
        return [str(index)] if self.cross else [str(index), f"{index}/2"]

    def add(self, index: int, pair: dict) -> None:
        """Queue row ``index``'s pair. ValueError / TypeError from the engine's checks (a text longer
        than max_model_len, ...) with nothing left queued for the row."""
        engine = self.engine
        if self.cross:
            [(ids, start)] = pair_encoding(engine.processor.tokenizer, [pair["text_1"]], [pair["text_2"]])
            engine.add_pooling_request(str(index), {"prompt_token_ids": ids}, None, "score", token_type_start=start)
            return
        engine.add_pooling_request(str(index), pair["text_1"], None, "embed")
        try:
            engine.add_pooling_request(f"{index}/2", pair["text_2"], None, "embed")
        except BaseException:
            engine.abort_request(str(index))
            raise
        self._halves[index] = {}

    def finish(self, out) -> Optional[tuple[int, ScoringRequestOutput]]:
        """The row index and its score once ``out`` (a step's ``PoolingRequestOutput``) completes a
        row; None while an embedding model's other half is still running."""
        row, _, half = out.request_id.partition("/")
        index = int(row)
        if self.cross:
            score = ScoringOutput(float(out.outputs.data[0]))  # sigmoid(logit), as LLM.score
            return index, ScoringRequestOutput(row, score, list(out.prompt_token_ids), 0, True)
        halves = self._halves[index]
        halves[half or "1"] = out
        if len(halves) < 2:
            return None
        del self._halves[index]
        a, b = halves["1"], halves["2"]
        ids = list(a.prompt_token_ids) + list(b.prompt_token_ids)
        return index, ScoringRequestOutput(row, ScoringOutput(cosine(a.outputs.data, b.outputs.data)), ids, 0, True)

    def forget(self, indices) -> None:
        """Drop the halves kept for rows ``indices`` (aborted)."""
        for index in indices:
            self._halves.pop(index, None)

