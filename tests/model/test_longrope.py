"""Phi-3 LongRoPE past the pretraining length: tokens equal transformers' cached step-by-step
forward (each position rotated by the factor set of its own position)."""

from __future__ import annotations

import random

import torch

from fulcrum import LLM, SamplingParams


def _hf_stepwise(model_dir: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    toks = list(prompt)
    with torch.no_grad():
        out = m(torch.tensor([toks]), use_cache=True)
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            pos = torch.tensor([[len(toks) - 1]])
            out = m(
                torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values,
                position_ids=pos, use_cache=True,
            )  # fmt: skip
    return toks[len(prompt) :]


def test_phi3_longrope_crosses_original_length(tiny_models):
    # The tiny Phi-3's original_max_position_embeddings is 64: a 60-token prompt and 12 new
    # tokens run the last ones on the long factors.
    rng = random.Random(1)
    prompt = [rng.randrange(3, 320) for _ in range(60)]
    ref = _hf_stepwise(tiny_models["phi3"], prompt, 12)
    for kwargs in (dict(), dict(max_num_batched_tokens=7, block_size=4)):
        llm = LLM(tiny_models["phi3"], dtype="float32", device="cpu", **kwargs)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref, kwargs
