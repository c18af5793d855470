"""Time bounds that a busy machine cannot fail by itself: `Stopwatch().seconds()` is the smaller of
the wall-clock time and this process' CPU time since it started.

A runaway input (a loop over 2**60 empty reads, a template bomb, a re-hash of 491 MB) burns CPU
and exceeds a bound on both clocks; a CI machine whose 2 cores are shared with another test worker
(or swapping) stretches the wall clock only. CPU time counts every thread of this process, so work
handed to a worker thread still counts; work done by another process (a server) counts with
`Stopwatch(pid)`.
"""

from __future__ import annotations

import os
import time


class Stopwatch:
    """pid: count that process' CPU time instead of this one's (a server under test; Linux's
    /proc)."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.wall0, self.cpu0 = time.perf_counter(), self._cpu_now()

    def _cpu_now(self) -> float:
        if self.pid is None:
            return time.process_time()
        with open(f"/proc/{self.pid}/stat") as f:  # utime and stime: fields 14 and 15, in ticks
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    def cpu(self) -> float:
        return self._cpu_now() - self.cpu0

    def seconds(self) -> float:
        """min(wall, CPU): over a bound only where this process really worked that long."""
        return min(self.wall(), self.cpu())

    def __str__(self) -> str:
        return f"{self.wall():.2f} s wall, {self.cpu():.2f} s CPU"
