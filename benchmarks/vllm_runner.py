"""Run one throughput job on vLLM's CPU backend; runs inside vLLM's own venv (benchmarks/setup_vllm.sh).

    benchmarks/.vllm-venv/bin/python benchmarks/vllm_runner.py JOB.json RESULT.json

Job and result format: benchmarks/_job.py. vLLM gets the prompts as token ids
(``{"prompt_token_ids": ids}``, vLLM's TokensPrompt), one ``SamplingParams(temperature=0,
max_tokens=m, ignore_eos=True)`` per request, ``LLM(model, dtype=..., seed=...,
max_model_len=options.max_model_len, enforce_eager=options.enforce_eager, max_num_seqs=...)``;
everything else is vLLM's default (prefix caching on, its own chunked-prefill budget). Output text is
detokenised as vLLM does by default, as pagedgen does. Timed: the one ``LLM.generate`` call over all
prompts, after an untimed warm-up on prompts that share no prefix with the timed ones. The environment
(VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND) is set by the caller, benchmarks/_launch.py.
"""
from __future__ import annotations

import time

import _job


def run(job: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    opts = job["options"]
    kwargs = dict(dtype=job["dtype"], seed=job["seed"], max_model_len=opts["max_model_len"],
                  enforce_eager=opts["enforce_eager"], max_num_seqs=opts["max_num_seqs"])
    if opts.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = opts["max_num_batched_tokens"]
    llm = LLM(job["model"], **kwargs)

    def params(m: int) -> SamplingParams:  # greedy, exact length (checked by _job.main)
        return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)

    llm.generate(job["warmup_prompts"], params(4), use_tqdm=False)
    sampling = [params(m) for m in job["max_tokens"]]
    start = time.perf_counter()
    outs = llm.generate(job["prompts"], sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    _job.check_lengths("vllm", outputs, job["max_tokens"])
    sched = llm.llm_engine.vllm_config.scheduler_config
    info = dict(version=f"vllm {vllm.__version__}, torch {torch.__version__}", max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens, torch_threads=torch.get_num_threads())
    return dict(output_token_ids=outputs, seconds=seconds, computed_tokens=sum(job["max_tokens"]), info=info)


if __name__ == "__main__":
    _job.main(run)
