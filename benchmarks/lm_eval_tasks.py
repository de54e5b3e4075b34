"""lm-evaluation-harness wall time: the ``pagedgen`` backend vs lm_eval's own ``hf`` backend, same model.

    python benchmarks/lm_eval_tasks.py                          # stories260K fp32, default sizes
    python benchmarks/lm_eval_tasks.py --model random-135m      # random weights of SmolLM-135M's shape, bf16
    python benchmarks/lm_eval_tasks.py --quick                  # smoke run (tiny tasks, one repeat)

The tasks are examples/lm_eval_local_tasks.py's, over local JSONL files cut from TinyStories (offline):
  ts_mc    multiple_choice (4 choices, acc): loglikelihood requests, many sharing their context;
  ts_gen   generate_until ("." or newline, --gen-tokens at most, greedy);
  ts_roll  loglikelihood_rolling (word_perplexity) over documents of --stories-per-doc stories,
           scored in windows of --max-length tokens.
Both backends run in this process, one after the other, on the same model, dtype, device and
max_length. Each task's ``simple_evaluate`` is timed on its own (model construction excluded, timed
apart), after an untimed warm-up of every task with --warmup-docs documents; the median of
--repeats is reported, with the ratio hf / pagedgen, and the task scores of both (they agree: the
tests check that sample by sample). hf runs with --hf-batch-size (lm_eval batches requests itself);
pagedgen gets every request of a call at once and its scheduler batches them (--max-num-seqs).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared")
STORIES = os.path.join(SHARED, "models", "stories260K")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")
TASKS = ("ts_mc", "ts_gen", "ts_roll")
METRICS = {"ts_mc": "acc,none", "ts_gen": "exact_match,none", "ts_roll": "word_perplexity,none"}
QUICK = dict(num_docs=6, num_roll_docs=2, stories_per_doc=1, gen_tokens=8, repeats=1, warmup_docs=2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=STORIES, help="checkpoint folder, or random-135m (random weights, built here)")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's (bfloat16 for random-135m)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-length", type=int, default=256, help="lm_eval max_length of both backends, tokens")
    ap.add_argument("--num-docs", type=int, default=200, help="documents of ts_mc and ts_gen each")
    ap.add_argument("--num-roll-docs", type=int, default=40, help="documents of ts_roll")
    ap.add_argument("--stories-per-doc", type=int, default=3, help="stories per ts_roll document")
    ap.add_argument("--gen-tokens", type=int, default=32, help="max_gen_toks of ts_gen")
    ap.add_argument("--hf-batch-size", type=int, default=32, help="lm_eval batch_size of the hf backend")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pagedgen max_num_seqs")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per task and backend; the median is reported")
    ap.add_argument("--warmup-docs", type=int, default=4, help="documents per task in the untimed warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    ap.add_argument("--out", default=None, help="folder for lm_eval_tasks.json")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks or not set(args.tasks) <= set(TASKS):
        ap.error(f"--tasks must name some of {', '.join(TASKS)}, got {args.tasks}")
    if min(args.repeats, args.num_docs, args.num_roll_docs, args.gen_tokens, args.max_length) < 1 or args.gen_tokens >= args.max_length:
        ap.error("need --repeats, --num-docs, --num-roll-docs >= 1 and 1 <= --gen-tokens < --max-length")
    return args


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_folder(args, tmp: str) -> tuple[str, str]:
    """(checkpoint folder, dtype): the given one, or random-135m (built once, cached in benchmarks/.models/)."""
    if args.model == "random-135m":
        from _workload import ensure_random_model  # the throughput harness's cached random checkpoints

        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        folder, _ = ensure_random_model("random-135m", dtype)
        return folder, dtype
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"no config.json in {args.model}: give a checkpoint folder or random-135m")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    return args.model, (cfg.get("dtype") or cfg.get("torch_dtype") or "float32") if args.dtype == "auto" else args.dtype


def build_lm(backend: str, folder: str, dtype: str, args):
    """The lm_eval LM of one backend (constructed once, reused for every task and repeat)."""
    if backend == "pagedgen":
        from pagedgen.integrations.lm_eval import PagedGenLM

        return PagedGenLM(pretrained=folder, dtype=dtype, max_length=args.max_length, device=args.device, max_num_seqs=args.max_num_seqs)
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, dtype=dtype, max_length=args.max_length, device=args.device, batch_size=args.hf_batch_size)


def evaluate(lm, task: str, task_manager, limit=None) -> tuple[float, float]:
    """(wall seconds, score) of one task."""
    import lm_eval

    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, limit=limit, bootstrap_iters=0, verbosity="ERROR")
    return time.perf_counter() - start, float(res["results"][task][METRICS[task]])


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from lm_eval.models.huggingface import HFLM  # noqa: F401  (imports done before anything is timed)
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401  (pagedgen's RoPE uses its module)

    import pagedgen.integrations.lm_eval  # noqa: F401

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder, dtype = model_folder(args, tmp)
        task_dir = os.path.join(tmp, "tasks")
        _example("lm_eval_local_tasks").write_tasks(
            task_dir, TINYSTORIES, num_docs=args.num_docs, num_roll_docs=args.num_roll_docs,
            stories_per_doc=args.stories_per_doc, gen_tokens=args.gen_tokens)
        tm = TaskManager(include_path=task_dir, include_defaults=False)
        print(f"model {args.model} ({dtype}, {args.device}), max_length {args.max_length}, torch threads {torch.get_num_threads()}; "
              f"tasks: ts_mc/ts_gen {args.num_docs} docs, ts_roll {args.num_roll_docs} docs of {args.stories_per_doc} stories, "
              f"gen {args.gen_tokens} tokens; hf batch_size {args.hf_batch_size}, pagedgen max_num_seqs {args.max_num_seqs}; "
              f"median of {args.repeats}")
        results = {}
        for backend in ("pagedgen", "hf"):
            start = time.perf_counter()
            lm = build_lm(backend, folder, dtype, args)
            build_s = time.perf_counter() - start
            for task in args.tasks:  # warm-up, untimed
                evaluate(lm, task, tm, limit=args.warmup_docs)
            times, scores = {}, {}
            for task in args.tasks:
                runs = [evaluate(lm, task, tm) for _ in range(args.repeats)]
                times[task] = statistics.median(t for t, _ in runs)
                scores[task] = runs[0][1]
            results[backend] = dict(build_s=build_s, times=times, scores=scores)
            del lm

    print(f"\n{'task':<9} {'pagedgen s':>11} {'hf s':>9} {'hf/pagedgen':>12}   score pagedgen / hf")
    for task in args.tasks:
        p, h = results["pagedgen"]["times"][task], results["hf"]["times"][task]
        sp, sh = results["pagedgen"]["scores"][task], results["hf"]["scores"][task]
        print(f"{task:<9} {p:>11.2f} {h:>9.2f} {h / p:>11.2f}x   {sp:.6g} / {sh:.6g}")
    total_p = sum(results["pagedgen"]["times"].values())
    total_h = sum(results["hf"]["times"].values())
    print(f"{'all':<9} {total_p:>11.2f} {total_h:>9.2f} {total_h / total_p:>11.2f}x")
    print(f"model construction: pagedgen {results['pagedgen']['build_s']:.1f} s, hf {results['hf']['build_s']:.1f} s (not in the task times)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lm_eval_tasks.json"), "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
