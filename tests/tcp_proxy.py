"""A TCP proxy for fault tests: forwards both ways, and can swallow the server's next reply."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Self

from jobfence.worker.redis_server import HOST


class ReplyDroppingProxy:
    """Listens on HOST:`port` and forwards every connection to `target_port`.

    `drop_next_reply()` arms it: the next chunk the server sends back is discarded (the
    command ran, its reply is lost), `dropped` is set, and `then` (if given) runs before
    anything else is forwarded. Later replies pass through.
    """

    def __init__(self, target_port: int, *, target_host: str = HOST) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server((HOST, 0))
        self.port: int = self.listener.getsockname()[1]
        self.dropped = threading.Event()
        self._armed: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_next_reply(self, then: Callable[[], None] = lambda: None) -> None:
        self.dropped.clear()
        with self._lock:
            self._armed = then

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies:
                    with self._lock:
                        then, self._armed = self._armed, None
                    if then is not None:
                        then()
                        self.dropped.set()
                        continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self.listener.close()
        for s in sockets:
            s.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
