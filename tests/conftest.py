"""Shared fixtures: paths of ../shared (models, data) and a session-wide stories260K LLM."""
import json
import os
import signal
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("PAGEDGEN_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
STORIES = os.path.join(SHARED, "models", "stories260K")
GPT2_TOKENIZER = os.path.join(SHARED, "models", "gpt2-tokenizer")
TINYSTORIES = os.path.join(SHARED, "data", "tinystories_valid_first1000", "tinystories_valid_first1000.jsonl")


def story_openings(n: int, seed: int = 0) -> list[str]:
    """``n`` TinyStories openings of varied length (first 3 to 40 words of each story)."""
    import random

    rng = random.Random(seed)
    out = []
    with open(TINYSTORIES) as f:
        for line in f:
            words = json.loads(line)["text"].split()
            out.append(" ".join(words[: rng.randint(3, 40)]))
            if len(out) == n:
                break
    return out


@pytest.fixture(autouse=True)
def _sigint_handler_restored():
    """Whatever a test does to SIGINT's handler is undone after it: a pytest-xdist worker runs many
    test files in one process, and a Ctrl-C test needs Python's own handler (a CI run had three fail
    with "DID NOT RAISE KeyboardInterrupt" after other files had run in their workers)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main else None
    yield
    if main and signal.getsignal(signal.SIGINT) is not before and before is not None:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt in the main thread) for this test, the one restored after."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="session")
def stories_path():
    if not os.path.isdir(STORIES):
        pytest.skip(f"model not found at {STORIES} (set PAGEDGEN_SHARED)")
    return STORIES


@pytest.fixture(scope="session")
def hf_model(stories_path):
    """transformers' own LlamaForCausalLM of stories260K (the oracle), fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_path, dtype="float32").eval()


@pytest.fixture(scope="session")
def hf_tokenizer(stories_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="session")
def llm(stories_path):
    from pagedgen import LLM

    return LLM(stories_path, enforce_extension=False)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """A tiny random Llama with the GPT-2 tokenizer's first 4,096 ids; its EOS is id 0 ("!")."""
    import tiny_checkpoints

    folder = tmp_path_factory.mktemp("tiny-llama-gpt2")
    tiny_checkpoints.build("llama", str(folder))
    return str(folder)


def tiny_prompts(n: int) -> list[list[int]]:
    """``n`` token-id prompts of whole words of the GPT-2 tokenizer (ids 256..4095, so that no prompt
    ends inside a UTF-8 character), for ``tiny_gpt2``."""
    return [[256 + (i * 37) % 3800, 256 + (i * 101) % 3800, 256 + (i * 13) % 3800] for i in range(n)]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module: the reference ops run many tiny kernels, and on a shared
    CPU several threads each spin and wait on the others (a step gets tens of times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_example(name: str):
    """The module examples/<name>.py, imported from its file (examples/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_addoption(parser):
    parser.addoption(
        "--executor-backend",
        default=None,
        choices=("mp", "pickle"),
        help="run every LLM made without an explicit distributed_executor_backend through this backend "
        "('pickle': the worker behind a pickled record/reply boundary; 'mp': a worker process)",
    )


@pytest.fixture(scope="session", autouse=True)
def executor_backend(request):
    """With ``--executor-backend``, LLMs default to that backend: the engine tests run through the
    driver/worker boundary (``pytest --executor-backend=pickle tests/engine/test_engine.py``)."""
    backend = request.config.getoption("--executor-backend")
    if backend is None:
        yield None
        return
    import functools

    from pagedgen import llm as llm_module

    real = llm_module.LLM.__init__

    @functools.wraps(real)
    def init(self, *args, **kwargs):
        kwargs.setdefault("distributed_executor_backend", backend)
        real(self, *args, **kwargs)

    llm_module.LLM.__init__ = init
    try:
        yield backend
    finally:
        llm_module.LLM.__init__ = real


def pytest_configure(config):
    config.addinivalue_line("markers", "in_process: reaches into the in-process model runner (skipped with --executor-backend)")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # pytest-xdist: the cores are shared out among the workers (and the processes they start)
        import torch

        threads = str(max(1, (os.cpu_count() or 1) // int(workers)))
        os.environ["OMP_NUM_THREADS"] = threads
        torch.set_num_threads(int(threads))


@pytest.fixture(autouse=True)
def _skip_in_process_only(request, executor_backend):
    if executor_backend is not None and request.node.get_closest_marker("in_process") is not None:
        pytest.skip(f"reaches into the in-process model runner; --executor-backend={executor_backend}")
