"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

from contextsvc.config import redacted_url

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        # Extra fields given as logger.info("...", extra={...}) become top-level keys.
        entry.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _one_line_warning(record: logging.LogRecord) -> bool:
    """A library's warning with an exception (asyncpg's pool retrying its connections while the
    database is down: every second, a traceback of the same refused connect) keeps its exception
    as one ``error`` field. The outage itself is reported once, by the health service."""
    if record.exc_info and record.levelno <= logging.WARNING:
        error = record.exc_info[1]
        record.error = f"{type(error).__name__}: {error}" if error is not None else ""
        record.exc_info = None
        record.exc_text = None
    return True


#: Libraries whose warnings come with tracebacks of conditions that are not defects.
_ONE_LINE_LOGGERS = ("asyncpg.pool",)


def _without_url_passwords(record: logging.LogRecord) -> bool:
    """httpx logs every request's URL at INFO, with the password a summarizer's ``base_url``
    may hold (``http://user:secret@host``): the URL is logged as ``redacted_url`` shows it."""
    if isinstance(record.args, tuple):
        record.args = tuple(_redacted_arg(arg) for arg in record.args)
    return True


def _redacted_arg(arg: object) -> object:
    text = str(arg)
    shown = redacted_url(text) if "://" in text else text
    return arg if shown == text else shown


#: Libraries that log URLs (the summarizers' HTTP client).
_URL_LOGGERS = ("httpx",)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for names, check in ((_ONE_LINE_LOGGERS, _one_line_warning), (_URL_LOGGERS, _without_url_passwords)):
        for name in names:
            library = logging.getLogger(name)
            if check not in library.filters:
                library.addFilter(check)
