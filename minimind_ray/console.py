"""What the terminal shows (issue 38): quiet by default, everything with ``--verbose`` or ``MINIMIND_RAY_VERBOSE=1``.

Quiet, the terminal keeps minimind-ray's own lines (``[minimind-ray] ...``, a run's ``[<name>] ...`` progress line or
bar with its ETA, its warnings), the warnings and errors of Ray and MLflow that need the user (their WARNING level
and above on this process), and one line saying where the full logs are. Ray's and MLflow's own lines stay in Ray's
log files (the session's ``logs/`` directory: every worker's and actor's output, ``ray-data.log``, Serve's logs):
Ray's start banner, Ray Data's progress, Ray Train's ``TrainingReport`` dumps, Serve's component and access lines,
the C++ notices of Ray's core worker (the ``PreemptionWatcher ... max_restarts`` line). A failure is never hidden:
the command's own error line says its cause, as before. The workers' lines that are ours are printed as they were
written, without Ray's ``(RayTrainWorker pid=...)`` prefix; where the output is not a terminal (piped, a file, a CI
log) colour codes are stripped from them, and Ray's own prefixes (``--verbose``) come without colour
(``RAY_COLOR_PREFIX=0``, Ray's switch).

The switches are Ray's and MLflow's own: ``ray.init(logging_level=...)`` for the driver's Ray loggers, a filter in
front of the handler that prints the workers' forwarded lines (Ray's log monitor), a filter on Ray Data's console
handler and its progress bars off (``RAY_DATA_DISABLE_PROGRESS_BARS``), ``MLFLOW_LOGGING_LEVEL``. A value the user
exported wins.
"""
from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, Dict, Optional

VERBOSE_ENV = "MINIMIND_RAY_VERBOSE"
# a forwarded worker line that is ours: a prefix anywhere ([minimind-ray] ..., [fault-injection] ...), or a line that
# starts with a run's [<name>] (a sweep trial's progress); Ray's own start with a timestamp, "(pid=...)", or words
OURS = re.compile(r"\[(minimind-ray|fault-injection)\]|^\[[A-Za-z][\w.\-]*\] ")
# warnings of Ray's that say nothing wrong: the notice of the switch this module pulls, a deprecation of Ray's own use
NOISE = re.compile(r"Progress bars (for operators )?disabled|exclude_resources|is deprecated")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # a CSI sequence: colours (ESC [ 36 m), cursor moves, erases


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def set_verbose(on: bool) -> None:
    """``--verbose``: this process and what it starts show everything."""
    if on:
        os.environ[VERBOSE_ENV] = "1"


def quiet_environment() -> None:
    """Before Ray or MLflow start: the settings they read at import or start. Nothing when verbose."""
    if verbose():
        return
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial MLflow database tables..."
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    if "mlflow" in sys.modules:
        logging.getLogger("mlflow").setLevel(logging.WARNING)


def ray_init_options() -> Dict[str, Any]:
    """What ``ray.init`` takes from here: Ray's own driver lines at WARNING and above (its start banner, Serve's and
    Ray Train's INFO lines) when quiet."""
    quiet_environment()
    return {} if verbose() else {"logging_level": logging.WARNING}


class QuietFilter(logging.Filter):
    """For a console handler of Ray's (Ray Data's): WARNING and above, less the notices in :data:`NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not NOISE.search(record.getMessage())


def quiet_handlers(logger: str) -> list:
    """Put a :class:`QuietFilter` on ``logger``'s console handlers when quiet; returns them (for removeFilter)."""
    if verbose():
        return []
    quiet = QuietFilter()
    handlers = [h for h in logging.getLogger(logger).handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    for h in handlers:
        h.addFilter(quiet)
    return handlers


def _terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def plain(line: str, stream: Any) -> str:
    """``line`` as ``stream`` should get it: its ANSI colour codes stripped unless the stream is a terminal."""
    return line if _terminal(stream) else ANSI.sub("", line)


def _forward_ours(original):
    """In place of Ray's printer of the workers' lines: minimind-ray's lines of each batch, printed plainly (no
    ``(RayTrainWorker pid=...)`` prefix Ray's printer would add, no colour codes when not a terminal) to the
    stream Ray would print them to, after Ray's own deduplication of lines repeated across workers; the rest
    dropped (they are in Ray's log files). ``original`` stays the fallback where Ray's printer parts are not
    found."""
    def handle(data: Dict[str, Any]) -> None:
        lines = [line for line in data.get("lines", ()) if OURS.search(line)]
        if not lines:
            return
        try:
            from ray._private import worker  # lazy: Ray, connected already when a batch arrives

            dedup = worker.stderr_deduplicator if data.get("is_err") else worker.stdout_deduplicator
        except (ImportError, AttributeError):  # another Ray: its printer, prefixes and all
            original(dict(data, lines=lines))
            return
        sink = sys.stderr if data.get("is_err") else sys.stdout
        batch = dict(data, lines=[plain(line, sink) for line in lines])
        for part in dedup.deduplicate(batch):  # the first of a repeated line now, "[repeated Nx ...]" later
            for line in part.get("lines", ()):
                print(plain(line, sink), file=sink)
        sink.flush()
    handle.minimind_quiet = True  # type: ignore[attr-defined]
    return handle


def plain_colours() -> None:
    """Ray's own switch for the prefixes of the lines it prints (``RAY_COLOR_PREFIX=0``: no colour codes, read as it
    prints), set when this process's output is not a terminal; a value the user exported wins."""
    if not (_terminal(sys.stdout) and _terminal(sys.stderr)):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def after_ray_start(context: Any = None) -> Optional[str]:
    """Once this process is connected to Ray: only minimind-ray's lines of the workers reach the terminal, Ray's
    Python loggers here say warnings and errors, and one line says where the full logs are (returned). Nothing
    when verbose (but Ray's prefixes without colour codes when the output is not a terminal), or when this Ray's
    printer is already filtered (a second call)."""
    plain_colours()
    if verbose():
        return None
    quiet_environment()
    try:  # Ray's log monitor hands each batch of worker lines to its handlers; 'ray_print_logs' prints them
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        with dispatcher._lock:
            if not any(name == "ray_print_logs" and not getattr(h, "minimind_quiet", False)
                       for name, h in dispatcher.handlers):
                return None  # filtered already (or nothing forwarded: log_to_driver=False)
            dispatcher.handlers = [(name, h if name != "ray_print_logs" or getattr(h, "minimind_quiet", False)
                                    else _forward_ours(h)) for name, h in dispatcher.handlers]
    except (ImportError, AttributeError):  # another Ray: its lines as it prints them
        pass
    for name in ("ray", "ray.serve", "ray.train", "ray.tune"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logs = log_directory(context)
    if logs:
        print(f"[minimind-ray] Ray's own logs: {logs} (--verbose or {VERBOSE_ENV}=1 shows them here)", flush=True)
    return logs


def log_directory(context: Any = None) -> Optional[str]:
    """The logs directory of this process's Ray session (from ``ray.init``'s context, else the connected node)."""
    info = getattr(context, "address_info", None) or {}
    session = info.get("session_dir") if isinstance(info, dict) else None
    if not session:
        try:
            import ray

            session = ray._private.worker.global_worker.node.get_session_dir_path()
        except Exception:  # noqa: BLE001 - where the logs are is a courtesy
            return None
    return os.path.join(session, "logs")


def own_lines() -> None:
    """In a worker process: minimind-ray's log warnings written as its own lines (``[minimind-ray] WARNING: ...``),
    which the driver's filter keeps, and not again through the root logger."""
    log = logging.getLogger("minimind_ray")
    if not any(getattr(h, "minimind_own", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[minimind-ray] %(levelname)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        handler.minimind_own = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.propagate = False
