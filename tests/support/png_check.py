"""A check of drawn charts, shared by the plot tests (api/test_plot.py, project/test_benchmark_plots.py)."""
import io

import pytest

PIL = pytest.importorskip("PIL.Image")


def check_png(data: bytes, min_width: int = 400) -> None:
    """A valid PNG of a real picture: decodes, is large enough, and has many distinct colours."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    PIL.open(io.BytesIO(data)).verify()
    image = PIL.open(io.BytesIO(data)).convert("RGB")
    assert image.width >= min_width and image.height >= 200
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 32  # lines, text, fills: not a blank canvas
    assert max(count for count, _ in colors) < 0.97 * image.width * image.height

