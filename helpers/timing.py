"""Honest timing: warmed up, the median of repeats, every timed call ending on a host read of its
result (a device's synchronize alone may return early), and the process's host memory peak."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import statistics
import time
from collections.abc import Mapping
from typing import Callable

from tqdm.auto import tqdm


@dataclasses.dataclass
class Timing:
    """Seconds per call over the timed repeats, and the last call's output."""

    times: list[float]
    last: object = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms (min {self.min * 1e3:.3f}, max {self.max * 1e3:.3f}, n={len(self.times)})"


def host_read(out) -> None:
    """Bring one number of ``out`` to the host: a timed call ends only when its result is there. A
    device's synchronize alone may return early (TorchTPU's did before torch_tpu#2494: a compiled
    op timed at 0.1 ms against 89 ms, pytorch/helion#3155); a lazy backend computes nothing unread."""
    if isinstance(out, Mapping):  # a model's output: its logits
        out = list(out.values())
    if isinstance(out, (list, tuple)):  # a step's (token, position): the token
        out = next((o for o in out if hasattr(o, "tolist")), None)
    if hasattr(out, "tolist"):
        out.reshape(-1)[-1:].tolist()


def time_fn(
    fn: Callable, *args, sync: Callable[[], None], warmup: int = 2, repeats: int = 10, desc: str | None = None, **kwargs
) -> Timing:
    """Time ``fn(*args, **kwargs)`` after ``warmup`` calls; each call ends on ``host_read`` of its
    output and ``sync`` (the rest of the device's queue)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        out = fn(*args, **kwargs)
        host_read(out)
        sync()
    times = []
    for _ in tqdm(range(repeats), desc=desc, disable=desc is None, leave=False):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        host_read(out)
        sync()
        times.append(time.perf_counter() - start)
    return Timing(times, out)


def time_fed(step: Callable, state: tuple, *, sync: Callable[[], None], repeats: int, warmup: int = 0) -> Timing:
    """``time_fn`` for a step fed its own output (``state = step(*state)``), as a decode step is."""
    box = [state]

    def fed():
        box[0] = step(*box[0])
        return box[0]

    return time_fn(fed, sync=sync, warmup=warmup, repeats=repeats)


def host_peak_bytes() -> int | None:
    """Peak resident host memory since start or ``reset_host_peak()``: Linux's VmHWM (None elsewhere),
    counting the touched pages of a memory-mapped checkpoint."""
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return None
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return kb and int(kb) * 1024


def reset_host_peak() -> None:
    """Start a new peak for ``host_peak_bytes`` from now (Linux only): a peak per phase."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")
