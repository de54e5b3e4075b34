"""The wheel, as a user gets it: built from a clean copy of the checkout, installed on its own,
imported from outside the checkout, generating, and passing the op tests with each instruction-set
level of the CPU kernels this CPU runs forced (``PAGEDGEN_CPU_ISA``).

The suite otherwise runs on the checkout itself (an editable install or PYTHONPATH), which cannot see a
package that pyproject.toml leaves out of the wheel. The wheel is built with the CPU kernels only
(``PAGEDGEN_NO_CUDA=1``: the CUDA kernels are compiled by scripts/setup.sh's build and
tests/project/test_setup_toolkit.py checks how setup.py finds the toolkit), and with the levels this
CPU runs only (``PAGEDGEN_CPU_LEVELS``): a level it cannot run could not be tested here, and the
checkout's own build (scripts/setup.sh) compiles every level, so each level's sources compile.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT
from outside_checkout import pytest_argv, python_c
from pagedgen import ops
from pagedgen.ops import isa

# Building the wheel compiles the CPU kernels once per level this CPU runs: about 70 s a level on a
# quiet 2-core machine (MAX_JOBS=2; two or three times that on one shared with other builds). "slow" is a label only: the README's test command runs every test
# of tests/, these included.
pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The little dog"]
MAX_TOKENS = 8

# Run in a fresh interpreter whose cwd is a temporary folder and whose PYTHONPATH is the install target
# alone: prints where each pagedgen module came from and the greedy token ids of PROMPTS.
CHILD = """
import json, sys
import pagedgen.ops
from pagedgen import LLM, SamplingParams

llm = LLM(sys.argv[1], enforce_extension=True)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
files = {name: getattr(m, "__file__", None) for name, m in sys.modules.items() if name == "pagedgen" or name.startswith("pagedgen.")}
print(json.dumps({"cpu_kernels": pagedgen.ops.extension_available("cpu"), "files": files,
                  "token_ids": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def _source_packages() -> list[str]:
    """Every package of the source tree: each folder under pagedgen/ with an __init__.py."""
    found = []
    for folder, dirs, files in os.walk(os.path.join(ROOT, "pagedgen")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if "__init__.py" in files:
            found.append(os.path.relpath(folder, ROOT).replace(os.sep, "."))
    return sorted(found)


def _clean_copy(dst: str) -> None:
    """The files git sees in the checkout (tracked, or new and not ignored), as they are on disk:
    no build/, no in-place pagedgen/_C*.so, no .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):  # a tracked file deleted in the working tree is left out
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(install target, wheel path): the wheel of a clean copy, pip-installed alone into a folder."""
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        pytest.skip("needs git and a git checkout to copy the tracked files from")
    tmp = tmp_path_factory.mktemp("wheel")
    src, wheels, target = str(tmp / "src"), str(tmp / "dist"), str(tmp / "site")
    _clean_copy(src)
    assert not os.path.exists(os.path.join(src, "build")) and not any(f.startswith("_C") for f in os.listdir(os.path.join(src, "pagedgen")))
    levels = ",".join(isa.supported_levels()) if ops._IMPORT_ERROR is None else ""
    env = dict(os.environ, PAGEDGEN_NO_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "2"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               PAGEDGEN_CPU_LEVELS=levels or "generic")
    env.pop("PYTHONPATH", None)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-w", wheels, src],
        capture_output=True, text=True, env=env, timeout=1800,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = [os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl")]
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target", target, wheel],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return target, wheel


def test_wheel_holds_every_package_and_module_of_the_tree(installed):
    _, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = _source_packages()
    assert "pagedgen.layers" in packages and len(packages) >= 8
    missing = [p for p in packages if p.replace(".", "/") + "/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel: {missing}"
    modules = sorted(
        os.path.relpath(os.path.join(folder, f), ROOT).replace(os.sep, "/")
        for folder, _, files in os.walk(os.path.join(ROOT, "pagedgen")) if "__pycache__" not in folder
        for f in files if f.endswith(".py")
    )
    assert [m for m in modules if m not in names] == []
    assert any(n.startswith("pagedgen/_C") and n.endswith(".so") for n in names), "the compiled extension is missing"
    assert not any("/tests/" in n or n.startswith(("tests/", "csrc/", "build/")) for n in names)


def test_installed_wheel_imports_outside_the_checkout_and_generates(installed, stories_path, llm, tmp_path):
    from pagedgen import SamplingParams

    target, _ = installed
    env = dict(os.environ, PYTHONPATH=target)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, stories_path, json.dumps(PROMPTS), str(MAX_TOKENS)],
        cwd=str(tmp_path), capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every pagedgen module came from the install (not from the checkout, e.g. through an editable
    # install's finder, which serves a subpackage missing from the wheel out of the checkout).
    outside = {name: f for name, f in got["files"].items() if f is not None and not f.startswith(target + os.sep)}
    assert not outside, f"modules loaded from outside the installed wheel: {outside}"
    assert "pagedgen._C" in got["files"] and got["cpu_kernels"], "the installed compiled extension did not load"
    want = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert got["token_ids"] == [list(o.outputs[0].token_ids) for o in want]
    assert all(len(ids) == MAX_TOKENS for ids in got["token_ids"])


def test_installed_console_script_runs(installed, tmp_path):
    target, _ = installed
    script = os.path.join(target, "bin", "pagedgen")
    assert os.path.isfile(script), "the pagedgen console script is missing from the wheel"
    proc = subprocess.run(
        [sys.executable, script, "--help"], cwd=str(tmp_path), capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=target), timeout=300,
    )
    assert proc.returncode == 0 and "--model" in proc.stdout, proc.stderr[-3000:]


#: The op test files: every CPU kernel against its reference (tests/ops/).
OP_TESTS = ["tests/ops/test_ops.py", "tests/ops/test_ops_checks.py", "tests/ops/test_ops_attention.py",
            "tests/ops/test_layer_ops.py", "tests/ops/test_ops_argmax.py", "tests/ops/test_ops_logprob_topk.py",
            "tests/ops/test_packed_linear.py",
            "tests/ops/test_packed_linear_amx.py", "tests/ops/test_ops_batch_invariance.py", "tests/ops/test_kv_quant.py",
            "tests/ops/test_add_lora_linear.py", "tests/ops/test_int4_linear.py", "tests/ops/test_fp8_linear.py",
            "tests/ops/test_varlen_attention.py", "tests/ops/test_layer_norm.py"]


@pytest.mark.parametrize("level", isa.LEVELS)
def test_installed_wheel_passes_the_op_tests_with_each_level_forced(installed, level):
    """Each level this CPU runs, forced, from the installed wheel: the op test files in full for the
    levels below the best one; for the best one (which the rest of the suite runs, from the same
    sources) the quick check of every kernel in tests/ops/test_isa.py."""
    if ops._IMPORT_ERROR is not None or level not in isa.supported_levels():
        pytest.skip(f"this CPU (or its OS) does not run the {level} level")
    target, wheel = installed
    assert any(n == f"pagedgen/_C_cpu_{level}" for n in (p.split(".")[0] for p in zipfile.ZipFile(wheel).namelist()))
    # The working directory (the checkout) is not first on sys.path, and PYTHONPATH puts the wheel's
    # pagedgen ahead of the checkout's editable install.
    env = dict(os.environ, PYTHONPATH=target, PAGEDGEN_CPU_ISA=level)
    where = subprocess.run(python_c("import json, pagedgen, pagedgen.ops as o; "
                                    "print(json.dumps([pagedgen.__file__, o.cpu_isa(), o.extension_error('cpu')]))"),
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    file, loaded, error = json.loads(where.stdout.strip().splitlines()[-1])
    assert file.startswith(target + os.sep) and loaded == level and error == "", (file, loaded, error)
    best = isa.supported_levels()[-1]
    files = OP_TESTS if level != best else ["tests/ops/test_isa.py::test_every_level_this_cpu_runs_matches_the_reference"]
    res = subprocess.run(pytest_argv("-q", "-x", "-p", "no:cacheprovider", *files),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0 and " passed" in res.stdout and " failed" not in res.stdout, tail
