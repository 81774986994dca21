"""A TCP proxy to PostgreSQL that lets one COMMIT through and loses its reply (the link dies)."""

from __future__ import annotations

import contextlib
import socket
import threading

from tests.servers import HOST


class CommitReplyCutter:
    """A TCP proxy to PostgreSQL that, once armed, forwards the next COMMIT, swallows the
    server's reply and closes both sides: the commit landed, the client saw the link die."""

    def __init__(self, port: int) -> None:
        self.target = (HOST, port)
        self.armed = threading.Event()
        self.fired = threading.Event()
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            cut = threading.Event()
            threading.Thread(target=self._up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, cut), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        while data := _recv(client):
            # psycopg sends COMMIT as a simple query: 'Q', length, the text, NUL.
            if self.armed.is_set() and b"COMMIT\x00" in data:
                self.armed.clear()
                cut.set()
            if not _send(server, data):
                break
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        while data := _recv(server):
            if cut.is_set():  # the COMMIT's reply: never delivered
                _close(client, server)
                self.fired.set()
                return
            if not _send(client, data):
                break
        _close(client, server)

    def close(self) -> None:
        self._closing = True
        self._listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
