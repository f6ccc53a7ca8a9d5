"""Start `fulcrum router` processes in front of workers (stdlib subprocess + httpx)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from server.srv_helpers import SRC, free_port

ROUTER_KEY = "router-key"


class Router:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc, self.port = proc, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(
            base_url=self.base_url, headers={"authorization": f"Bearer {ROUTER_KEY}"}, timeout=120
        )

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def start_router(urls: list[str], *extra: str) -> Router:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fulcrum.entrypoints.cli", "router", "--port", str(port)]
    cmd += ["--api-key", ROUTER_KEY, *extra]
    for u in urls:
        cmd += ["--worker", u]
    proc = subprocess.Popen(cmd, env=env)
    router = Router(proc, port)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            if router.client.get("/health", timeout=2).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError("router did not become ready")
