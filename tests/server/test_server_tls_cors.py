"""HTTPS and CORS: a server started with --ssl-keyfile/--ssl-certfile (a self-signed certificate
made here; two API processes on the shared socket) answers the official client over TLS, and with --allowed-origins a browser's preflight
passes before the API key is checked while other origins get no CORS headers; bad TLS flags stop
the server with one line."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from srv_helpers import API_KEY, MODEL, SRC, Server, start_server, stop_server

ORIGIN = "https://app.example.com"


def _self_signed(tmp) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    key_file, cert_file = tmp / "key.pem", tmp / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory) -> Iterator[tuple[Server, str]]:
    tmp = tmp_path_factory.mktemp("tls")
    key_file, cert_file = _self_signed(tmp)
    ctx = ssl.create_default_context(cafile=cert_file)
    s = start_server(
        str(tmp), "--api-key", API_KEY, "--max-model-len", "512", "--ssl-keyfile", key_file,
        "--ssl-certfile", cert_file, "--allowed-origins", ORIGIN, "--api-server-count", "2",
        tls=ctx,
    )  # fmt: skip
    yield s, cert_file
    stop_server(s)


def test_official_client_over_https(tls_server) -> None:
    import httpx
    import openai

    server, cert_file = tls_server
    assert server.base_url.startswith("https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=cert_file)) as http:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, http_client=http)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
    assert r.choices[0].message.content
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
        httpx.get(server.base_url.replace("https", "http") + "/health", timeout=10)


def test_cors_preflight_and_origins(tls_server) -> None:
    server, _ = tls_server
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    status, _, headers = server.request("OPTIONS", "/v1/chat/completions", key=None, headers=pre)
    low = {k.lower(): v for k, v in headers.items()}
    assert status == 200 and low["access-control-allow-origin"] == ORIGIN
    assert "authorization" in low["access-control-allow-headers"].lower()
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    status, _, headers = server.request("POST", "/v1/completions", body, headers={"Origin": ORIGIN})
    assert status == 200 and headers.get("access-control-allow-origin") == ORIGIN
    status, _, headers = server.request("POST", "/v1/completions", body,
                                        headers={"Origin": "https://evil.example"})  # fmt: skip
    assert "access-control-allow-origin" not in {k.lower() for k in headers}
    status, _, _ = server.request("POST", "/v1/completions", body, key=None,
                                  headers={"Origin": ORIGIN})  # fmt: skip
    assert status == 401  # CORS opens the browser's door, not the API key's


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs the other TLS file"),
     (["--ssl-keyfile", "missing.pem", "--ssl-certfile", "missing.pem"], "no such file")],
)
def test_bad_tls_flags_stop_with_one_line(args: list[str], message: str) -> None:
    import os

    env = {**os.environ, "PYTHONPATH": SRC}
    p = subprocess.run([sys.executable, "-m", "fulcrum.entrypoints.cli", "serve", *args],
                       capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert p.returncode != 0 and message in p.stderr
