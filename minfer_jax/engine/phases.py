"""Start-up phase timing: where a start's seconds go (load() records them on Model.startup; the CLI
and the server print them; bench/startup.py tabulates them)."""

from __future__ import annotations

import os
import time


class PhaseTimer:
    """Seconds per named phase, each phase ending at the mark that names it."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> float:
        """End phase `name` now (a repeated name adds up); returns its seconds this time."""
        now = time.perf_counter()
        dt = now - self._last
        self.phases[name] = self.phases.get(name, 0.0) + dt
        self._last = now
        return dt

    def skip(self) -> None:
        """Start the next phase now (what ran since the last mark belongs to no phase)."""
        self._last = time.perf_counter()


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the interpreter's start
    and imports before any timer of ours existed."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start_ticks = int(
            fields[19]
        )  # field 22 (starttime) counted after the ")" of the command name
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def format_phase(name: str, seconds: float) -> str:
    """One line per phase, the same in the CLI's --verbose output and the server's log."""
    return f"startup: {name} {seconds:.2f} s"


def format_executable(record) -> str:
    """An executable's line (executables.ExecutableRecord): its source and the seconds of each
    step."""
    return format_phase(
        f"executable {record.label} ({record.source}: lower {record.lower_s:.2f}, compile "
        f"{record.compile_s:.2f}, store load {record.load_s:.2f}, save {record.save_s:.2f})",
        record.total_s,
    )
