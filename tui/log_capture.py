"""While the dashboard owns the terminal, this process's log records go to its log panel
instead of stderr (a StreamHandler writing to the terminal would scribble over the screen).

Handlers writing to a file are left alone. Loggers configured later (uvicorn sets up its own
handlers when its server starts) are adopted when `adopt()` is called again.
"""

from __future__ import annotations

import logging
import sys

from tui.messages import LogLine


def _to_terminal(handler: logging.Handler) -> bool:
    if isinstance(handler, logging.FileHandler) or not isinstance(handler, logging.StreamHandler):
        return False
    return handler.stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


class _ToDashboard(logging.Handler):
    def __init__(self, app, level: int):
        super().__init__(level)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        try:  # post_message is safe from worker threads (torch work logs from there)
            self.app.post_message(LogLine(record.levelname, record.getMessage()))
        except Exception:
            self.handleError(record)


class LogCapture:
    """Moves terminal handlers aside while the app runs; `release()` puts them back."""

    def __init__(self, app, level: int = logging.INFO):
        self.handler = _ToDashboard(app, level)
        self.moved: list[tuple[logging.Logger, logging.Handler]] = []

    def adopt(self) -> None:
        loggers = [logging.getLogger()] + [
            logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
        ]
        for logger in loggers:
            for handler in list(logger.handlers):
                if _to_terminal(handler):
                    logger.removeHandler(handler)
                    self.moved.append((logger, handler))
                    if logger is not logging.getLogger() and not logger.propagate:
                        logger.addHandler(self.handler)
        root = logging.getLogger()
        if self.handler not in root.handlers:
            root.addHandler(self.handler)

    def release(self) -> None:
        for logger in [logging.getLogger()] + [l for l in logging.Logger.manager.loggerDict.values() if isinstance(l, logging.Logger)]:
            if self.handler in logger.handlers:
                logger.removeHandler(self.handler)
        for logger, handler in self.moved:
            logger.addHandler(handler)
        self.moved.clear()
