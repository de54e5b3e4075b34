"""What a pooling model offers (``PoolingModelInfo``, read from config.json once when the engine is
built) and the check of each request's ``PoolingParams`` against it (``check_pooling_params``):
a ``ValueError`` / ``TypeError`` naming the request and the field, before any work starts.
Tensor-free."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from pagedgen.pooling_params import PoolerConfig, PoolingParams, PoolingSpec, POOLING_TASKS


@dataclass(frozen=True)
class PoolingModelInfo:
    """A pooling model's outputs.

    Attributes:
        architecture: config.json's architecture; ``convert``: "embed" or "classify" (how it runs).
        hidden_size: features of an embedding.
        num_labels: outputs of the classification head (0: no head, an embedding model).
        id2label: label names by column (config.json ``id2label``), as many as ``num_labels``.
        matryoshka_dimensions: None (``dimensions`` refused), () (any 1..hidden_size: config.json
            ``is_matryoshka``) or the allowed sizes (``matryoshka_dimensions``).
        pooler: the model's ``PoolerConfig``.
    """

    architecture: str
    convert: str
    hidden_size: int
    num_labels: int
    id2label: tuple[str, ...]
    matryoshka_dimensions: Optional[tuple[int, ...]]
    pooler: PoolerConfig
    whole_prompt: bool = False  # an encoder (BERT, XLM-R): each prompt computed in one step

    @classmethod
    def from_hf(cls, hf_config, architecture: str, convert: str, pooler: PoolerConfig, whole_prompt: bool = False) -> "PoolingModelInfo":
        num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if convert == "classify" else 0
        id2label = getattr(hf_config, "id2label", None) or {}
        names = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels))
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        matryoshka = tuple(int(d) for d in dims) if dims else (() if getattr(hf_config, "is_matryoshka", False) else None)
        return cls(architecture, convert, hf_config.hidden_size, num_labels, names, matryoshka, pooler, whole_prompt)

    def supported_tasks(self) -> tuple[str, ...]:
        tasks = ("embed", "token_embed")
        if self.num_labels:
            tasks += ("classify", "token_classify") + (("score",) if self.num_labels == 1 else ())
        return tasks


def check_pooling_params(params, task: str, info: PoolingModelInfo, where: str) -> PoolingSpec:
    """The checked spec of one request. ``params``: a PoolingParams or None; ``task``: one of
    ``POOLING_TASKS``; ``where``: the request's name in errors (``pooling_params`` or
    ``pooling_params[3]``).

    Raises:
        TypeError: ``params`` or a field of the wrong type.
        ValueError: a task the model does not support (listing those it does), ``params.task``
            other than ``task``, ``dimensions`` on a model without matryoshka embeddings, outside
            [1, hidden_size] or not among ``matryoshka_dimensions``, ``dimensions`` for a
            classification task.
    """
    if params is None:
        params = PoolingParams()
    if not isinstance(params, PoolingParams):
        raise TypeError(f"{where} must be a PoolingParams or None, got {type(params).__name__}")
    if task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {POOLING_TASKS}, got {task!r}")
    if params.task is not None and params.task != task:
        raise ValueError(f"{where}.task is {params.task!r} but this call runs task {task!r}")
    supported = info.supported_tasks()
    if task not in supported:
        why = ("it has no classification head: load a *ForSequenceClassification checkpoint"
               if not info.num_labels else f"its classification head has {info.num_labels} labels, a cross-encoder score needs 1")
        raise ValueError(f"{where}: the model ({info.architecture}, convert={info.convert!r}) cannot run task {task!r}: {why}; "
                         f"supported tasks: {supported}")
    for name in ("normalize", "use_activation"):
        value = getattr(params, name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{where}.{name} must be a bool or None, got {type(value).__name__}")
    dims = params.dimensions
    if dims is not None:
        if isinstance(dims, bool) or not isinstance(dims, int):
            raise TypeError(f"{where}.dimensions must be an int or None, got {type(dims).__name__}")
        if task not in ("embed", "token_embed"):
            raise ValueError(f"{where}.dimensions applies to embeddings only, not to task {task!r}")
        if info.matryoshka_dimensions is None:
            raise ValueError(f"{where}.dimensions={dims}: the model does not support matryoshka embeddings "
                             "(its config.json declares neither is_matryoshka nor matryoshka_dimensions)")
        if not 1 <= dims <= info.hidden_size:
            raise ValueError(f"{where}.dimensions must be in [1, {info.hidden_size}] (the hidden size), got {dims}")
        if info.matryoshka_dimensions and dims not in info.matryoshka_dimensions:
            raise ValueError(f"{where}.dimensions must be one of the model's matryoshka_dimensions {list(info.matryoshka_dimensions)}, got {dims}")
    pooler = info.pooler
    token_task = task.startswith("token_")
    pooling_type = pooler.pooling_type if pooler.pooling_type == "STEP" or not token_task else "ALL"
    if not token_task and pooling_type in ("ALL", "STEP"):
        raise ValueError(f"{where}: task {task!r} pools one vector per prompt, but the model's pooling_type is "
                         f"{pooling_type!r}: use LLM.encode(..., pooling_task='token_{task if task == 'embed' else 'classify'}') or LLM.reward")
    if task in ("embed", "token_embed"):
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return PoolingSpec(task, pooling_type, False, None, normalize, dims, pooler.step_tag_id, None, info.whole_prompt)
    use_activation = params.use_activation if params.use_activation is not None else task in ("classify", "score")
    activation = None if not use_activation else ("sigmoid" if info.num_labels == 1 else "softmax")
    ids = pooler.returned_token_ids
    if ids is not None and max(ids) >= info.num_labels:
        raise ValueError(f"LLM pooler_config.returned_token_ids must be < num_labels={info.num_labels}, got {list(ids)}")
    return PoolingSpec(task, pooling_type, True, activation, False, None, pooler.step_tag_id, ids if token_task else None, info.whole_prompt)


def check_pooling_prompt(ids: list[int], info: PoolingModelInfo, max_num_batched_tokens: int, name: str) -> None:
    """An encoder computes a prompt in one step: ValueError when it is longer than the step's budget."""
    if info.whole_prompt and len(ids) > max_num_batched_tokens:
        raise ValueError(f"{name} has {len(ids)} tokens; an encoder ({info.architecture}) computes a prompt in one step, "
                         f"so it must fit max_num_batched_tokens={max_num_batched_tokens} (raise max_num_batched_tokens)")


#: encoders (model/bert.py): bidirectional attention, no KV cache; CLS pooling unless a
#: sentence-transformers folder says otherwise (vLLM's default for BERT embedding models)
ENCODERS = ("BertModel", "XLMRobertaModel", "XLMRobertaForSequenceClassification", "BertForSequenceClassification")


def resolve_runner(runner: str, convert: str, pooler_config, hf_config, architecture: str, model_path: str = "") -> Optional[PoolingModelInfo]:
    """What ``LLM(model, runner=..., convert=..., pooler_config=...)`` runs: None for a generation
    model, else the pooling model's info. The architecture decides with ``runner="auto"``: a
    ``*ForSequenceClassification`` pools (classify), an encoder (``BertModel``, ``XLMRobertaModel``)
    embeds, a ``*ForCausalLM`` generates unless ``convert="embed"``. The pooler: ``pooler_config``
    when given, else a sentence-transformers folder's (``sentence_transformers_pooler``), else LAST
    (CLS for encoders), normalised. ValueError for combinations that cannot run (naming the arguments)."""
    classifier = architecture.endswith(("ForSequenceClassification", "ForTokenClassification"))
    encoder = architecture in ENCODERS
    if classifier or encoder:
        if runner == "generate":
            raise ValueError(f"LLM runner='generate': {architecture} has no language-model head; use runner='pooling' (or 'auto')")
        if encoder and not classifier and convert == "classify":
            raise ValueError(f"LLM convert='classify': {architecture} has no classification head; use convert='embed' (or 'auto')")
        kind = "embed" if convert == "embed" or not classifier else "classify"
    else:
        if convert == "classify":
            raise ValueError(f"LLM convert='classify' needs a checkpoint with a classification head (*ForSequenceClassification); "
                             f"{architecture} has none: use convert='embed'")
        if runner != "pooling" and convert != "embed":
            return None
        kind = "embed"
    if pooler_config is not None:
        pooler = PoolerConfig.from_arg(pooler_config)
    else:
        default = "CLS" if encoder else "ALL" if architecture.endswith("ForTokenClassification") else "LAST"
        pooler = sentence_transformers_pooler(model_path) or PoolerConfig(default)
    return PoolingModelInfo.from_hf(hf_config, architecture, kind, pooler, whole_prompt=encoder)


def sentence_transformers_pooler(folder: str) -> Optional[PoolerConfig]:
    """The pooler of a sentence-transformers folder (``modules.json``: Transformer, Pooling, and
    an optional Normalize), None for another folder. The Pooling module's ``config.json`` picks
    one mode: ``pooling_mode_cls_token`` -> CLS, ``pooling_mode_mean_tokens`` -> MEAN,
    ``pooling_mode_lasttoken`` -> LAST; normalised only with a Normalize module (as
    sentence-transformers' ``encode``). ValueError: modules pagedgen does not run (Dense, ...),
    other or several pooling modes."""
    path = os.path.join(folder, "modules.json")
    if not folder or not os.path.isfile(path):
        return None
    with open(path) as f:
        modules = json.load(f)
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise ValueError(f"{path}: sentence-transformers modules {unknown} are not supported (only Transformer, Pooling, Normalize)")
    if "Pooling" not in kinds:
        raise ValueError(f"{path} has no Pooling module")
    pooling_file = os.path.join(folder, kinds["Pooling"].get("path", ""), "config.json")
    with open(pooling_file) as f:
        config = json.load(f)
    if "pooling_mode" in config:  # sentence-transformers >= 6: one "pooling_mode" string
        mode = config["pooling_mode"]
        modes = [f"pooling_mode_{m}" for m in (mode if isinstance(mode, list) else [mode])]
        if config.get("include_prompt", True) is not True:
            raise ValueError(f"{pooling_file}: include_prompt=false (pooling that leaves out an instruction prefix) is not supported")
    else:  # older releases: one boolean per mode
        modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    names = {"pooling_mode_cls_token": "CLS", "pooling_mode_cls": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_mean": "MEAN", "pooling_mode_lasttoken": "LAST"}
    if len(modes) != 1 or modes[0] not in names:
        raise ValueError(f"{pooling_file}: pooling modes {modes} are not supported: exactly one of {list(names)}")
    return PoolerConfig(names[modes[0]], normalize="Normalize" in kinds)
