"""An early-exit draft model: a checkpoint's own first layers, as a checkpoint folder of their own.

    write_early_exit_draft("models/stories260K", "/tmp/draft", num_layers=2)
    LLM("models/stories260K", speculative_config={"method": "draft_model", "model": "/tmp/draft",
                                                  "num_speculative_tokens": 3})

The draft keeps the embeddings, the first ``num_layers`` decoder layers, the final norm and the head
(tied or not) of the target and skips the rest (a self-speculative, "early exit" draft: Elhoushi et
al. 2024, LayerSkip, without its training). It needs no training and shares the target's tokenizer
by construction; how often its proposals are accepted depends on how much the skipped layers change
the target's next-token choice. Written with safetensors; config.json is the target's with
``num_hidden_layers`` cut; the tokenizer files are copied.
"""
from __future__ import annotations

import json
import os
import re
import shutil

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|layer)\.(\d+)\.")  # model.layers.3. (Llama...), transformer.h.3. (GPT-2)


def write_early_exit_draft(src: str, dst: str, num_layers: int) -> str:
    """Write the early-exit draft of the checkpoint folder ``src`` (config.json with
    ``num_hidden_layers``, one model.safetensors) into the new folder ``dst``; returns ``dst``.

    Raises:
        FileNotFoundError: ``src`` lacks config.json or model.safetensors (sharded checkpoints are
            not handled).
        FileExistsError: ``dst`` exists.
        ValueError: ``num_layers`` is not in [1, the checkpoint's layers], or config.json has no
            ``num_hidden_layers``.
    """
    from safetensors.torch import load_file, save_file

    config_file, weights_file = os.path.join(src, "config.json"), os.path.join(src, "model.safetensors")
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"early-exit draft: {f!r} not found (one config.json and one model.safetensors are needed)")
    with open(config_file) as f:
        config = json.load(f)
    total = config.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ValueError(f"early-exit draft: {config_file!r} has no integer num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"early-exit draft: num_layers must be in [1, {total}] (the layers of {src!r}), got {num_layers!r}")
    os.makedirs(dst)
    config["num_hidden_layers"] = num_layers
    for key in ("layer_types",):  # per-layer lists follow the layers kept
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kept = {}
    for name, tensor in load_file(weights_file).items():
        layer = _LAYER.search(name)
        if layer is None or int(layer.group(1)) < num_layers:
            kept[name] = tensor
    save_file(kept, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(src, name), dst)
    return dst
