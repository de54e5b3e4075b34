"""``pagedgen.plot`` draws a recorded run into PNG files without a display (Agg, no pyplot)."""
import pytest

pytest.importorskip("matplotlib")

import pagedgen.plot  # noqa: E402
from pagedgen import LLM, RequestOutput, SamplingParams  # noqa: E402
from pagedgen.engine.step_log import StepLog  # noqa: E402
from png_check import check_png  # noqa: E402


@pytest.fixture(scope="module")
def recorded(stories_path, one_torch_thread):
    llm = LLM(stories_path, num_kv_blocks=24, max_model_len=256, max_num_seqs=8, seed=0)
    prompts = ["Once upon a time", "The little dog", "Lily wanted to", "Tom and his mom"] * 4
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8 + 5 * i, n=1 + i % 2) for i in range(len(prompts))]
    log = llm.start_recording()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.stop_recording()
    return llm, log, outputs


def test_steps_figure_to_png(recorded, tmp_path):
    _, log, _ = recorded
    fig = pagedgen.plot.steps(log)
    assert len(fig.axes) == 3 and "preemption" in " ".join(t.get_text() for t in fig.axes[1].get_legend().get_texts())
    path = tmp_path / "steps.png"
    fig.savefig(path)
    check_png(path.read_bytes())
    check_png(fig._repr_png_())  # what a notebook shows


def test_output_tokens_figure_to_png(recorded, tmp_path):
    _, _, outputs = recorded
    fig = pagedgen.plot.output_tokens(outputs, title="tokens")
    assert fig.axes[0].get_title() == "tokens"
    heights = {}
    for bar in fig.axes[0].patches:  # stacked per completion: totals per request
        x = round(bar.get_x() + bar.get_width() / 2)
        heights[x] = heights.get(x, 0) + bar.get_height()
    assert [heights[i] for i in range(len(outputs))] == [sum(len(c.token_ids) for c in o.outputs) for o in outputs]
    path = tmp_path / "tokens.png"
    fig.savefig(path)
    check_png(path.read_bytes())


def test_plot_errors(recorded):
    llm, _, outputs = recorded
    with pytest.raises(TypeError, match="StepLog"):
        pagedgen.plot.steps(outputs)
    llm.start_recording()
    empty = llm.stop_recording()
    assert isinstance(empty, StepLog) and len(empty) == 0
    with pytest.raises(ValueError, match="no steps"):
        pagedgen.plot.steps(empty)
    with pytest.raises(ValueError, match="at least one"):
        pagedgen.plot.output_tokens([])
    with pytest.raises(TypeError, match="item 1"):
        pagedgen.plot.output_tokens([outputs[0], "text"])
    assert isinstance(outputs[0], RequestOutput)


HEADLESS = r"""
import sys
from pagedgen import LLM, SamplingParams
import pagedgen.plot
llm = LLM(sys.argv[1], num_kv_blocks=24, max_model_len=256, seed=0)
log = llm.start_recording()
outputs = llm.generate(["Once upon a time", "The little dog"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
llm.stop_recording()
pagedgen.plot.steps(log).savefig(sys.argv[2] + "/steps.png")
pagedgen.plot.output_tokens(outputs).savefig(sys.argv[2] + "/tokens.png")
print("pyplot" if "matplotlib.pyplot" in sys.modules else "no pyplot")
"""


def test_plot_needs_no_display_nor_pyplot(stories_path, tmp_path):
    """In a fresh process without a display, both figures are written as PNG: Agg draws them, and
    pyplot (with its backend selection and global figure list) is never imported."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", HEADLESS, stories_path, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "no pyplot"
    for name in ("steps.png", "tokens.png"):
        check_png((tmp_path / name).read_bytes())
