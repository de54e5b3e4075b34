"""``LLM``'s pooling calls on its engine: ``encode``, ``embed``, ``classify``, ``score`` and
``reward`` (vLLM's names and semantics). Every prompt and its ``PoolingParams`` are checked and
tokenized first (engine/pooling_checks.py: errors name the index and the field), then the
requests run through the same scheduler and ``LLMEngine.step`` loop as generation
(``offline.run``): prefill only, chunked when long, the prefix cache shared with LAST pooling; the
worker pools each prompt once it is computed (worker/pooler.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pagedgen import inputs
from pagedgen.engine import offline
from pagedgen.engine.llm_engine import LLMEngine
from pagedgen.engine.pooling_checks import PoolingModelInfo, check_pooling_params, check_pooling_prompt
from pagedgen.pooling_outputs import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput,
)
from pagedgen.pooling_params import PoolingParams
from pagedgen.sampling_params import SamplingParams

PREFILL_ONLY = SamplingParams(max_tokens=1)  # a pooling request is never sampled: this only sizes its sequence


def info_of(engine: LLMEngine, call: str) -> PoolingModelInfo:
    """The engine's pooling model, or ValueError naming the call (a generation model)."""
    info = engine.pooling
    if info is None:
        raise ValueError(
            f"LLM.{call} needs a pooling model: this LLM generates (its model "
            "was loaded as a *ForCausalLM); load it with LLM(model, runner='pooling') (convert='embed' for embeddings) "
            "or load a *ForSequenceClassification checkpoint"
        )
    return info


def encode(engine: LLMEngine, prompts, pooling_params, task: str, use_tqdm: bool, call: str = "encode",
           token_type_starts: Optional[list] = None) -> list[PoolingRequestOutput]:
    """``LLM.encode``: one PoolingRequestOutput per prompt, in input order. ``pooling_params``:
    None, one PoolingParams for all or one per prompt. ``token_type_starts``: per prompt, where an
    encoder's token type 1 begins (a cross-encoder's pair; ``score``), or None."""
    info = info_of(engine, call)
    processor = engine.processor
    texts, ids = inputs.tokenize_prompts(processor.tokenizer, prompts, processor.vocab_size)
    if isinstance(pooling_params, (list, tuple)):
        if len(pooling_params) != len(ids):
            raise ValueError(f"pooling_params has {len(pooling_params)} entries for {len(ids)} prompts: give one, or one per prompt")
        specs = [check_pooling_params(p, task, info, f"pooling_params[{i}]") for i, p in enumerate(pooling_params)]
    else:
        specs = [check_pooling_params(pooling_params, task, info, "pooling_params")] * len(ids)
    budget = engine.scheduler_config.max_num_batched_tokens
    for i, p in enumerate(ids):
        inputs.check_prompt_length(p, processor.max_model_len, f"prompts[{i}]")
        check_pooling_prompt(p, info, budget, f"prompts[{i}]")
    requests = []
    for i, (text, p, spec) in enumerate(zip(texts, ids, specs)):
        request = processor._request(str(i), text, p, PREFILL_ONLY, i)
        boundary = token_type_starts[i] if token_type_starts and info.whole_prompt else None
        request.pooling = spec if boundary is None else dataclasses.replace(spec, token_type_start=boundary)
        requests.append(request)
    return offline.run(engine, requests, use_tqdm)


def embed(engine: LLMEngine, prompts, pooling_params, use_tqdm: bool) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput.from_base(o) for o in encode(engine, prompts, pooling_params, "embed", use_tqdm, "embed")]


def classify(engine: LLMEngine, prompts, pooling_params, use_tqdm: bool) -> list[ClassificationRequestOutput]:
    names = info_of(engine, "classify").id2label
    outputs = [ClassificationRequestOutput.from_base(o) for o in encode(engine, prompts, pooling_params, "classify", use_tqdm, "classify")]
    for out in outputs:
        probs = out.outputs.probs
        out.outputs.label = names[max(range(len(probs)), key=probs.__getitem__)]
    return outputs


def reward(engine: LLMEngine, prompts, pooling_params, use_tqdm: bool) -> list[PoolingRequestOutput]:
    """``LLM.reward``: the head over every prompt token (ALL; STEP keeps the step-tag tokens'),
    raw scores unless ``use_activation=True``: [num_tokens, num_labels] per prompt."""
    return encode(engine, prompts, pooling_params, "token_classify", use_tqdm, "reward")


def score(engine: LLMEngine, text_1, text_2, pooling_params: Optional[PoolingParams], use_tqdm: bool) -> list[ScoringRequestOutput]:
    """``LLM.score``: pairs (text_1[i], text_2[i]); one text_1 goes with every text_2. A
    cross-encoder (a classification head with one label) reads each pair as one prompt (the
    tokenizer's pair encoding) and scores it with sigmoid(logit); an embedding model embeds both
    sides and scores their cosine similarity."""
    info = info_of(engine, "score")
    firsts, seconds = _pairs(text_1, text_2)
    if info.num_labels:
        if info.num_labels != 1:
            raise ValueError(f"LLM.score: the model's classification head has {info.num_labels} labels; a cross-encoder has 1 "
                             "(use LLM.classify, or an embedding model for cosine scores)")
        encoded = pair_encoding(engine.processor.tokenizer, firsts, seconds)
        pairs = [{"prompt_token_ids": ids} for ids, _ in encoded]
        outs = encode(engine, pairs, pooling_params, "score", use_tqdm, "score", [start for _, start in encoded])
        return [ScoringRequestOutput.from_base(o) for o in outs]
    if pooling_params is not None and pooling_params.normalize is False:
        raise ValueError("LLM.score with an embedding model scores the cosine of normalised embeddings: pooling_params.normalize must not be False")
    unique = list(dict.fromkeys(firsts + seconds))  # each text embedded once
    vectors = {t: o.outputs.data for t, o in zip(unique, encode(engine, unique, pooling_params, "embed", use_tqdm, "score"))}
    results = []
    for i, (a, b) in enumerate(zip(firsts, seconds)):
        results.append(ScoringRequestOutput(str(i), ScoringOutput(cosine(vectors[a], vectors[b])), [], 0, True, i))
    return results


def cosine(u, v) -> float:
    """The cosine similarity of two embeddings (float32 [hidden] tensors) as ``score`` gives it."""
    return float((u @ v) / (u.norm() * v.norm()).clamp_min(1e-12))


def pair_encoding(tokenizer, firsts: list[str], seconds: list[str]) -> list[tuple[list[int], Optional[int]]]:
    """A cross-encoder's prompts (``score``, the command line's ``--task score``, Ray's): for each
    pair the tokenizer's pair encoding (``tokenizer(text_1, text_pair=text_2)``, special tokens
    included) and where token type 1 begins (BERT's second segment), or None when the tokenizer
    gives no token types."""
    if not firsts:
        return []
    encoded = tokenizer(firsts, text_pair=seconds)
    types = encoded.get("token_type_ids") or [None] * len(firsts)
    return [(list(ids), list(t).index(1) if t is not None and 1 in t else None) for ids, t in zip(encoded["input_ids"], types)]


def _pairs(text_1, text_2) -> tuple[list[str], list[str]]:
    """vLLM's pairing: a str or a list on each side; one text_1 with N text_2; else equal lengths."""
    sides = []
    for name, value in (("text_1", text_1), ("text_2", text_2)):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise TypeError(f"LLM.score {name} must be a str or a list of str")
        sides.append(list(items))
    a, b = sides
    if len(a) == 1 and len(b) != 1:
        a = a * len(b)
    if len(a) != len(b):
        raise ValueError(f"LLM.score text_1 and text_2 must have the same length (or text_1 one text), got {len(sides[0])} and {len(b)}")
    if not a:
        return [], []
    return a, b
