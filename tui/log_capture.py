"""While the dashboard owns the terminal, this process's log records go to its log panel
instead of stderr (a StreamHandler writing to the terminal would scribble over the screen).

Handlers writing to a file are left alone. Loggers configured later (uvicorn sets up its own
handlers when its server starts) are adopted when `adopt()` is called again.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from tui.messages import LogLine


def _loggers() -> list[logging.Logger]:
    named = [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    return [logging.getLogger(), *named]


def _standard_streams() -> set:
    return {id(stream) for stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__) if stream is not None}


def _to_terminal(handler: logging.Handler, standard: set) -> bool:
    if isinstance(handler, logging.FileHandler) or not isinstance(handler, logging.StreamHandler):
        return False
    stream = handler.stream
    if id(stream) in standard:
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _ToDashboard(logging.Handler):
    def __init__(self, post: Callable[[LogLine], object], level: int):
        super().__init__(level)
        self.post = post

    def emit(self, record: logging.LogRecord) -> None:
        try:  # Textual's post_message is safe from worker threads (torch work logs from there)
            self.post(LogLine(record.levelname, record.getMessage()))
        except Exception:
            self.handleError(record)


class LogCapture:
    """Moves terminal handlers aside while the app runs; `release()` puts them back."""

    def __init__(self, post: Callable[[LogLine], object], level: int = logging.INFO):
        # Taken now: once the app runs, sys.stderr is Textual's own capture.
        self.standard = _standard_streams()
        self.handler = _ToDashboard(post, level)
        self.moved: list[tuple[logging.Logger, logging.Handler]] = []

    def adopt(self) -> None:
        root = logging.getLogger()
        for logger in _loggers():
            for handler in list(logger.handlers):
                if _to_terminal(handler, self.standard):
                    logger.removeHandler(handler)
                    self.moved.append((logger, handler))
                    if logger is not root and not logger.propagate:  # its records never reach root
                        logger.addHandler(self.handler)
        if self.handler not in root.handlers:
            root.addHandler(self.handler)

    def release(self) -> None:
        for logger in _loggers():
            if self.handler in logger.handlers:
                logger.removeHandler(self.handler)
        for logger, handler in self.moved:
            logger.addHandler(handler)
        self.moved.clear()
