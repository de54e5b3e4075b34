"""PEFT LoRA adapters for the tests, made with ``peft`` itself, and their oracle: transformers with
PEFT's ``merge_and_unload()``.

``make_adapter`` wraps a transformers model in ``get_peft_model``, gives lora_A and lora_B seeded
random values (PEFT initialises B to zero, which would make every adapter the base model) and saves
the folder with ``save_pretrained``.
"""
from __future__ import annotations

import torch


def make_adapter(base_path: str, folder: str, r: int = 8, alpha: float = 16, targets=("q_proj", "v_proj"), seed: int = 0,
                 std: float = 0.15, use_rslora: bool = False, safe_serialization: bool = True, **extra) -> str:
    """Save a random LoRA adapter of ``base_path`` (a Llama checkpoint) in ``folder``; returns it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(folder, safe_serialization=safe_serialization)
    return folder


def merged_model(base_path: str, folder):
    """transformers' model of ``base_path`` with the adapter in ``folder`` merged into its weights
    (``PeftModel.from_pretrained(...).merge_and_unload()``), fp32, eval mode; the base model for None."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    if folder is not None:
        model = PeftModel.from_pretrained(model, folder).merge_and_unload().eval()
    model.generation_config.eos_token_id = None  # greedy runs its max_tokens (pagedgen's side: ignore_eos)
    return model


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``model`` after ``prompt_ids`` (transformers' ``generate``, its KV cache) and
    each one's logprob (the log-softmax of its raw logits, float32)."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                         max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), dim=-1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs
