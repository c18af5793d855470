"""Which executable a host loop (scheduler.py) runs for a plan key, and what compiling cost it.

With `compile_in_loop` (the library, the CLI) a key that is not compiled yet compiles on the loop's
thread. Without it (a server, whose engine/warmup.py compiles the plan's keys in the background)
a key runs on the cheapest compiled key that covers it (plan keys' `covers`: more rows, a larger
bucket, a wider mode) until its own is ready; only a key nothing compiled covers compiles here.
The keys that ran on a stand-in are kept (`wanted`, the latest last): the background compiles
what running requests need first (on a CPU a stand-in can cost several times its own key).
"""

from __future__ import annotations


class ExecutablePool:
    """A model's executables as one host loop takes them; counts the compile seconds the loop
    waited for (`compile_s`) and the dispatches that ran on a stand-in (`stand_ins`)."""

    def __init__(self, model, compile_in_loop: bool = True):
        self.model, self.compile_in_loop = model, compile_in_loop
        self.compile_s = 0.0
        self.stand_ins = 0
        # keys that ran on a stand-in or skipped their work, not compiled yet: the latest last
        self.wanted: dict = {}

    def _want(self, key) -> None:
        self.wanted.pop(key, None)
        self.wanted[key] = None

    def wanted_keys(self) -> list:
        """The keys running requests waited for, the latest first (safe from another thread)."""
        return [k for k in reversed(tuple(self.wanted)) if not self.model.is_compiled(k)]

    def compile(self, keys) -> float:
        """Compile what is not compiled yet; returns the seconds spent."""
        spent = sum(self.model.executable(k)[1] for k in keys)
        self.compile_s += spent
        return spent

    def get(self, key):
        """The executable of key (compiled now if it is not yet)."""
        exe, dt = self.model.executable(key)
        self.compile_s += dt
        return exe

    def _covering(self, key, start: int = 0) -> list:
        return [
            k for k in self.model.compiled_keys() if type(k) is type(key) and k.covers(key, start)
        ]

    def runnable(self, key, start: int = 0):
        """The key to run for `key`: itself, or (compile_in_loop off) the cheapest compiled key
        that covers it while its own is not compiled yet."""
        if self.compile_in_loop or self.model.is_compiled(key):
            return key
        covering = self._covering(key, start)
        if not covering:
            # nothing compiled serves it: compile here (a server compiles plan.ready_keys first)
            return key
        self.stand_ins += 1
        self._want(key)
        return min(covering, key=lambda k: k.cost)

    def ready_key(self, key):
        """The key to run for optional work (speculation), or None where that would compile on
        the loop's thread: a server skips such work until its background has compiled a key for
        it."""
        if self.compile_in_loop or self.model.is_compiled(key) or self._covering(key):
            return self.runnable(key)
        self._want(key)
        return None
