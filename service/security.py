"""Security headers of every response, and the Content Security Policy of the HTML pages.

The dashboard's pages load only this server's own files (its JS modules, its CSS and the vendored
Chart.js) and read this server's API: no inline script (the page configuration is a
``<script type="application/json">`` data block, which is never executed and so needs no nonce),
no inline style attribute (the scripts set styles through the CSSOM, which CSP allows), no frames.
"""

from __future__ import annotations

from flask import Flask, Response

#: The HTML pages' policy: everything from this origin only, nothing inline, never framed.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",  # data: for a chart exported as an image
    "connect-src 'self'",
    "font-src 'self'",
    "base-uri 'none'",
    "form-action 'self'",
    "frame-ancestors 'none'",
])


#: The header every answer carries (service.routes.assignment's fast path adds it itself).
NOSNIFF = ("X-Content-Type-Options", "nosniff")


def add_security_headers(response: Response) -> Response:
    """``after_request``: ``nosniff`` on everything (a JSON error is never read as HTML or script);
    on HTML, the CSP above and ``X-Frame-Options: DENY`` (frame-ancestors for older browsers) and no
    referrer leaving the site."""
    response.headers.setdefault(*NOSNIFF)
    if response.mimetype == "text/html":
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Referrer-Policy", "same-origin")
    return response


def init_app(app: Flask) -> None:
    app.after_request(add_security_headers)
