"""Log setup for both processes: text or JSON lines, and the request id on every line logged while serving a
request (taken from a context variable that the request-id middleware sets)."""
from __future__ import annotations

import contextvars
import json
import logging
import os

from tokenmill import envs

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        record.request_tag = f" [{record.request_id}]" if record.request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "process": record.processName, "message": record.getMessage()}
        if getattr(record, "request_id", None):
            entry["request_id"] = record.request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str | None = None) -> None:
    log_format = log_format or envs.TOKENMILL_LOG_FORMAT
    os.environ["TOKENMILL_LOG_FORMAT"] = log_format  # inherited by the engine process
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s%(request_tag)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # uvicorn's access and error loggers get the same format
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
