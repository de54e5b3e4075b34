"""The progress bar of ``LLM`` calls: finished requests, with the output tokens/s (tqdm)."""
from __future__ import annotations

import time
from typing import Optional

REFRESH_S = 0.5  # seconds between redraws of the tok/s figure while no request finishes


class Progress:
    """A tqdm bar of ``total`` requests (None: unknown), or nothing when ``enabled`` is False.

    ``num_generated_tokens``: the engine's running count of generated tokens now;
    ``update(num_finished, num_generated_tokens)`` after each engine step: the requests that
    finished in it, and that count again (for the output tok/s figure).
    """

    def __init__(self, enabled: bool, total: Optional[int], desc: str, num_generated_tokens: int = 0) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        self._start = self._shown = time.perf_counter()
        self._tokens0 = num_generated_tokens

    def update(self, num_finished: int, num_generated_tokens: int) -> None:
        if self.bar is None:
            return
        now = time.perf_counter()
        if num_finished or now - self._shown >= REFRESH_S:  # tok/s moves while no request finishes too
            rate = (num_generated_tokens - self._tokens0) / max(now - self._start, 1e-9)
            self.bar.set_postfix_str(f"output {rate:.0f} tok/s", refresh=False)
            if num_finished:
                self.bar.update(num_finished)  # redraws (postfix included) at most every tqdm mininterval
            else:
                self.bar.refresh()
            self._shown = now

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
