"""``PagedGenLM``: pagedgen's ``LLM`` as an lm-evaluation-harness model, registered as ``pagedgen``.

    lm_eval.simple_evaluate(model="pagedgen",
                            model_args="pretrained=DIR,dtype=float32,max_length=512,device=cpu", ...)

Semantics follow lm_eval's own ``hf`` backend (``lm_eval/models/huggingface.py``) so that scores
agree sample by sample: the same tokenization (``TemplateLM._encode_pair``, BOS handling of
``tok_encode``), the same truncation windows, the same rolling windows
(``lm_eval.utils.get_rolling_token_windows`` / ``make_disjoint_window``), the same stop handling and
post-processing of generations. Unlike ``hf`` (and like lm_eval's ``vllm`` backend) every request of
a call goes to the engine at once: one ``LLM.generate`` per ``loglikelihood``, ``loglikelihood_rolling``
or ``generate_until`` call, and the scheduler batches them (``max_num_seqs``, ``max_num_batched_tokens``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Optional, Union

import jinja2
import lm_eval.models  # noqa: F401  (fills the registry's lazy entries before ours is added)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from pagedgen import arg_utils
from pagedgen.engine_args import EngineArgs
from pagedgen.integrations.lm_eval import scoring
from pagedgen.llm import LLM
from pagedgen.lora.request import LoRARequest
from pagedgen.sampling_args import sampling_params_from_dict
from pagedgen.sampling_params import SamplingParams

logger = logging.getLogger("pagedgen")

#: model_args of the backend itself (the rest are EngineArgs fields, i.e. LLM's keyword arguments).
LM_ARGS = ("pretrained", "max_length", "batch_size", "max_batch_size", "max_gen_toks", "add_bos_token", "prefix_token_id", "chat_template",
           "lora_local_path")
#: gen_kwargs set by the backend itself, not passed through to SamplingParams.
_OWN_SAMPLING = ("max_tokens", "stop", "n", "logprobs", "prompt_logprobs", "prompt_logprob_start", "detokenize")


def _typed(name: str, value, tp):
    """``value`` converted from a string to ``tp`` (model_args may come as strings)."""
    if isinstance(value, str):
        try:
            return arg_utils.converter(tp, name)(value)
        except ValueError as exc:
            raise ValueError(f"pagedgen model_args {name}: {exc}") from None
    return value


def _adapter_rank(path) -> int:
    """The ``r`` of a PEFT adapter folder's adapter_config.json (0 when it cannot be read: the LLM's check then says why)."""
    try:
        with open(os.path.join(os.fspath(path), "adapter_config.json")) as f:
            r = json.load(f).get("r", 0)
        return r if isinstance(r, int) else 0
    except (OSError, ValueError, AttributeError):
        return 0


@register_model("pagedgen")
class PagedGenLM(TemplateLM):
    """An lm_eval ``LM`` over one pagedgen ``LLM``.

    Args:
        pretrained: checkpoint folder (``LLM``'s ``model``), or an ``LLM`` already built.
        max_length: most tokens the model sees (lm_eval's name): ``LLM``'s ``max_model_len``
            (default: the model's ``max_position_embeddings``).
            Loglikelihood inputs are cut from the left to it, generation contexts to
            ``max_length - max_gen_toks``.
        batch_size: accepted for lm_eval's CLI and ignored: all requests of a call go to the engine
            at once and its scheduler batches them (``max_num_seqs``), as in lm_eval's vllm backend.
        max_batch_size: ``max_num_seqs`` when that is not given (lm_eval's vllm backend's rule).
        max_gen_toks: tokens generated when a task's gen_kwargs do not say (default 256, as hf).
        add_bos_token: force (True) or suppress (False) the tokenizer's special tokens when encoding;
            None: the tokenizer's default (BOS for Llama), as hf.
        prefix_token_id: the token that conditions an empty context and a rolling window's first
            token (default: BOS, else EOS, as hf).
        chat_template: a Jinja chat template (or a path to a file holding one) used instead of the
            tokenizer's when lm_eval runs with ``apply_chat_template``.
        lora_local_path: a PEFT LoRA adapter folder every request runs with (lm_eval's vllm
            backend's name; docs/lora.md): turns on ``enable_lora`` and, unless given, sets
            ``max_lora_rank`` to the adapter's rank when it is over 16.
        **engine_args: ``LLM``'s keyword arguments (``EngineArgs`` fields: dtype, block_size,
            num_kv_blocks, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            max_model_len (an alias of max_length), enable_prefix_caching, device, seed, ...);
            strings are converted to the field's type.

    Raises:
        ValueError: an unknown key (the message lists the allowed ones), a value that does not
            convert, max_length and max_model_len both given and different, engine arguments with
            an ``LLM`` instance, or whatever ``LLM`` refuses.
        TypeError: ``pretrained`` is neither a path nor an ``LLM``.
    """

    def __init__(
        self,
        pretrained: Union[str, os.PathLike, LLM],
        max_length: Optional[int] = None,
        batch_size: Union[int, str, None] = 1,
        max_batch_size: Optional[int] = None,
        max_gen_toks: int = 256,
        add_bos_token: Optional[bool] = None,
        prefix_token_id: Optional[int] = None,
        chat_template: Optional[str] = None,
        lora_local_path: Optional[str] = None,
        **engine_args,
    ) -> None:
        super().__init__()
        engine_fields = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
        unknown = sorted(set(engine_args) - set(engine_fields))
        if unknown:
            raise ValueError(
                f"unknown pagedgen model_args key(s) {', '.join(map(repr, unknown))}; allowed: "
                f"{', '.join(LM_ARGS + tuple(engine_fields))}"
            )
        max_length = _typed("max_length", max_length, Optional[int])
        max_model_len = _typed("max_model_len", engine_args.pop("max_model_len", None), Optional[int])
        if max_length is not None and max_model_len is not None and max_length != max_model_len:
            raise ValueError(f"pagedgen model_args: max_length={max_length} and max_model_len={max_model_len} differ; give one")
        max_length = max_length if max_length is not None else max_model_len
        max_batch_size = _typed("max_batch_size", max_batch_size, Optional[int])
        self._max_gen_toks = _typed("max_gen_toks", max_gen_toks, int)
        self.add_bos_token = _typed("add_bos_token", add_bos_token, Optional[bool])
        self.custom_prefix_token_id = _typed("prefix_token_id", prefix_token_id, Optional[int])
        self.batch_size = batch_size  # reported by lm_eval; the scheduler batches

        if isinstance(pretrained, LLM):
            if engine_args or max_batch_size is not None:
                raise ValueError(
                    f"pagedgen model_args {sorted(engine_args) or ['max_batch_size']} cannot change an LLM already built: "
                    "pass a checkpoint folder as pretrained instead"
                )
            self.llm = pretrained
        elif isinstance(pretrained, (str, os.PathLike)):
            values = {"model": os.fspath(pretrained), **engine_args}
            if lora_local_path is not None:
                values.setdefault("enable_lora", True)
                values.setdefault("max_lora_rank", max(16, _adapter_rank(lora_local_path)))
            if max_length is not None:
                values["max_model_len"] = max_length
            if max_batch_size is not None and "max_num_seqs" not in values:
                values["max_num_seqs"] = max_batch_size
            self.llm = EngineArgs.from_dict(values).create_llm()
        else:
            raise TypeError(f"pagedgen model_args pretrained must be a checkpoint folder or an LLM, got {type(pretrained).__name__}")

        engine_len = self.llm.scheduler_config.max_model_len
        if max_length is not None and max_length > engine_len:
            raise ValueError(f"pagedgen max_length={max_length} exceeds the LLM's max_model_len={engine_len}: build the LLM with a larger one")
        self._max_length = max_length if max_length is not None else engine_len
        self.tokenizer = self.llm.tokenizer
        self._chat_template = self._read_template(chat_template)
        self._device = self.llm.device
        lora = None if lora_local_path is None else LoRARequest("lora_local_path", 1, os.fspath(lora_local_path))
        self.lora_request = self.llm.processor.loras.check_one(lora, "model_args lora_local_path")  # ValueError naming it, before any request

    @staticmethod
    def _read_template(chat_template: Optional[str]) -> Optional[str]:
        if chat_template is None:
            return None
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ValueError(f"pagedgen model_args chat_template must be a Jinja template or a file holding one, got {chat_template!r}")
        if os.path.isfile(chat_template):
            with open(chat_template, encoding="utf-8") as f:
                return f.read()
        return chat_template

    # ----- what lm_eval asks of a model ----------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Most tokens the model sees at once (the LLM's max_model_len unless set lower for an LLM passed in)."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: Union[bool, str] = False) -> Optional[str]:
        """The template ``apply_chat_template`` renders with (the ``chat_template`` model arg, else
        the tokenizer's, chosen as ``TemplateLM.chat_template`` does)."""
        if self._chat_template is not None and chat_template:
            return self._chat_template
        return super().chat_template(chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation as the prompt text (the template writes BOS if it wants one).

        Raises:
            ValueError: neither the tokenizer nor the ``chat_template`` model arg has a template.
        """
        if self._chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "apply_chat_template was asked for, but the tokenizer has no chat template: pass "
                "model_args chat_template=... (a Jinja template or a file), or run without --apply_chat_template"
            )

        def render(history):
            return self.tokenizer.apply_chat_template(
                history,
                chat_template=self._chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )

        try:
            return render(chat_history)
        except jinja2.TemplateError:  # as hf: some templates refuse a system turn
            logger.warning("the chat template failed; trying again without the system message")
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, left_truncate_len: Optional[int] = None, **kwargs) -> list[int]:
        """Token ids of ``string``; special tokens as hf: the flag if given, else ``add_bos_token``,
        else the tokenizer's default, and none when the text already starts with the prefix token."""
        special = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = False
        extra = {} if special is None else {"add_special_tokens": special}
        ids = self.tokenizer.encode(string, **extra)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ----- scoring -------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) per (cache key, context ids, continuation ids), in one generate call."""
        prompts = [scoring.scoring_prompt(i, ctx, cont, self.max_length) for i, (_, ctx, cont) in enumerate(requests)]
        conts = [cont for _, _, cont in requests]
        outputs = self.llm.generate(prompts, scoring.scoring_params(prompts, conts), use_tqdm=not disable_tqdm, lora_request=self.lora_request)
        results = []
        for (key, _, cont), out in zip(requests, outputs):
            answer = scoring.continuation_score(out, cont)
            if key is not None:  # rolling windows have no key: their sum is cached per document
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over disjoint windows of ``max_length`` tokens, each
        predicting as much as it can with a full context (``LM.loglikelihood_rolling``)."""
        windows, owners = [], []
        for i, (text,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm, desc="Rolling windows")):
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, ctx, cont))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # ----- generation ----------------------------------------------------------------------------
    def _generation_params(self, index: int, gen_kwargs: dict, eos: str) -> tuple[SamplingParams, list[str]]:
        """(SamplingParams, the stop strings) of one request's gen_kwargs, normalised as lm_eval does
        (``do_sample=False`` -> temperature 0; max_gen_toks and its aliases; EOS text among the stops)."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"generate_until request {index}: gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        kwargs.pop("do_sample", None)  # already folded into temperature
        if kwargs.pop("num_beams", 1) != 1:
            raise ValueError(f"generate_until request {index}: num_beams must be 1 (use LLM.beam_search for beam search)")
        own = sorted(set(kwargs) & set(_OWN_SAMPLING))
        if own:
            raise ValueError(f"generate_until request {index}: gen_kwargs {own} are set by the backend (use until / max_gen_toks)")
        if not 0 < max_gen_toks < self.max_length:
            raise ValueError(f"generate_until request {index}: max_gen_toks must be in [1, {self.max_length - 1}] (below max_length), got {max_gen_toks}")
        try:
            params = sampling_params_from_dict(
                {**kwargs, "max_tokens": max_gen_toks, "stop": [s for s in until if s]},
                where="gen_kwargs",
            )
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"generate_until request {index}: {exc}") from None
        return params, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string, EOS or max_gen_toks, in one generate call;
        the text is decoded from the tokens and cut at the first stop string (as hf)."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        by_kwargs: dict[str, tuple[SamplingParams, list[str]]] = {}
        prompts, params, stops = [], [], []
        for i, r in enumerate(requests):
            context, gen_kwargs = r.args
            key = json.dumps(gen_kwargs, sort_keys=True, default=str)
            if key not in by_kwargs:
                by_kwargs[key] = self._generation_params(i, gen_kwargs, eos)
            sp, until = by_kwargs[key]
            prompts.append(self.tok_encode(context, left_truncate_len=self.max_length - sp.max_tokens) or [self.prefix_token_id])
            params.append(sp)
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm, lora_request=self.lora_request)
        texts = []
        for r, out, until in zip(requests, outputs, stops):
            text = postprocess_generated_text(self.tok_decode(out.outputs[0].token_ids), until, None)
            self.cache_hook.add_partial("generate_until", r.args, text)
            texts.append(text)
        return texts
