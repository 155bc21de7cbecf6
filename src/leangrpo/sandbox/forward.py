"""The one address a box without network reaches (box side): a forwarder process inside
the box listens on the box's own loopback and relays each connection to a unix socket
outside (the trainer's endpoint, e.g. the agents' OpenAI-compatible server), so code in
the box talks HTTP to `http://127.0.0.1:PORT` and reaches nothing else.

The forwarder is forked by the box before its system-call filter: it drops every
capability and loads the BOX filter that still lets it make unix sockets (the box's own
filter refuses them). It lives in the box's PID namespace and dies with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

from leangrpo.sandbox.confine import drop_privileges
from leangrpo.sandbox.seccomp import load


def start_forwarder(target: str, program: bytes) -> str:
    """Listen on 127.0.0.1 (a free port) and relay to unix socket `target`; the URL."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    if os.fork() == 0:
        try:
            keep = listener.fileno()
            os.closerange(3, keep)
            os.closerange(keep + 1, 1 << 20)
            drop_privileges()
            load(program)
            _serve(listener, target)
        finally:
            os._exit(0)
    listener.close()
    return f"http://127.0.0.1:{port}"


def _serve(listener: socket.socket, target: str) -> None:
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_relay_connection, args=(client, target), daemon=True).start()


def _relay_connection(client: socket.socket, target: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(target)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
