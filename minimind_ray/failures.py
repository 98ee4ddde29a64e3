"""A failed attempt of a run, classed by where it came from (docs/reliability.md, "Mistakes and faults").

Ray Train restarts the worker group after any worker error, up to ``cluster.max_failures`` times. That is right for a
fault, wrong for a mistake: a worker that cannot load the weights it was given fails the same way on every restart.
So every failure is one of three kinds, decided in the Train controller from all the ranks' errors together
(:func:`classify`):

* **fault**: a process died (SIGKILL, a lost node, an out-of-memory kill), a collective failed or timed out, the
  storage answered with a transient I/O error, a drain notice, or an entry of ``train.faults``. Retried within
  ``cluster.max_failures`` as before.
* **mistake**: the user's input is at fault, marked where it is read (:func:`reading`: the weights of
  ``train.init_from``, a reference or teacher, the prepared data, a checkpoint) or where a user's plug-in is called
  (:func:`plugin_call`: a reward term, a tool). Never retried, unless ``cluster.retry_mistakes`` (a flaky plug-in).
* **error**: anything else (a bug, in the project or elsewhere). Retried once; when the next attempt fails the same
  way (:func:`signature`: the exception's type, its message with pids, addresses and times normalised away, and the
  step it failed at) the run ends.

A fault wins over the rest: when one rank is SIGKILLed, the others see their collectives fail, and none of that is the
user's doing. This module is light (no torch, no Ray): the controller, the workers and the driver all read it.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

FAULT, MISTAKE, ERROR = "fault", "mistake", "error"
STEP_ATTR = "minimind_step"  # set on a worker's exception: the step it failed at (raytrain/worker.py)
TRACEBACK_ATTR = "minimind_traceback"  # and its traceback, as text (an exception's traceback does not travel)


class Mistake(Exception):
    """A failure whose cause is the user's input (``where``: the field or plug-in, with its value); never retried."""

    def __init__(self, where: str, message: str):
        super().__init__(where, message)
        self.where, self.message = where, message

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"

    def __reduce__(self):  # the state too: the step a worker failed at travels with it (STEP_ATTR)
        return type(self), (self.where, self.message), dict(self.__dict__)


def one_line(e: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, at most ``limit`` characters."""
    text = " ".join(str(e).split())
    line = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


# OSErrors that say the input is not there or not allowed (a mistake); any other OSError is transient storage
# trouble (a reset connection, an S3 error, a timeout): a fault, retried
MISSING = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def is_transient(e: BaseException) -> bool:
    """A transient I/O error or a failed collective: a fault wherever it is raised."""
    if isinstance(e, OSError) and not isinstance(e, MISSING):
        return True
    module, name = type(e).__module__ or "", type(e).__name__
    if module.startswith("torch.distributed") or name in DIST_ERRORS or name in RAY_DEATHS:
        return True
    return isinstance(e, RuntimeError) and bool(COLLECTIVE.search(str(e)))


# what gloo and NCCL say when a peer is gone or late (a collective of a healthy rank whose peer died)
COLLECTIVE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|ProcessGroupGloo|"
                        r"ProcessGroupNCCL|NCCL (error|communicator)|Timed out waiting|timed out after|"
                        r"\[gloo/|gloo::|Socket Timeout", re.IGNORECASE)
INJECTED = "(train.faults"  # every injected fault's message says so (raytrain/faults.py)
DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
# Ray's errors for a process or node that is gone (a rollout actor's, a reward model actor's)
RAY_DEATHS = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "NodeDiedError", "WorkerCrashedError",
              "ObjectLostError", "OwnerDiedError", "ObjectReconstructionFailedError", "LocalRayletDiedError")  # every injected fault's message says so (raytrain/faults.py)


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """Inside: a run's input is read (``where`` names the field and its value). What fails there is a
    :class:`Mistake`, except a transient I/O error, which stays what it is (a fault)."""
    try:
        yield
    except Mistake:
        raise
    except Exception as e:
        if is_transient(e):
            raise
        raise Mistake(where, one_line(e)) from e


@contextlib.contextmanager
def plugin_call(where: str) -> Iterator[None]:
    """Inside: a user's plug-in runs (``where``: the field and the plug-in's name). Its exceptions are a
    :class:`Mistake`, except an ``OSError`` (a network call that failed: transient, retried like a fault)."""
    try:
        yield
    except Mistake:
        raise
    except Exception as e:
        if isinstance(e, OSError):
            raise
        raise Mistake(where, one_line(e)) from e


# --------------------------------------------------------------------------- in the controller


@dataclass(frozen=True)
class Verdict:
    kind: str  # FAULT | MISTAKE | ERROR
    rank: Optional[int]  # the rank whose error decided it
    line: str  # the cause, one line
    signature: Tuple[str, str, Optional[int]] = ("", "", None)
    traceback: str = ""  # the worker's traceback of that error, when it has one


def _base(error: BaseException) -> Tuple[Optional[BaseException], str]:
    """(the exception the train function raised, its traceback) of one rank's error; (None, "") when the worker did
    not raise: it died or stopped answering its health check (Ray Train's own errors). Ray Train hands the callback
    the train function's exception itself (its wrapper's traceback text stays behind: the worker attaches its own,
    :data:`TRACEBACK_ATTR`)."""
    base = getattr(error, "_base_exc", error)
    if not isinstance(base, Mistake) and (type(base).__module__ or "").startswith("ray.train"):
        return None, ""
    return base, str(getattr(base, TRACEBACK_ATTR, "") or getattr(error, "_traceback_str", "") or "")


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_NORMALISE = [(re.compile(p), r) for p, r in (
    (r"0x[0-9a-fA-F]+", "0x?"),  # addresses
    (r"\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b", "<ip>"),  # node addresses
    (r"\bpid[=: ]+\d+", "pid=?"),
    (r"\d{4}-\d\d-\d\d[T _]\d\d[:\-]\d\d[:\-]\d\d([.,_]\d+)?", "<time>"),
    (r"\b\d+(\.\d+)?\s*(s|ms|seconds)\b", "<secs>"),
    (r"\b[0-9a-f]{16,}\b", "<id>"),  # actor, task and node ids
)]


def normalise(message: str) -> str:
    for pattern, repl in _NORMALISE:
        message = pattern.sub(repl, message)
    return " ".join(message.split())


def signature(e: BaseException) -> Tuple[str, str, Optional[int]]:
    """(type, message normalised, the step it failed at): two failures with the same signature are one that recurs."""
    return type(e).__name__, normalise(str(e)), getattr(e, STEP_ATTR, None)


def classify(worker_exceptions: Dict[int, BaseException]) -> Verdict:
    """What the ranks' errors of one failed attempt add up to (see the module's docstring)."""
    mistake = error = None
    for rank, wrapped in sorted(worker_exceptions.items()):
        base, tb = _base(wrapped)
        if base is None:  # died or stopped answering: a fault
            return Verdict(FAULT, rank, one_line(wrapped))
        chain = list(_chain(base))
        if any(INJECTED in str(e) for e in chain) or any(is_transient(e) for e in chain if not isinstance(e, Mistake)):
            return Verdict(FAULT, rank, one_line(base))
        found = next((e for e in chain if isinstance(e, Mistake)), None)
        if found is not None and mistake is None:
            mistake = Verdict(MISTAKE, rank, str(found), signature(base), tb)
        elif found is None and error is None:
            error = Verdict(ERROR, rank, one_line(base), signature(base), tb)
    return mistake or error or Verdict(FAULT, None, "no worker error")


class NotPlaced(RuntimeError):
    """What a stage places beside the workers (its record's ``beside``: RL's rollout actors) could not be placed in
    time. Its message is one line that starts with the field to change, ``train.<section>.<field>: ... could not be
    placed ...``; a restart would wait as long, so the controller ends the run (raytrain/faults.py)."""


NOT_PLACED = re.compile(r"train\.[\w.]+: [^\n]*could not be placed[^\n]*")


def not_placed(error: BaseException) -> Optional[str]:
    """The one line of a :class:`NotPlaced` in the text of ``error`` (which may be Ray's wrapper of it), or None."""
    found = NOT_PLACED.search(str(error))
    return found.group(0) if found else None


class RunStopped(RuntimeError):
    """Raised (inside Ray Train's ControllerError) when a failure is not retried: a mistake, or an error that recurred.
    Carries the verdict, so that the driver can say it in one line and keep the traceback in the run's error.log."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict)
        self.verdict = verdict
        self.log: Optional[str] = None  # where the driver wrote the traceback (the run's error.log)

    def __reduce__(self):
        return type(self), (self.verdict,)

    def __str__(self) -> str:
        v = self.verdict
        rank = f"rank {v.rank}" if v.rank is not None else "a worker"
        step = v.signature[2]
        at = f" at step {step}" if step is not None else ""
        log = f"; traceback: {self.log}" if self.log else ""
        if v.kind == MISTAKE:
            return f"{v.line} ({rank}{at}; not retried: the same input would fail again{log})"
        return f"{rank} failed the same way twice{at}: {v.line} (not retried again{log})"


class FailurePolicy:
    """The controller's memory across the attempts of one fit: ends the run on a mistake, or on an error whose
    signature is the previous error's (:func:`decide`)."""

    def __init__(self, retry_mistakes: bool = False):
        self.retry_mistakes = retry_mistakes
        self.last_error: Optional[Tuple[str, str, Optional[int]]] = None

    def decide(self, worker_exceptions: Dict[int, BaseException]) -> Verdict:
        """The verdict; raises :class:`RunStopped` when the run must not be retried."""
        v = classify(worker_exceptions)
        if v.kind == MISTAKE and not self.retry_mistakes:
            raise RunStopped(v)
        if v.kind == ERROR:
            if v.signature == self.last_error:
                raise RunStopped(v)
            self.last_error = v.signature
        return v


# where Ray Train and Ray keep the exceptions they wrap: a worker's (``_base_exc``), a health check's, the controller's,
# a task error's cause, Python's own chain
WRAPPED = ("_base_exc", "health_check_failure", "controller_failure", "cause", "__cause__", "__context__")


def within(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception it wraps (Ray Train's wrappers, causes, each worker's failure)."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [getattr(e, a, None) for a in WRAPPED]
        failures = getattr(e, "worker_failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())


def run_stopped(error: BaseException) -> Optional[RunStopped]:
    """The :class:`RunStopped` inside what ``fit()`` raised, or None."""
    return next((e for e in within(error) if isinstance(e, RunStopped)), None)
