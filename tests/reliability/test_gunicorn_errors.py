"""gunicorn's own refusals (a request line or headers beyond its limits, a request that is not HTTP)
are answered in pasto's JSON error shape, not gunicorn's HTML page, with the documented configuration."""

from __future__ import annotations

import socket

import pytest
import requests


def _raw(port: int, request: bytes) -> tuple[str, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {key.lower(): value.strip() for key, _, value in (line.partition(":") for line in lines)}, body


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"GET /api/v1/experiments?" + b"x" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "414", "request_uri_too_large"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n", "431",
     "request_header_fields_too_large"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n", "431",
     "request_header_fields_too_large"),
    (b"NOT HTTP AT ALL\r\n\r\n", "400", "bad_request"),
])
def test_gunicorn_refusals_are_json(migrated_sqlite, service_processes, request_bytes, status, code):
    server = service_processes.gunicorn(migrated_sqlite, workers=1)
    port = int(server.url.rsplit(":", 1)[1])
    line, headers, body = _raw(port, request_bytes)
    assert line.split()[1] == status, (line, body)
    assert headers["content-type"] == "application/json"
    error = requests.models.complexjson.loads(body)["error"]
    assert error["code"] == code and error["message"] and set(error) == {"code", "message", "details"}
    # The server still answers normally afterwards.
    assert requests.get(f"{server.url}/healthz", timeout=30).status_code == 200
