"""Run one throughput job on pagedgen, transformers static batching or transformers continuous batching.

    python benchmarks/_local_systems.py JOB.json RESULT.json      # job["system"] picks the system

Job and result format: benchmarks/_job.py. Each run is a fresh process (a fresh model, KV cache and
prefix cache); an untimed warm-up on prompts that share no prefix with the timed ones comes first.

  pagedgen        LLM.generate over all prompts, one SamplingParams(temperature=0, max_tokens=m,
                  ignore_eos=True) per request. With options.profile: instead of the timed run, a
                  profiled one (benchmarks/_profile.py: CPU time per component, top operators).
  static          transformers model.generate on left-padded batches of options.batch_size, in prompt
                  order, max_new_tokens = the batch's largest max_tokens. Only each request's own first
                  max_tokens output tokens count as useful; the rest is wasted work, like padding.
  generate_batch  transformers continuous batching (the manager under model.generate_batch). generate_batch
                  itself takes one max_new_tokens for all requests, so requests are added one by one with
                  their own max_new_tokens (ContinuousBatchingManager.add_request), on a KV cache of the
                  same size and block (page) size as pagedgen's. On CUDA the same code runs (transformers
                  5.17 on the H200 machine, whose ContinuousBatchingConfig names the page size
                  block_size: cb_config picks the field the installed version has).
"""
from __future__ import annotations

import time

import _job


def timed(fn, device: str):
    """(wall seconds, result) of ``fn()``, the device synchronised on both sides."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def pagedgen_llm(job: dict):
    """pagedgen's LLM with the job's settings (also benchmarks/gpu_profile.py's)."""
    from pagedgen import LLM

    opts = job["options"]
    kwargs = dict(dtype=job["dtype"], num_kv_blocks=opts["num_kv_blocks"], block_size=opts["block_size"],
                  max_num_seqs=opts["max_num_seqs"], max_num_batched_tokens=opts["max_num_batched_tokens"], seed=job["seed"])
    if job["device"] != "cpu":
        kwargs["device"] = job["device"]
    if "batch_invariant" in opts:  # throughput.py --batch-invariant
        kwargs["batch_invariant"] = opts["batch_invariant"] and job["device"] == "cpu"
    return LLM(job["model"], **kwargs)


def run_pagedgen(job: dict) -> dict:
    from pagedgen import SamplingParams, ops

    opts = job["options"]
    llm = pagedgen_llm(job)
    prompts, max_tokens = _job.token_ids(job), job["max_tokens"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate(_job.token_ids(job, "warmup_prompts"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    if opts.get("profile"):  # throughput.py --profile: a profiled run instead of the timed one (benchmarks/_profile.py)
        import _profile

        holder = {}
        start = time.perf_counter()
        profile = _profile.profile_call(lambda: holder.setdefault("outs", llm.generate(prompts, params, use_tqdm=False)))
        outputs = [list(o.outputs[0].token_ids) for o in holder["outs"]]
        _job.check_lengths("pagedgen", outputs, max_tokens)
        return dict(output_token_ids=outputs, seconds=time.perf_counter() - start, computed_tokens=sum(max_tokens),
                    info=dict(profile=profile))
    before = llm.get_stats()
    seconds, outs = timed(lambda: llm.generate(prompts, params, use_tqdm=False), job["device"])
    after = llm.get_stats()
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    _job.check_lengths("pagedgen", outputs, max_tokens)
    steps = after.num_steps - before.num_steps
    # kv_utilization_mean is a mean over steps: keep the timed run's share only
    util = (after.kv_utilization_mean * after.num_steps - before.kv_utilization_mean * before.num_steps) / max(steps, 1)
    mm = getattr(llm, "matmul_config", None)  # pagedgen.layers.matmul.MatmulConfig, where the version has one
    matmul = (f"matmuls with {str(mm.weight_dtype).removeprefix('torch.')} weights ({mm.reason}"
              f"{', batch-invariant rows' if getattr(mm, 'batch_invariant', False) else ''})" if mm is not None else "matmuls by F.linear in the model dtype")
    info = dict(matmul=matmul, ops="compiled pagedgen._C" if ops.extension_available(job["device"]) else "PyTorch reference ops (no pagedgen._C)",
                kv_blocks=opts["num_kv_blocks"], kv_utilization_mean=util, steps=steps,
                preemptions=after.num_preemptions - before.num_preemptions)
    return dict(output_token_ids=outputs, seconds=seconds, computed_tokens=sum(max_tokens), info=info | device_memory(job))


def load_hf(job: dict, attn: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=job["dtype"], attn_implementation=attn)
    return model.to(job["device"]).eval()


def run_static(job: dict) -> dict:
    import torch

    model, device, pad = load_hf(job, "sdpa"), job["device"], job["options"]["pad_token_id"]
    bs = job["options"]["batch_size"]

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)  # [B, width]
        # eos_token_id=None as a keyword turns EOS off; inside a GenerationConfig None means "unset", and
        # generate would take the model's generation_config.eos_token_id again.
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=pad)  # [B, width + new_tokens]
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"static: generate stopped after {out.shape[1] - width} of {new_tokens} tokens")
        return out[:, width:].tolist()

    prompts, max_tokens = _job.token_ids(job), job["max_tokens"]
    batches = [(prompts[s: s + bs], max_tokens[s: s + bs]) for s in range(0, len(prompts), bs)]
    with torch.no_grad():
        generate(_job.token_ids(job, "warmup_prompts"), 4)
        runs = [timed(lambda: generate(b, max(m)), device) for b, m in batches]
    # useful: each request's own first max_tokens; computed: all rows run to the batch's largest
    outputs = [row[:m] for (_, out), (_, ms) in zip(runs, batches) for row, m in zip(out, ms)]
    _job.check_lengths("static", outputs, max_tokens)
    return dict(output_token_ids=outputs, seconds=sum(t for t, _ in runs),
                computed_tokens=sum(len(b) * max(m) for b, m in batches), info=dict(batch_size=bs) | device_memory(job))


def cb_config(opts: dict):
    """transformers' ContinuousBatchingConfig for ``opts``: pagedgen's KV cache size and page size, its
    batch limits. The page size is ``page_size`` in newer transformers, ``block_size`` in older ones
    (5.17, the H200 machine's): whichever the installed version takes."""
    import inspect

    from transformers import ContinuousBatchingConfig

    names = inspect.signature(ContinuousBatchingConfig).parameters
    page = "page_size" if "page_size" in names else "block_size"
    return ContinuousBatchingConfig(**{page: opts["block_size"]}, num_blocks=opts["num_kv_blocks"],
                                    max_requests_per_batch=opts["max_num_seqs"], max_batch_tokens=opts["max_num_batched_tokens"])


def run_generate_batch(job: dict) -> dict:
    import torch
    from transformers import GenerationConfig

    opts = job["options"]
    model = load_hf(job, opts["cb_attn"])
    prompts, max_tokens = _job.token_ids(job), job["max_tokens"]
    # eos_token_id=-1 turns EOS off (None would be replaced by the model's EOS)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(max_tokens), eos_token_id=-1)
    # without num_blocks it sizes its cache from 90% of the machine's RAM on CPU (of free GPU memory on CUDA)
    config = cb_config(opts)

    def collect(manager, tag: str, batch: list[list[int]], limits: list[int]) -> list[list[int]]:
        for i, (p, m) in enumerate(zip(batch, limits)):
            manager.add_request(p, request_id=f"{tag}-{i}", max_new_tokens=m, eos_token_id=-1)
        results = {}
        while len(results) < len(batch):
            r = manager.get_result(timeout=1)
            if r is None and not manager.is_running():
                raise RuntimeError("generate_batch: the generation thread stopped")
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"generate_batch: request {r.request_id} failed: {r.error}")
                results[r.request_id] = r.generated_tokens
        return [list(results[f"{tag}-{i}"]) for i in range(len(batch))]

    with torch.no_grad(), model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=config, block=True, timeout=5
    ) as manager:
        warm = _job.token_ids(job, "warmup_prompts")
        collect(manager, "warmup", warm, [4] * len(warm))
        seconds, outputs = timed(lambda: collect(manager, "run", prompts, max_tokens), job["device"])
        used = getattr(model.config, "_attn_implementation", None)  # what transformers switched it to (paged|...)
    _job.check_lengths("generate_batch", outputs, max_tokens)
    info = dict(attn_implementation=opts["cb_attn"], attn_used=used, kv_blocks=opts["num_kv_blocks"]) | device_memory(job)
    return dict(output_token_ids=outputs, seconds=seconds, computed_tokens=sum(max_tokens), info=info)


def device_memory(job: dict) -> dict:
    """Peak GPU memory allocated by torch, in bytes, when the job ran on CUDA."""
    if job["device"] != "cuda":
        return {}
    import torch

    return dict(peak_cuda_bytes=torch.cuda.max_memory_allocated())


RUNNERS = dict(pagedgen=run_pagedgen, static=run_static, generate_batch=run_generate_batch)

if __name__ == "__main__":
    _job.main(lambda job: RUNNERS[job["system"]](job))
