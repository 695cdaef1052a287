"""`nexttoken serve --log-format json`: each line of nexttoken's loggers as one JSON object (for log shippers:
Loki, Elasticsearch, CloudWatch). A request-log line carries its fields as keys (request_log.RequestRecord.fields);
every line has time, level, logger and message."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the request's fields (when the
    record carries them) and a traceback (when it has one)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage(),
                **getattr(record, "request", {})}
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of `--log-format` ("text" or "json")."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT)
