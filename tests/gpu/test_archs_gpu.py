"""Granite, OLMo 2, SmolLM3 and Qwen3 (its q/k norms inside the rotary kernel) on CUDA: tiny
random models in bf16 (decode graphs, the piecewise prefill graphs, the Triton kernels) against
transformers by the top-5 rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_engine_gpu import _check_against_hf, _prompts  # noqa: E402

from model_factory import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["granite", "olmo2", "smollm3", "qwen3"])
def test_arch_matches_hf_on_cuda(tmp_path, arch: str) -> None:
    _check_against_hf(make_tiny_model(str(tmp_path / arch), arch), _prompts(8, 320), 32)
