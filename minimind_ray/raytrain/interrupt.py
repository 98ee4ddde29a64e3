"""Ctrl-C (SIGINT) and SIGTERM are a clean stop (issue 54, item 2).

Before, the driver's KeyboardInterrupt went through Ray Train's teardown: the workers trained on for seconds, their
``[checkpoint]`` markers named checkpoints that never reached storage, the staging folders stayed in /tmp, the command
exited 1 and the MLflow run was FAILED. Now, while a run trains (``driver.fit``):

* the first signal asks the workers to stop (:class:`StopRequest`; the driver's progress thread hands it to the run's
  progress actor). The workers see it where they already ask Ray for a drain notice (raytrain/preemption.py, every
  ``checkpoint.preemption_check_interval`` steps, else every ``train.log_interval``; rank 0 asks, every rank takes its
  answer), and take the notice's path: that step is logged and checkpointed, and the loop ends. The workers wait for
  the uploads of every checkpoint they announced (raytrain/worker.py:wait_for_uploads) and remove their staging
  folders; the driver marks the MLflow run KILLED, says the step and the checkpoint the run ends on, and exits
  128 + the signal (130, 143) with :class:`Interrupted`. The same command resumes it.
* a second signal stops at once (Ray Train's teardown), says what may be lost, and exits the same way.

Only the main thread can take signals: a run trained elsewhere (a sweep's trial) keeps Ray's handling.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Optional


class Interrupted(Exception):
    """The run stopped on the operator's signal: its one line is said already; ``exit_code`` is 128 + the signal."""

    def __init__(self, msg: str, exit_code: int):
        super().__init__(msg)
        self.exit_code = exit_code


class StopRequest:
    """The operator's stop of one run: set by the first signal, read by the progress thread and the driver."""

    def __init__(self):
        self.event = threading.Event()
        self.signum: Optional[int] = None

    @property
    def asked(self) -> bool:
        return self.event.is_set()

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest):
    """While the run trains: SIGINT and SIGTERM set ``stop`` (the first) or raise KeyboardInterrupt (the second)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.asked:
            print("[minimind-ray] second interrupt: stopping at once; checkpoints whose upload had not finished, and "
                  "the steps after the last one in storage, may be lost", flush=True)
            raise KeyboardInterrupt
        stop.signum = signum
        stop.event.set()
        print(f"[minimind-ray] {signal.Signals(signum).name}: stopping at the next step the workers check, with a "
              f"checkpoint, once every checkpoint announced is in storage (interrupt again to stop at once)",
              flush=True)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
