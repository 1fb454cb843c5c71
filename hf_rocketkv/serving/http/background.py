"""ServerThread: a uvicorn server for an app on a background thread (tests, the in-process load test, notebooks).

    with ServerThread(app) as server:          # binds 127.0.0.1 on a free port before returning
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    # the server has shut down and its thread has ended here

The socket is bound here (port 0 = the OS picks a free one), so there is no race between choosing and using a port.
"""

from __future__ import annotations

import socket
import threading
import time

from .deps import require_serve_deps

LOOPBACK = "127.0.0.1"


class ServerThread:
    """Runs ``uvicorn.Server`` for ``app`` on its own thread and event loop."""

    def __init__(self, app, host: str = LOOPBACK, port: int = 0, log_level: str = "warning",
                 startup_timeout: float = 30.0):
        require_serve_deps()
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._startup_timeout = startup_timeout
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def _run(self) -> None:
        self.server.run(sockets=[self._socket])

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
