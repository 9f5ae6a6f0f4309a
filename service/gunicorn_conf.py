"""gunicorn settings for pasto: ``gunicorn -c python:service.gunicorn_conf -w 4 service.wsgi:app``.

gunicorn answers some requests itself, before the application sees them: a request line longer
than ``limit_request_line`` (414), more than ``limit_request_fields`` headers or one longer than
``limit_request_field_size`` (431), and other malformed requests (400). Its own answer is an HTML
page; with this configuration's worker classes it is pasto's JSON error shape instead
(``{"error": {"code", "message", "details"}}``, the codes the application uses for the same
statuses), so a client parses every error of the service the same way. The limits stay gunicorn's
defaults: raising them would only move the same refusal into the application.

``worker_class`` is the sync worker; ``JsonErrorThreadWorker`` is the same for ``--threads``
(``-k service.gunicorn_conf.JsonErrorThreadWorker``).
"""

from __future__ import annotations

import json

from gunicorn.http.errors import (InvalidHeader, InvalidHeaderName, InvalidHTTPVersion, InvalidRequestLine,
                                  InvalidRequestMethod, LimitRequestHeaders, LimitRequestLine)
from gunicorn.workers.gthread import ThreadWorker
from gunicorn.workers.sync import SyncWorker

worker_class = "service.gunicorn_conf.JsonErrorSyncWorker"


def post_worker_init(worker) -> None:
    """Log that a worker has loaded the application and starts accepting requests.

    gunicorn logs "Booting worker" before the import, which takes seconds (and longer while the
    database does not answer the startup check); until this line a booting worker takes no
    request, so an operator (or a test) can tell how many workers serve.
    """
    worker.log.info("Worker ready (pid: %s): the application is loaded", worker.pid)


#: gunicorn's own refusals: status, the application's error code for it, the message.
_REFUSALS = (
    (LimitRequestLine, 414, "URI Too Long", "request_uri_too_large",
     "The request line is longer than the server accepts (gunicorn's limit_request_line); send the data in "
     "a request body instead of the URL."),
    (LimitRequestHeaders, 431, "Request Header Fields Too Large", "request_header_fields_too_large",
     "The request has more or longer header fields than the server accepts (gunicorn's "
     "limit_request_fields and limit_request_field_size)."),
    ((InvalidRequestLine, InvalidRequestMethod, InvalidHTTPVersion, InvalidHeader, InvalidHeaderName), 400,
     "Bad Request", "bad_request", "The request is not valid HTTP."),
)


def json_refusal(exc: BaseException) -> bytes | None:
    """The whole HTTP response (bytes) for one of gunicorn's own refusals, or None for another error."""
    for kinds, status, reason, code, message in _REFUSALS:
        if isinstance(exc, kinds):
            body = json.dumps({"error": {"code": code, "message": message, "details": None}}).encode()
            head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
                    f"X-Content-Type-Options: nosniff\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1")
            return head + body
    return None


class _JsonErrors:
    def handle_error(self, req, client, addr, exc):
        response = json_refusal(exc)
        if response is None:
            return super().handle_error(req, client, addr, exc)
        self.log.warning("Invalid request from ip=%s: %s", (addr or ("",))[0], exc)
        try:
            client.sendall(response)
        except OSError:  # the client went away: nothing to answer
            self.log.debug("Failed to send error message.")


class JsonErrorSyncWorker(_JsonErrors, SyncWorker):
    """gunicorn's sync worker answering its own refusals in pasto's JSON error shape."""


class JsonErrorThreadWorker(_JsonErrors, ThreadWorker):
    """gunicorn's threaded worker answering its own refusals in pasto's JSON error shape."""
