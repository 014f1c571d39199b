"""What training does when something goes wrong: signals, non-finite losses, loss spikes, out of memory."""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import FrameType

from gptlab.errors import GptlabError


class Interrupted(GptlabError):
    """Training stopped on a signal after writing a checkpoint; the CLI exits with 128 + the signal number and
    reports it as a stop, not an error."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
        self.label = ""  # "gptlab: stopped by SIGINT ...", not "gptlab: error: ..."


class NonFiniteLoss(GptlabError):
    """The loss or gradient norm of a step was NaN or infinite; that step was not applied."""


class LossSpike(GptlabError):
    """The loss stayed far above its recent mean for several steps in a row."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed: torch's (CUDA, or a CPU allocator's RuntimeError) or numpy's."""
    import torch

    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


class GracefulStop:
    """While active, the first SIGINT / SIGTERM only sets `signum`: the loop finishes its step, writes a
    checkpoint and stops. A second signal stops at once (checkpoints are atomic, so nothing is corrupted)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}  # as signal.signal

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Interrupted(f"stopped at once by a second {signal.Signals(signum).name}; the newest complete "
                              "checkpoint is intact, resume with --resume", signum)
        self.signum = signum
        print(f"\ngptlab: {signal.Signals(signum).name} received: finishing this step and writing a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class SpikeGuard:
    """Flags `patience` consecutive losses above `factor` times the mean of the previous `window` losses.
    factor 0 turns it off."""

    def __init__(self, factor: float, patience: int, window: int = 50):
        self.factor, self.patience = factor, patience
        self.recent: deque[float] = deque(maxlen=window)
        self.streak = 0

    def check(self, step: int, loss: float) -> None:
        """Record the loss of `step`; raises LossSpike when the guard trips."""
        if self.factor <= 0:
            return
        mean = sum(self.recent) / len(self.recent) if len(self.recent) >= 10 else math.inf
        if loss > self.factor * mean:
            self.streak += 1
            if self.streak >= self.patience:
                raise LossSpike(f"step {step}: the loss ({loss:.4f}) has been above {self.factor} x its recent "
                                f"mean ({mean:.4f}) for {self.streak} steps; try a lower --lr or more --warmup-steps")
        else:
            self.streak = 0
            self.recent.append(loss)
