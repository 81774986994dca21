"""The /metrics HTTP server: prometheus_client's WSGI app in a daemon thread, with optional
basic auth and TLS (each handshake on its connection's own thread, bounded), naming no software
version and logging no request."""

from __future__ import annotations

import base64
import hmac
import importlib
import ssl
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

# prometheus_client's exposition module carries no type hints.
_exposition: Any = importlib.import_module("prometheus_client.exposition")

#: Seconds a scrape's connection may stay silent: its TLS handshake, then each read or write
#: of its request (an idle or slow client holds one thread that long, never the server).
REQUEST_TIMEOUT = 10.0


class _QuietHandler(WSGIRequestHandler):
    """Logs no request and names no software or version in its `Server` header."""

    server_version = "jobfence"
    sys_version = ""
    timeout = REQUEST_TIMEOUT  # set on the connection by StreamRequestHandler.setup

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape every few seconds)."""


def _named(app: Any) -> Any:
    """`app` answering with `Server: jobfence` (wsgiref would name Python and its version)."""

    def named(environ: dict[str, Any], start_response: Any) -> Any:
        def start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            return start_response(status, [*headers, ("Server", "jobfence")], *exc)

        return app(environ, start)

    return named


def basic_auth(app: Any, credentials: str) -> Any:
    """`app` behind HTTP basic auth for `user:password` (compared in constant time)."""
    expected = b"Basic " + base64.b64encode(credentials.encode())

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [
            ("WWW-Authenticate", 'Basic realm="jobfence metrics"'),
            ("Content-Type", "text/plain; charset=utf-8"),
        ])  # fmt: skip
        return [b"authentication required\n"]

    return guarded

class TlsOnConnection(ThreadingWSGIServer):  # type: ignore[misc]
    """prometheus_client's threading WSGI server, with TLS (`tls`) shaken hands on each
    connection's own thread.

    With TLS the listening socket stays plain: `accept()` only accepts, and the handshake
    runs on the connection's own thread under REQUEST_TIMEOUT. (A TLS listening socket
    shakes hands inside `accept()`, on the serving thread, with no timeout: one idle TCP
    connection stopped every scrape and the worker's shutdown.)
    """

    tls: ssl.SSLContext | None = None

    def get_request(self) -> tuple[Any, Any]:
        conn, client = self.socket.accept()
        if self.tls is None:
            return conn, client
        conn.settimeout(REQUEST_TIMEOUT)
        try:
            wrapped = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except OSError:
            conn.close()
            raise
        return wrapped, client

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()  # on this connection's thread, bounded
            except (OSError, ValueError):  # silent, slow, or no TLS: dropped
                return
        super().finish_request(request, client_address)


def server_tls(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """The server side's TLS: TLS 1.2 at least, with this certificate and key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile, keyfile)
    return context


def serve(
    port: int,
    addr: str,
    registry: CollectorRegistry,
    *,
    credentials: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> tuple[Any, threading.Thread]:
    """prometheus_client's WSGI server, with optional basic auth and TLS, in a daemon thread."""

    class Server(TlsOnConnection):
        """A class of its own: the address family is set on it."""

    Server.address_family, addr = _exposition._get_best_family(addr, port)
    app = _named(make_wsgi_app(registry))
    if credentials:
        app = _named(basic_auth(app, credentials))
    httpd = make_server(addr, port, app, Server, handler_class=_QuietHandler)
    if certfile:
        try:
            httpd.tls = server_tls(certfile, keyfile)
        except (OSError, ssl.SSLError):
            httpd.server_close()
            raise
    thread = threading.Thread(target=httpd.serve_forever, name="jobfence-metrics", daemon=True)
    thread.start()
    return httpd, thread
