"""The two web pages gpunet serves, and what they share: a worker's local dashboard (``gpunet worker
--dashboard-port``, :mod:`gpunet.worker.dashboard`) and the network explorer (``gpunet status --serve``,
:mod:`gpunet.cli.explorer`).

Both are static HTML/CSS/JS shipped in this package (no CDN: charts are inline SVG drawn by ``ui.js``) fed by a JSON
API (docs/volunteer.md). Served on loopback by aiohttp with a Host check (another site cannot reach them through DNS
rebinding) and a strict Content-Security-Policy (scripts from this server only, nothing inline, no eval). A private
site (the dashboard: it shows clients and earnings, and can pause the worker) answers its API only with its key, in a
header: the key is made at every start and given to the owner alone, as the fragment of the address the worker logs
and writes to its data dir (mode 0600); the page reads it from its own address (a fragment is never sent to a server
nor in a Referer), so another site's page, or another user of the machine, has no way to it. Its state-changing calls
also need a JSON body and, when the browser says, an Origin of its own.
"""

from __future__ import annotations

import secrets
from html import escape
from importlib import resources
from typing import Awaitable, Callable

from aiohttp import web

STATIC = ("ui.js", "style.css", "dashboard.js", "explorer.js")
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")



class BadRequest(Exception):
    """A POST handler's refusal of its body: answered 400 with the message."""


class Site:
    """An aiohttp app serving one page, the shared assets and a JSON API, on 127.0.0.1 (or ``host``) only."""

    def __init__(self, page: str, title: str, host: str = "127.0.0.1", private: bool = False):
        self.host, self.title, self.page, self.private = host, title, page, private
        self.token = secrets.token_urlsafe(24)  # changes at every start: only its owner is given it
        self.app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        self.app.router.add_get("/", self._index)
        for name in STATIC:
            self.app.router.add_get(f"/{name}", self._static(name))
        self._runner: web.AppRunner | None = None
        self.port = 0

    def get(self, path: str, handler: Callable[[web.Request], Awaitable[object]]) -> None:
        """A read-only JSON endpoint: ``handler`` returns what to send as JSON."""
        async def endpoint(request: web.Request) -> web.Response:
            if self.private and not self._keyed(request):
                return web.json_response({"error": "missing or wrong key: open the address the worker gave"},
                                         status=403, headers=_HEADERS)
            return web.json_response(await handler(request), headers=_HEADERS)

        self.app.router.add_get(path, endpoint)

    def post(self, path: str, handler: Callable[[dict], Awaitable[object]]) -> None:
        """A state-changing endpoint: only for a page of this server (its token in ``X-Gpunet-Token``), with a JSON
        object as body."""
        async def endpoint(request: web.Request) -> web.Response:
            if not self._keyed(request):
                return web.json_response({"error": "missing or wrong key: open the address the worker gave"},
                                         status=403, headers=_HEADERS)
            origin = request.headers.get("Origin")
            if origin is not None and origin != f"http://{request.host}":
                return web.json_response({"error": "cross-site request refused"}, status=403, headers=_HEADERS)
            if request.content_type != "application/json":
                return web.json_response({"error": "send JSON"}, status=415, headers=_HEADERS)
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return web.json_response({"error": "the body is a JSON object"}, status=400, headers=_HEADERS)
            try:
                result = await handler(body)
            except BadRequest as e:
                return web.json_response({"error": str(e)}, status=400, headers=_HEADERS)
            return web.json_response(result, headers=_HEADERS)

        self.app.router.add_post(path, endpoint)

    async def start(self, port: int) -> int:
        """Serve on ``port`` (0: any free one); returns the port."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def url(self) -> str:
        """The address to open (a private site's with its key, after ``#``)."""
        return f"http://{self.host}:{self.port}/" + (f"#token={self.token}" if self.private else "")

    def _keyed(self, request: web.Request) -> bool:
        return secrets.compare_digest(request.headers.get("X-Gpunet-Token", ""), self.token)

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """Only requests addressed to this server by its loopback name (DNS rebinding: a page of another site that
        resolves its own name to 127.0.0.1 sends its own Host)."""
        allowed = {f"{name}:{self.port}" for name in ("127.0.0.1", "localhost", "[::1]", self.host)}
        if request.host not in allowed:
            return web.Response(status=421, text="this server answers requests for its own address only")
        return await handler(request)

    async def _index(self, request: web.Request) -> web.Response:
        html = asset(self.page).replace("{{TITLE}}", escape(self.title))
        return web.Response(text=html, content_type="text/html", headers=_HEADERS)

    def _static(self, name: str):
        text = asset(name)
        kind = _TYPES[name[name.rindex("."):]]

        async def serve(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type=kind, headers=_HEADERS)

        return serve
