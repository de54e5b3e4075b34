"""``LLMPredictor``: pagedgen generation as a Ray Data ``map_batches`` step over an actor pool
(``pip install -e .[ray]``; docs/integrations.md, examples/ray_data.py).

    import ray
    from pagedgen.integrations.ray import LLMPredictor

    ds = ray.data.read_json("prompts.jsonl")                    # rows with a "prompt" column
    out = ds.map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=DIR, sampling_params=dict(temperature=0, max_tokens=64), max_num_seqs=64),
        batch_size=64, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)

This is the shape of vLLM's ``ray.data.llm`` processors (an actor pool, one engine per actor, each
batch generated in one call): each actor builds one ``LLM``; each batch is validated row by row
first, so a bad row gets an ``error`` text (and an empty ``generated_text``) instead of failing the
batch or killing the actor; the valid rows go to the engine in one ``generate`` call. Every input
column is kept; added columns: ``generated_text``, ``num_prompt_tokens``, ``num_generated_tokens``,
``finish_reason`` and ``error`` ("" when the row went through). Rows come back in batch order
(Ray Data itself does not keep dataset order unless asked: ``DataContext.execution_options.preserve_order``).
"""
from __future__ import annotations

from typing import Optional, Union

import jinja2
import numpy as np

from pagedgen import inputs
from pagedgen.engine.pooling import pair_encoding
from pagedgen.engine_args import EngineArgs
from pagedgen.lora.request import LoRARequest
from pagedgen.sampling_args import sampling_params_from_dict
from pagedgen.sampling_params import SamplingParams

#: the columns LLMPredictor adds to each batch.
OUTPUT_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "error")
#: with a pooling model (``task``, docs/pooling.md): the task's columns, then num_prompt_tokens and error
POOLING_COLUMNS = {"embed": ("embedding",), "classify": ("probs", "label"), "reward": ("reward",), "score": ("score",)}
_POOLING_TASKS = {"embed": "embed", "classify": "classify", "reward": "token_classify"}


class LLMPredictor:
    """A callable class for ``Dataset.map_batches``: ``dict[str, np.ndarray] -> dict[str, np.ndarray]``.

    Args:
        model: checkpoint folder, as seen from every node of the cluster.
        sampling_params: a ``SamplingParams`` or a dict of its fields (strings are converted);
            default vLLM's defaults. ``n`` must be 1 (one row in, one row out).
        prompt_column: column of prompt texts (tokenized with special tokens, as ``LLM.generate``).
        messages_column: column of conversations (lists of {"role", "content"}), rendered with the
            tokenizer's chat template (or ``chat_template``) and a generation prompt, as ``LLM.chat``.
        token_ids_column: column of prompt token-id lists.
            Each batch must hold exactly one of these three columns.
        chat_template: a Jinja template for ``messages_column`` instead of the tokenizer's.
        task: "generate" (the default), or with a pooling model (``convert="embed"``, a
            ``*ForSequenceClassification`` or ``BertModel`` checkpoint; docs/pooling.md) "embed"
            (column ``embedding``: a float32 array per row), "classify" (``probs`` and the top
            ``label``) or "reward" (``reward``: [num_tokens, num_labels] per row), each with
            ``num_prompt_tokens`` and ``error``; a bad row's result is None. Conversations are
            rendered without a generation prompt then. ``sampling_params`` must be None. "score":
            each row's ``prompt_column`` (default ``text_1`` then) and ``pair_column`` texts scored
            as ``LLM.score`` does (a cross-encoder's sigmoid(logit) or the cosine of two embeddings;
            column ``score``).
        pair_column: with ``task="score"``, the column of each row's second text.
        lora_request: a ``LoRARequest`` (or a dict of its fields) every row runs with (docs/lora.md);
            it turns on ``enable_lora`` unless ``llm_kwargs`` says otherwise.
        **llm_kwargs: ``LLM``'s keyword arguments (``EngineArgs`` fields: dtype, max_num_seqs,
            max_model_len, kv_cache_memory_bytes, device, seed, ...); strings are converted.

    Raises:
        ValueError / TypeError: a bad argument (unknown ``llm_kwargs`` key, bad sampling field,
            ``n`` > 1), when the actor starts; whatever ``LLM`` refuses. In ``__call__``: a batch
            with none or several of the input columns, or one that already has an output column.
            A bad *row* is never an exception: it gets its ``error`` text.
    """

    def __init__(
        self,
        model: str,
        sampling_params: Union[SamplingParams, dict, None] = None,
        *,
        prompt_column: Optional[str] = None,
        messages_column: str = "messages",
        token_ids_column: str = "prompt_token_ids",
        chat_template: Optional[str] = None,
        task: str = "generate",
        pair_column: str = "text_2",
        lora_request=None,
        **llm_kwargs,
    ) -> None:
        if task not in ("generate",) + tuple(POOLING_COLUMNS):
            raise ValueError(f"LLMPredictor task must be one of {('generate',) + tuple(POOLING_COLUMNS)}, got {task!r}")
        if task != "generate" and sampling_params is not None:
            raise ValueError(f"LLMPredictor task={task!r} pools: sampling_params must be None")
        self.task = task
        if sampling_params is None:
            sampling_params = SamplingParams()
        elif isinstance(sampling_params, dict):
            sampling_params = sampling_params_from_dict(sampling_params, where="LLMPredictor sampling_params")
        elif not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"LLMPredictor sampling_params must be a SamplingParams or a dict, got {type(sampling_params).__name__}")
        if sampling_params.n != 1:
            raise ValueError(f"LLMPredictor sampling_params.n must be 1 (one row in, one row out), got {sampling_params.n}: repeat rows instead")
        self.sampling_params = sampling_params
        if prompt_column is None:
            prompt_column = "text_1" if task == "score" else "prompt"
        self.columns = {"prompt": prompt_column, "messages": messages_column, "token_ids": token_ids_column}
        self.pair_column = pair_column
        self.chat_template = chat_template
        if isinstance(lora_request, dict):  # from a Ray job's JSON config
            lora_request = LoRARequest(**lora_request)
        if lora_request is not None:
            llm_kwargs.setdefault("enable_lora", True)
        self.llm = EngineArgs.from_dict({"model": model, **llm_kwargs}).create_llm()
        self.tokenizer = self.llm.tokenizer
        self.lora_request = self.llm.processor.loras.check_one(lora_request, "LLMPredictor")  # ValueError naming the adapter, at start

    # ----- one row -------------------------------------------------------------------------------
    def _prompt_ids(self, kind: str, value) -> list[int]:
        """Token ids of one row's input. Raises TypeError / ValueError for a bad row."""
        llm = self.llm
        vocab = llm.model_config.vocab_size
        if kind == "prompt":
            if not isinstance(value, str):
                raise TypeError(f"the prompt must be a str, got {type(value).__name__}")
            return inputs.tokenize_prompts(self.tokenizer, [value], vocab)[1][0]
        if kind == "token_ids":
            if isinstance(value, np.ndarray):
                value = value.tolist()
            return inputs.tokenize_prompts(self.tokenizer, [value], vocab)[1][0]
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or not value:
            raise TypeError(f"the messages must be a non-empty list of {{'role', 'content'}} dicts, got {type(value).__name__}")
        conversation = []
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {j} must be a dict with str 'role' and 'content', got {m!r}")
            conversation.append({"role": str(m["role"]), "content": str(m["content"])})
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: give LLMPredictor(chat_template=...)")
        try:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=self.task == "generate")
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template failed: {exc}") from None
        return inputs.fill_empty(self.tokenizer, [list(self.tokenizer(text, add_special_tokens=False)["input_ids"])])[0]

    def _check_row(self, kind: str, value) -> list[int]:
        ids = self._prompt_ids(kind, value)
        cfg = self.llm.scheduler_config
        if self.task != "generate":
            inputs.check_prompt_length(ids, cfg.max_model_len, "the prompt")
            if self.llm.llm_engine.pooling.whole_prompt and len(ids) > cfg.max_num_batched_tokens:
                raise ValueError(f"the prompt has {len(ids)} tokens; an encoder computes it in one step: at most max_num_batched_tokens={cfg.max_num_batched_tokens}")
            return ids
        inputs.check_sampling_params([ids], self.sampling_params, self.llm.model_config.vocab_size, cfg.max_model_len, cfg.max_num_seqs)
        return ids

    # ----- one batch -----------------------------------------------------------------------------
    def _input_kind(self, batch: dict) -> str:
        if self.task == "score":
            missing = [c for c in (self.columns["prompt"], self.pair_column) if c not in batch]
            if missing:
                raise ValueError(f"LLMPredictor task='score' reads the columns {self.columns['prompt']!r} and {self.pair_column!r}; "
                                 f"the batch lacks {missing} (columns: {sorted(batch)})")
        present = [kind for kind, col in self.columns.items() if col in batch]
        if len(present) != 1:
            names = [self.columns[k] for k in present] or list(self.columns.values())
            raise ValueError(
                f"LLMPredictor needs exactly one input column in each batch, of {list(self.columns.values())}; "
                f"the batch has {'none' if not present else names} (columns: {sorted(batch)})"
            )
        added = OUTPUT_COLUMNS if self.task == "generate" else POOLING_COLUMNS[self.task] + ("num_prompt_tokens", "error")
        clash = sorted(set(added) & set(batch))
        if clash:
            raise ValueError(f"LLMPredictor would overwrite the batch's column(s) {clash}: rename them first")
        return present[0]

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Generate for every row of ``batch`` (columns of equal length); returns the batch's
        columns plus ``OUTPUT_COLUMNS``, row for row."""
        kind = self._input_kind(batch)
        if self.task == "score":
            return self._scored(batch)
        values = batch[self.columns[kind]]
        num_rows = len(values)
        errors = [""] * num_rows
        valid, prompts = [], []
        for i, value in enumerate(values):
            try:
                prompts.append(self._check_row(kind, value))
                valid.append(i)
            except (TypeError, ValueError) as exc:  # pagedgen.inputs names the one-prompt list's item
                errors[i] = f"{type(exc).__name__}: {exc}".replace("prompts[0]", "the prompt")
        if self.task != "generate":
            return self._pooled(batch, valid, prompts, errors)
        texts, reasons = [""] * num_rows, [""] * num_rows
        num_prompt, num_generated = [0] * num_rows, [0] * num_rows
        outputs = self.llm.generate(prompts, self.sampling_params, use_tqdm=False, lora_request=self.lora_request) if prompts else []
        for i, out in zip(valid, outputs):
            completion = out.outputs[0]
            texts[i], reasons[i] = completion.text, completion.finish_reason or ""
            num_prompt[i], num_generated[i] = len(out.prompt_token_ids), len(completion.token_ids)
        result = dict(batch)
        result["generated_text"] = np.array(texts, dtype=object)
        result["num_prompt_tokens"] = np.array(num_prompt, dtype=np.int64)
        result["num_generated_tokens"] = np.array(num_generated, dtype=np.int64)
        result["finish_reason"] = np.array(reasons, dtype=object)
        result["error"] = np.array(errors, dtype=object)
        return result

    def _scored(self, batch: dict) -> dict:
        """``task="score"``: each row's pair scored (the valid rows in one ``LLM.score`` call); a row
        whose texts are not strings or do not fit max_model_len gets its ``error``."""
        firsts, seconds = batch[self.columns["prompt"]], batch[self.pair_column]
        num_rows = len(firsts)
        errors, scores, num_prompt = [""] * num_rows, [None] * num_rows, [0] * num_rows
        valid = []
        pooling, max_len = self.llm.llm_engine.pooling, self.llm.scheduler_config.max_model_len
        for i, (a, b) in enumerate(zip(firsts, seconds)):
            try:
                for name, text in ((self.columns["prompt"], a), (self.pair_column, b)):
                    if not isinstance(text, str):
                        raise TypeError(f"{name} must be a str, got {type(text).__name__}")
                if pooling.num_labels:  # a cross-encoder reads the pair as one prompt
                    [(ids, _)] = pair_encoding(self.tokenizer, [a], [b])
                    inputs.check_prompt_length(ids, max_len, "the pair")
                    num_prompt[i] = len(ids)
                else:
                    num_prompt[i] = sum(len(self._check_row("prompt", t)) for t in (a, b))
                valid.append(i)
            except (TypeError, ValueError) as exc:
                errors[i], num_prompt[i] = f"{type(exc).__name__}: {exc}".replace("prompts[0]", "the prompt"), 0
        outputs = self.llm.score([firsts[i] for i in valid], [seconds[i] for i in valid], use_tqdm=False) if valid else []
        for i, out in zip(valid, outputs):
            scores[i] = out.outputs.score
        result = dict(batch)
        result["score"] = np.array([np.nan if s is None else s for s in scores], dtype=np.float64)
        result["num_prompt_tokens"] = np.array(num_prompt, dtype=np.int64)
        result["error"] = np.array(errors, dtype=object)
        return result

    def _pooled(self, batch: dict, valid: list[int], prompts: list[list[int]], errors: list[str]) -> dict:
        """A pooling task's columns for ``batch`` (the valid rows pooled in one ``encode`` call)."""
        num_rows = len(errors)
        columns = {name: [None] * num_rows for name in POOLING_COLUMNS[self.task]}
        num_prompt = [0] * num_rows
        outputs = self.llm.encode(prompts, None, pooling_task=_POOLING_TASKS[self.task], use_tqdm=False) if prompts else []
        names = self.llm.llm_engine.pooling.id2label
        for i, out in zip(valid, outputs):
            data = out.outputs.data.numpy()
            num_prompt[i] = len(out.prompt_token_ids)
            if self.task == "classify":
                columns["probs"][i], columns["label"][i] = data, names[int(data.argmax())]
            else:
                columns[POOLING_COLUMNS[self.task][0]][i] = data
        result = dict(batch)
        for name, values in columns.items():
            column = np.empty(num_rows, dtype=object)
            column[:] = values
            result[name] = column
        result["num_prompt_tokens"] = np.array(num_prompt, dtype=np.int64)
        result["error"] = np.array(errors, dtype=object)
        return result
