"""Time bounds that a busy machine cannot fail by itself: `Stopwatch().seconds()` is the smaller of
the wall-clock time and this process' CPU time since it started.

A runaway input (a loop over 2**60 empty reads, a template bomb, a re-hash of 491 MB) burns CPU
and exceeds a bound on both clocks; a CI machine whose 2 cores are shared with another test worker
(or swapping) stretches the wall clock only. CPU time counts every thread of this process, so work
handed to a worker thread still counts; work done by another process (a server) does not: bound
that with the wall clock.
"""

from __future__ import annotations

import time


class Stopwatch:
    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu(self) -> float:
        return time.process_time() - self.cpu0

    def seconds(self) -> float:
        """min(wall, CPU): over a bound only where this process really worked that long."""
        return min(self.wall(), self.cpu())

    def __str__(self) -> str:
        return f"{self.wall():.2f} s wall, {self.cpu():.2f} s CPU"
