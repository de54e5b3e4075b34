"""setup.py finds the CUDA toolkit itself (a folder with bin/nvcc and lib64/libcudart*), through a
wrapper nvcc on the PATH too, instead of torch's guess (the wrapper's parent folder, where linking
fails with ``cannot find -lcudart``)."""
import importlib.util
import os

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its setup() call runs only as __main__, as pip's build backend runs it)."""
    spec = importlib.util.spec_from_file_location("pagedgen_setup_py", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toolkit(folder) -> str:
    """A fake CUDA toolkit: an executable bin/nvcc and lib64/libcudart.so."""
    (folder / "bin").mkdir(parents=True)
    (folder / "lib64").mkdir()
    nvcc = folder / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho fake nvcc\n")
    nvcc.chmod(0o755)
    (folder / "lib64" / "libcudart.so").write_bytes(b"")
    return str(folder)


def _wrapper(folder, toolkit: str) -> str:
    """A folder holding only an nvcc script that execs ``toolkit``'s nvcc (as /usr/local/bin/nvcc does)."""
    folder.mkdir()
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\nexec {toolkit}/bin/nvcc \"$@\"\n")
    nvcc.chmod(0o755)
    return str(folder)


def test_a_wrapper_nvcc_on_the_path_leads_to_its_toolkit(setup_py, tmp_path, monkeypatch):
    toolkit = _toolkit(tmp_path / "cuda-99.1")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", _wrapper(tmp_path / "wrapbin", toolkit))
    assert setup_py.find_cuda_home() == toolkit
    assert not setup_py.is_cuda_toolkit(str(tmp_path))  # the wrapper's parent: torch's guess


def test_a_symlinked_nvcc_leads_to_its_toolkit(setup_py, tmp_path, monkeypatch):
    toolkit = _toolkit(tmp_path / "toolkit")
    (tmp_path / "bin").mkdir()
    os.symlink(os.path.join(toolkit, "bin", "nvcc"), tmp_path / "bin" / "nvcc")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert setup_py.find_cuda_home() == toolkit


def test_cuda_home_wins_when_it_holds_a_toolkit_and_is_passed_over_when_not(setup_py, tmp_path, monkeypatch, capsys):
    chosen = _toolkit(tmp_path / "chosen")
    other = _toolkit(tmp_path / "other")
    monkeypatch.setenv("PATH", _wrapper(tmp_path / "wrapbin", other))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", chosen)
    assert setup_py.find_cuda_home() == chosen
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "wrapbin"))  # no lib64/libcudart*: not a toolkit
    assert setup_py.find_cuda_home() == other
    assert "holds no CUDA toolkit" in capsys.readouterr().err


def test_this_machine_toolkit_is_found_without_cuda_home(setup_py, monkeypatch):
    """Where a toolkit is installed at the usual place, it is found with CUDA_HOME unset."""
    if not setup_py.is_cuda_toolkit("/usr/local/cuda"):
        pytest.skip("no CUDA toolkit in /usr/local/cuda")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found = setup_py.find_cuda_home()
    assert found is not None and setup_py.is_cuda_toolkit(found)


class _Torch:
    """The two fields of torch that setup.py's choice reads."""

    def __init__(self, cuda):
        self.version = type("version", (), {"cuda": cuda})()
        self.__version__ = "2.x+test"


def test_no_toolkit_builds_the_cpu_kernels_alone_with_a_warning(setup_py, monkeypatch, capsys):
    monkeypatch.setattr(setup_py, "find_cuda_home", lambda: None)
    monkeypatch.delenv("PAGEDGEN_NO_CUDA", raising=False)
    assert setup_py._use_cuda(_Torch("13.0")) is False
    err = capsys.readouterr().err
    assert "WARNING" in err and "no CUDA toolkit was found" in err and "CPU kernels only" in err
    assert setup_py._use_cuda(_Torch(None)) is False and capsys.readouterr().err == ""  # a CPU-only torch: nothing to say


def test_the_toolkit_found_is_the_one_cpp_extension_uses(setup_py, tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    toolkit = _toolkit(tmp_path / "cuda")
    monkeypatch.setattr(setup_py, "find_cuda_home", lambda: toolkit)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)  # restored afterwards
    monkeypatch.setenv("CUDA_HOME", "")
    monkeypatch.delenv("PAGEDGEN_NO_CUDA", raising=False)
    assert setup_py._use_cuda(_Torch("13.0")) is True
    assert os.environ["CUDA_HOME"] == toolkit and cpp_extension.CUDA_HOME == toolkit
    monkeypatch.setenv("PAGEDGEN_NO_CUDA", "1")
    assert setup_py._use_cuda(_Torch("13.0")) is False
