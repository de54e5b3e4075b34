"""The README's main job: examples/offline_batch.py on 1,000 TinyStories openings with stories260K."""
import os
import re
import subprocess
import sys

from conftest import ROOT


def test_example_runs_1000_prompts_end_to_end(stories_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "offline_batch.py"), "--no-tqdm"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    m = re.search(r"^1000 requests, (\d+) prompt tokens, (\d+) output tokens", out, re.M)
    assert m and int(m.group(2)) > 1000 * 16, out[-2000:]
    assert re.search(r"throughput: [\d,]+ output tokens/s", out)
    assert re.search(r"utilisation \(real tokens / allocated slots\) mean \d+\.\d%", out)
    assert re.search(r"preemptions: \d+", out)
    assert out.count("  -> ") == 3  # three sample completions
