"""Timing loops from Python, shared by the measurement workers, the executable and the peers.

Never assert on what they return in a test: timings on a shared machine vary several-fold.
"""
from __future__ import annotations

import time
from typing import Any, Callable


def time_calls(call: Callable[[], Any], runs: int, warmup: int = 0) -> list[float]:
    """Seconds of each of `runs` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def time_repeats(call: Callable[[], Any], repeats: int, min_repeat_s: float) -> list[float]:
    """Seconds per call, one value per repeat; each repeat runs the call enough times to last
    `min_repeat_s` (measured from one call after a warm-up call)."""
    call()
    t0 = time.perf_counter()
    call()
    number = max(1, int(min_repeat_s / max(time.perf_counter() - t0, 1e-7)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        out.append((time.perf_counter() - t0) / number)
    return out
