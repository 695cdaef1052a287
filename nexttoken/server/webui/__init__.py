"""The chat page at `/`: hand-written HTML, CSS and JavaScript shipped as package data (no CDN, no build step).

The page speaks only the public API (`/v1/models`, `/v1/chat/completions` streamed, `/v1/traces/{id}.json`), so
it is also a working example of it; docs/webui.md describes it. `nexttoken serve --no-webui` leaves it out (then
`/` is a 404, as any unknown path).
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# The files the page is made of: URL name -> (package, file, content type). The page fetches nothing else; one
# step of a trace is drawn by the explain page's own script (generation/trace/step.js).
_JS, _CSS, _HTML = "text/javascript; charset=utf-8", "text/css; charset=utf-8", "text/html; charset=utf-8"
ASSETS = {"index.html": (__name__, "index.html", _HTML), "app.js": (__name__, "app.js", _JS),
          "client.js": (__name__, "client.js", _JS),
          "markdown.js": (__name__, "markdown.js", _JS), "style.css": (__name__, "style.css", _CSS),
          "trace-step.js": ("nexttoken.generation.trace", "step.js", _JS)}

# Only this server's own files and API: no inline script, no other origin, no plugins, no framing by other sites.
# Model text is set as text (never markup), and this policy is the second wall should that ever slip.
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'self'")


def add_webui(app: FastAPI) -> None:
    """Route `/` to the page and `/webui/<file>` to its script and style (read once, served from memory)."""
    files = {name: (resources.files(package) / file).read_bytes() for name, (package, file, _) in ASSETS.items()}
    headers = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}

    def asset(name: str) -> Response:
        return Response(files[name], media_type=ASSETS[name][2], headers=headers)

    app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)(lambda: asset("index.html"))
    for name in ASSETS:
        app.api_route(f"/webui/{name}", methods=["GET", "HEAD"], include_in_schema=False)(lambda name=name: asset(name))
