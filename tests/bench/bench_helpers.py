"""Helpers shared by the stub and real-server tests: CLI runner, results and PNG checks."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from fulcrum.entrypoints.cli import main

SERVER_BUILT = importlib.util.find_spec("fulcrum.entrypoints.openai.cli_serve") is not None
needs_real_server = pytest.mark.skipif(
    not SERVER_BUILT,
    reason="fulcrum serve is not built yet (fulcrum.entrypoints.openai.cli_serve is missing)",
)

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


def run_cli(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def check_results(path: Path, num_points: int, requests_per_point: int) -> dict[str, Any]:
    """Assert the file is complete and internally consistent; return it."""
    doc = json.loads(path.read_text())
    assert doc["schema"] == "fulcrum.bench.serve/1"
    for key in ("label", "date", "base_url", "endpoint", "model", "dataset", "server_kind"):
        assert key in doc, key
    assert len(doc["points"]) == num_points
    for p in doc["points"]:
        assert p["num_requests"] == requests_per_point
        assert p["completed"] + p["failed"] == p["num_requests"]
        assert sum(p["errors"].values()) == p["failed"]
        assert p["duration_s"] > 0
        d = p["duration_s"]
        assert math.isclose(p["request_throughput"], p["completed"] / d, rel_tol=1e-9)
        assert math.isclose(p["output_throughput"], p["total_output_tokens"] / d, rel_tol=1e-9)
        total = p["total_input_tokens"] + p["total_output_tokens"]
        assert math.isclose(p["total_token_throughput"], total / d, rel_tol=1e-9)
        for name in LATENCIES:
            pc = p[name]
            assert pc["min"] <= pc["p50"] <= pc["p95"] <= pc["p99"] <= pc["max"], (name, pc)
            assert pc["min"] <= pc["mean"] <= pc["max"] + 1e-9, (name, pc)
        if p["completed"]:
            assert p["ttft_ms"]["min"] >= 0 and p["e2el_ms"]["min"] > 0
            assert p["ttft_ms"]["max"] <= p["e2el_ms"]["max"] + 1e-6
            assert p["total_input_tokens"] > 0
            assert p["total_output_tokens"] > 0 or doc["endpoint"] == "embeddings"
            assert 1 <= p["peak_concurrency"] <= (p["max_concurrency"] or p["num_requests"])
        if p.get("requests") is not None:
            ok = [r for r in p["requests"] if r["success"]]
            assert len(p["requests"]) == p["num_requests"]
            assert sum(r["output_len"] for r in ok) == p["total_output_tokens"]
            assert sum(r["prompt_len"] for r in ok) == p["total_input_tokens"]
    return doc


def check_png(path: Path) -> None:
    """A valid PNG: signature, IHDR first with a correct CRC, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        ctype = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(ctype + body) == crc, ctype
        chunks.append(ctype)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
