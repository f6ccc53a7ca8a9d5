"""Start and talk to a real `fulcrum serve` process (stdlib HTTP, no client library)."""

from __future__ import annotations

import json
import os
import random
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 256 * 1024
SRC = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))


ADAPTER = "smol-lora"  # the shared server's LoRA adapter (``make_adapter``)
SCALE = 0.1  # changes the answers, keeps them text


def make_adapter(path: str, rank: int = 8, seed: int = 0) -> str:
    """A PEFT-format LoRA adapter for the embedded model (q_proj and v_proj of its 30 layers,
    random A and B large enough to change its answers), written without PEFT."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 576, generator=g) * SCALE
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * SCALE
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": ["q_proj", "v_proj"], "bias": "none"}  # fmt: skip
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def free_port() -> int:
    """A free port in 20000-32767: above Ray's worker ports (10002-19999) and below the kernel's
    ephemeral range (32768+), so no process that asks the kernel for a port (Ray's many gRPC
    servers, any outbound socket) can take it between this check and the server's own bind."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_file: str
    output_file: str
    tls: ssl.SSLContext | None = None  # HTTPS, trusting the server's certificate

    @property
    def base_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        key: str | None = API_KEY,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> tuple[int, bytes, dict[str, str]]:
        """Raw HTTP (stdlib): status, body bytes, headers."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self.tls) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, data, _ = self.request(method, path, body, **kw)
        return status, (json.loads(data) if data else None)

    def metrics(self) -> dict[str, float]:
        _, data, _ = self.request("GET", "/metrics")
        out: dict[str, float] = {}
        for line in data.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out


def start_server(
    tmp_dir: str, *extra: str, timeout: float = 300.0, tls: ssl.SSLContext | None = None
) -> Server:
    port = free_port()
    log_file = os.path.join(tmp_dir, "requests.jsonl")
    output_file = os.path.join(tmp_dir, "server.out")
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FULCRUM_API_KEY", None)
    cmd = [
        sys.executable,
        "-m",
        "fulcrum.entrypoints.cli",
        "serve",
        "--port",
        str(port),
        "--log-requests-file",
        log_file,
        "--log-level",
        "warning",
        *extra,
    ]
    with open(output_file, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, port, log_file, output_file, tls)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(output_file) as f:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            if server.request("GET", "/ready", key=None, timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)


def wait_idle(server: Server, timeout: float = 120.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m.get("fulcrum:num_requests_running", 1) == 0
            and m.get("fulcrum:num_requests_waiting", 1) == 0
            and m.get("fulcrum:num_requests_in_flight", 1) == 0
            and m["fulcrum:kv_cache_blocks_free"] == m["fulcrum:kv_cache_blocks_total"]
        ):
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle with all KV blocks free: {m}")
