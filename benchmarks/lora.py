"""Multi-LoRA throughput (issue 48), side by side in one process: the base model alone against the
same requests spread over ``--num-adapters`` rank-``--rank`` adapters (all seven projections), runs
alternated, medians of ``--rounds``; optionally vLLM's CPU backend with the same adapters and
requests (``--vllm-venv``, its own venv: benchmarks/setup_vllm.sh). Output tokens/s per system and
the ratios to the targets (>= 0.8x the base model alone; >= 1.5x vLLM).

    python benchmarks/lora.py                                        # random-135m bf16, TinyStories 256
    python benchmarks/lora.py --vllm-venv benchmarks/.vllm-venv
    python benchmarks/lora.py --quick                                # a check that it runs (stories260K, 16 prompts)

The adapters are written in PEFT's format (adapter_config.json + adapter_model.safetensors) with
seeded random A and B. Timings are only meaningful on a quiet machine; say which machine kind ran them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _roofline  # noqa: E402
from _launch import vllm_env, vllm_venv_problem  # noqa: E402
from _workload import RANDOM_MODELS, SHARED, WORKLOADS, ensure_random_model, fold_ids, load_workload, model_info  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_VLLM_SNIPPET = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
job = json.load(open(sys.argv[1]))
llm = LLM(job["model"], dtype=job["dtype"], enable_lora=True, max_loras=job["max_loras"], max_lora_rank=job["rank"],
          max_model_len=job["max_model_len"], enforce_eager=True)
loras = [None] + [LoRARequest(f"a{i}", i, p) for i, p in enumerate(job["adapters"], start=1)]
prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in job["limits"]]
reqs = [loras[i] for i in job["lora_of"]]
llm.generate(prompts[:8], params[:8], lora_request=reqs[:8], use_tqdm=False)
times = []
for _ in range(job["rounds"]):
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
    times.append(time.perf_counter() - start)
json.dump({"times": times, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}, open(sys.argv[2], "w"))
"""


def write_adapter(folder: str, cfg: dict, rank: int, seed: int, std: float = 0.02) -> str:
    """A PEFT LoRA folder for a Llama-shaped ``cfg`` with seeded random A [r, in] and B [out, r] on every projection."""
    from safetensors.torch import save_file

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, (cfg.get("num_key_value_heads") or cfg["num_attention_heads"]) * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fin, fout) in shapes.items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * std
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), lora_dropout=0.0, bias="none",
                  use_rslora=False, task_type="CAUSAL_LM")
    json.dump(config, open(os.path.join(folder, "adapter_config.json"), "w"))
    return folder


def run_vllm(venv: str, job: dict) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        json.dump(job, open(job_file, "w"))
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   **vllm_env(4, f"0-{torch.get_num_threads() - 1}"))  # the CPU backend's variables (it fails without them)
        env.pop("PYTHONPATH", None)
        subprocess.run([os.path.join(venv, "bin", "python"), "-c", _VLLM_SNIPPET, job_file, out_file], check=True, env=env)
        result = json.load(open(out_file))
    return statistics.median(result["times"]), result["tokens"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random-135m", help="a checkpoint folder, or random-135m / random-1b (random weights, cached)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=WORKLOADS["tinystories"]["num_prompts"])
    ap.add_argument("--min-tokens", type=int, default=WORKLOADS["tinystories"]["min_tokens"])
    ap.add_argument("--max-tokens", type=int, default=WORKLOADS["tinystories"]["max_tokens"])
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--vllm-venv", default=None, help="a venv with vLLM's CPU build (benchmarks/setup_vllm.sh)")
    ap.add_argument("--quick", action="store_true", help="stories260K fp32, 16 prompts of at most 16 tokens, one round: checks that it runs")
    args = ap.parse_args(argv)
    if args.vllm_venv and vllm_venv_problem(args.vllm_venv):
        raise SystemExit(vllm_venv_problem(args.vllm_venv))
    if args.quick:
        args.model, args.dtype = os.path.join(SHARED, "models", "stories260K"), "float32"
        args.num_prompts, args.min_tokens, args.max_tokens, args.rounds = 16, 4, 16, 1
    from pagedgen import LLM, LoRARequest, SamplingParams
    from transformers import AutoTokenizer

    folder = ensure_random_model(args.model, args.dtype)[0] if args.model in RANDOM_MODELS else args.model
    info = model_info(args.model, args.dtype)
    cfg, max_model_len = info["config"], min(info["max_model_len"], 2048)
    tok = AutoTokenizer.from_pretrained(info["tokenizer"])
    prompts, limits = load_workload("tinystories", tok, num_prompts=args.num_prompts, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                    max_prompt_tokens=None, max_model_len=max_model_len, seed=0)
    prompts, _ = fold_ids(prompts, cfg["vocab_size"])
    lora_of = [(i % args.num_adapters) + 1 if args.num_adapters else 0 for i in range(len(prompts))]  # every request an adapter, round robin
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in limits]
    print(f"{args.model} {args.dtype}, {len(prompts)} TinyStories prompts, {sum(limits)} output tokens, {args.num_adapters} adapters "
          f"of rank {args.rank} on {', '.join(TARGETS)}, torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [write_adapter(os.path.join(tmp, f"a{i}"), cfg, args.rank, seed=i) for i in range(1, args.num_adapters + 1)]
        loras = [None] + [LoRARequest(f"a{i}", i, p) for i, p in enumerate(adapters, start=1)]
        common = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
        base = LLM(folder, **common)
        lora = LLM(folder, enable_lora=True, max_loras=max(1, args.num_adapters), max_lora_rank=args.rank, **common)
        reqs = [loras[i] for i in lora_of]
        base.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
        lora.generate(prompts[:8], params[:8], lora_request=reqs[:8], use_tqdm=False)
        peak = _roofline.matmul_peak(args.dtype)  # the same run's matmul peak, before the timed rounds
        flops = _roofline.workload_flops(_roofline.gemm_shapes(cfg), _roofline.workload_rows([len(p) for p in prompts], limits))
        times = {"base": [], "lora": []}
        for _ in range(args.rounds):  # alternated, so that a noisy moment hits both
            start = time.perf_counter()
            base.generate(prompts, params, use_tqdm=False)
            times["base"].append(time.perf_counter() - start)
            start = time.perf_counter()
            outs = lora.generate(prompts, params, lora_request=reqs, use_tqdm=False)
            times["lora"].append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rate = {k: tokens / statistics.median(v) for k, v in times.items()}
        print(f"base model alone: {rate['base']:,.1f} output tok/s (median of {args.rounds})")
        print(f"{args.num_adapters} adapters: {rate['lora']:,.1f} output tok/s: {rate['lora'] / rate['base']:.2f}x the base (target >= 0.8x)")
        print(_roofline.describe_machine(_roofline.machine()))
        for k, v in times.items():  # the base model's matmuls (the adapters' shrink and expand not counted)
            print(_roofline.share_line(k, flops, statistics.median(v), peak))
        if args.vllm_venv:
            job = dict(model=folder, dtype=args.dtype, max_loras=max(1, args.num_adapters), rank=args.rank, max_model_len=max_model_len,
                       adapters=adapters, prompts=prompts, limits=limits, lora_of=lora_of, rounds=args.rounds)
            seconds, vtokens = run_vllm(args.vllm_venv, job)
            vrate = vtokens / seconds
            print(f"vLLM CPU, {args.num_adapters} adapters: {vrate:,.1f} output tok/s: pagedgen {rate['lora'] / vrate:.2f}x (target >= 1.5x)")
            print(_roofline.share_line("vLLM CPU", flops, seconds, peak))
    return 0


if __name__ == "__main__":
    sys.exit(main())
