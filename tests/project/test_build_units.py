"""setup.py compiles the CPU kernels as two units per level: csrc/cpu_kernels.cpp (which includes the
kernel files) and csrc/cpu/attention.cpp. Every csrc/cpu/*.cpp must be compiled exactly once, or its
ops would have no CPU kernel (or two registrations)."""
import os
import re

from conftest import ROOT

CSRC = os.path.join(ROOT, "csrc")


def test_every_kernel_file_is_compiled_exactly_once():
    with open(os.path.join(CSRC, "cpu_kernels.cpp")) as f:
        included = re.findall(r'^#include "(cpu/[^"]+\.cpp)"', f.read(), flags=re.M)
    assert len(included) == len(set(included))
    on_disk = {f"cpu/{name}" for name in os.listdir(os.path.join(CSRC, "cpu")) if name.endswith(".cpp")}
    assert set(included) | {"cpu/attention.cpp"} == on_disk and "cpu/attention.cpp" not in included
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_text = f.read()
    assert '"cpu_kernels.cpp"' in setup_text and '"attention.cpp"' in setup_text
