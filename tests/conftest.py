"""Shared fixtures: paths of ../shared (models, data) and a session-wide stories260K LLM."""
import json
import os

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
