"""Serving a run: the address checked (`check_bind`: a port in range, an API key off loopback), the socket bound
before anything is loaded (`listen`), the run loaded for decoding (`load_served`), served with uvicorn until SIGINT /
SIGTERM with a grace for in-flight requests (`serve_run`), and an app run in a thread on a loopback port
(`start_server`: the tests and `gptlab bench serve`). uvicorn and FastAPI are imported on first use only."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gptlab.errors import GptlabError
from gptlab.serve.api import Limits

if TYPE_CHECKING:
    import torch

    from gptlab.serve.app import Served


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) only ever means this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, port: int, api_key: str | None) -> None:
    """GptlabError for a port out of range, or a non-loopback address without an API key."""
    if not 0 <= port <= 65535:
        raise GptlabError(f"--port must be in [0, 65535], not {port}")
    if api_key is not None and not api_key.strip():
        raise GptlabError("--api-key must not be empty")
    if not is_loopback(host) and api_key is None:
        raise GptlabError(f"--host {host} would let other machines in: give --api-key KEY (clients then send "
                          "'Authorization: Bearer KEY'), or keep the default --host 127.0.0.1")


def load_served(run: str | Path, precision: str, device: torch.device | str) -> Served:
    """A run's best (else latest) checkpoint, prepared for decoding (load_for_inference), as a Served; /inspect
    reloads it plain."""
    from gptlab.checkpoint import load_run
    from gptlab.inference.loading import load_for_inference
    from gptlab.serve.app import Served

    ready = load_for_inference(run, device, precision)
    return Served(Path(run).name, ready.model, ready.tokenizer, ready.parameters,
                  lambda: load_run(run, device=device).model)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (0: a free port), before anything is loaded; GptlabError when it cannot be.
    Its protocol is named (TCP): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a socket
    that names it, and with Nagle on, a streamed chunk written before the client acknowledged the one before waits
    for that acknowledgement, up to the client's delayed-ACK timer (tens of milliseconds on Linux)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise GptlabError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server on that port? "
                          "try another --port)") from None
    return sock


def serve_run(served: Served, sock: socket.socket, limits: Limits, api_key: str | None) -> None:
    """Serve on `sock` (from `listen`) until SIGINT / SIGTERM: then stop accepting, give in-flight requests
    `limits.grace` seconds, cancel the rest and return."""
    import uvicorn

    from gptlab.serve.app import make_app

    app = make_app(served, limits, api_key)
    # the grace starts at the signal: the scheduler then refuses new work (503, and /health says so) and at the
    # deadline cancels what is left, telling each client why; uvicorn closes any connection left a second later
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=limits.grace + 1)
    server = _quiet_server_class()(config)
    server.on_shutdown = lambda: app.state.scheduler.close(limits.grace)
    previous = {sig: signal.signal(sig, server.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _quiet_server_class():
    """uvicorn.Server with our signal handling (a class made on first use: uvicorn is imported only to serve)."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's server with our signal handling: uvicorn re-raises SIGTERM after its graceful shutdown (the
        process then dies by the signal); here a first SIGINT / SIGTERM shuts down gracefully and the command exits
        0, a second one stops at once."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        on_shutdown = staticmethod(lambda: None)  # called at the first signal

        def on_signal(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            else:
                self.on_shutdown()
            self.should_exit = True

    return QuietServer


@dataclass
class Running:
    """A server running in a thread of this process (`start_server`)."""

    url: str
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(app, host: str = "127.0.0.1", port: int = 0) -> Running:
    """Run `app` with uvicorn in a thread on host:port (0: a free port); returns once it answers."""
    import uvicorn

    sock = listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                          timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise GptlabError("the server did not start")
        time.sleep(0.02)
    return Running(f"http://{host}:{sock.getsockname()[1]}", server, thread)
