"""Run the server in a background thread of this process (tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    """``with ServerThread(app) as s: ... s.url ...`` serves ``app`` on 127.0.0.1 and a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.host, self.port, self.app = host, port, app
        from leapfrog.entrypoints.openai.api_server import LeapfrogServer
        self.server = LeapfrogServer(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
