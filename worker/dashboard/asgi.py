"""The standalone dashboard: a Starlette app over `Dashboard` (`jobfence dashboard`).

Every path goes to `Dashboard.handle`, which checks the Host, a POST's Origin and the login
before any page; the app itself serves nothing else (no static files)."""

from __future__ import annotations

import urllib.parse

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import Response as HttpResponse
from starlette.routing import Route

from jobfence.worker.dashboard.core import Dashboard, Request, Response
from jobfence.worker.dashboard.guard import LOGIN_COOKIE, LOGIN_TTL

MAX_FORM = 16_384  # bytes of a POST body: the forms here are a few hundred


async def _translate(request: HttpRequest, root: str) -> Request:
    form: dict[str, str] = {}
    if request.method == "POST":
        body = await request.body()
        if len(body) <= MAX_FORM:
            form = dict(urllib.parse.parse_qsl(body.decode("utf-8", "replace")))
    client = request.client.host if request.client else "?"
    return Request(
        method=request.method,
        path="/" + request.path_params.get("rest", ""),
        query=dict(request.query_params),
        form=form,
        cookies=dict(request.cookies),
        origin=request.headers.get("origin", ""),
        host=request.headers.get("host", ""),
        root=root,
        user=f"web client {client}",
        authorization=request.headers.get("authorization", ""),
    )


def reply(resp: Response, root: str, *, secure: bool = False) -> HttpResponse:
    out = HttpResponse(resp.body, status_code=resp.status, media_type=resp.content_type)
    for name, value in resp.headers.items():
        out.headers[name] = value
    out.headers["Cache-Control"] = "no-store"
    out.headers["X-Frame-Options"] = "DENY"  # no clickjacking of the release button
    out.headers["Content-Security-Policy"] = (
        "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
        "frame-ancestors 'none'"
    )
    if resp.set_cookie:
        name, value = resp.set_cookie
        out.set_cookie(name, value, httponly=True, samesite="strict", path=root or "/",
                       secure=secure)  # fmt: skip
    if resp.login_cookie is not None:
        out.set_cookie(LOGIN_COOKIE, resp.login_cookie, httponly=True, samesite="strict",
                       path=root or "/", secure=secure,
                       max_age=int(LOGIN_TTL) if resp.login_cookie else 0)  # fmt: skip
    return out


def build_app(dashboard: Dashboard, *, root: str = "") -> Starlette:
    """An ASGI app serving `dashboard` (mount it under `root`, e.g. beside Flower). It answers
    only the Host names the Dashboard was given (`allowed_hosts`), and with a token only
    logged-in users."""

    async def page(request: HttpRequest) -> HttpResponse:
        req = await _translate(request, root)
        resp = await run_in_threadpool(dashboard.handle, req)  # the backend calls block
        return reply(resp, root, secure=request.url.scheme == "https")

    return Starlette(routes=[Route("/{rest:path}", page, methods=["GET", "POST"])])
