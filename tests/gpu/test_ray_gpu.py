"""Replicas on Ray Serve on CUDA: each replica holds one GPU of the local cluster and answers the
official client (run on a GPU machine: pytest -q tests/gpu/test_ray_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("ray.serve")

import ray  # noqa: E402
from openai import OpenAI  # noqa: E402
from ray import serve  # noqa: E402

from fulcrum.ray import build_app  # noqa: E402
from server.srv_helpers import MODEL, SRC, free_port  # noqa: E402

pytestmark = pytest.mark.gpu


def test_one_gpu_per_replica() -> None:
    n = min(2, torch.cuda.device_count())
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        ray.init(address="local", num_gpus=n, include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(num_replicas=n, max_model_len=1024), name="fulcrum", route_prefix="/")
        # build_app saw the cluster's GPUs: every one is held by a replica
        assert ray.available_resources().get("GPU", 0) == 0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        replicas = set()
        for i in range(4 * n):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"{i} Count the stars above the hill " * 8, max_tokens=8
            )
            assert raw.parse().choices[0].text
            replicas.add(raw.headers["x-fulcrum-replica"])
        assert len(replicas) == n
    finally:
        serve.shutdown()
        ray.shutdown()
