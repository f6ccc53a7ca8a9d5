"""Tiny random Hugging Face models and the transformers reference used by the parity tests."""

from __future__ import annotations

import os

import torch


def make_tiny_model(path: str, arch: str, seed: int = 0, shard: bool = False) -> str:
    """Save a tiny random model of ``arch`` (llama | llama3 | qwen2 | qwen3 | phi3 | gemma2 | gemma3 | mixtral | qwen3_moe | qwen2_moe | mistral | granite | olmo2 | smollm3) to ``path``."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,
    )
    if arch == "llama":
        cfg, cls = LlamaConfig(**common, tie_word_embeddings=False), LlamaForCausalLM
    elif arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        cfg = LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=True)
        cls = LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
        cls = Qwen3ForCausalLM
    elif arch == "phi3":
        # LongRoPE with a short pretraining length: decode steps of the longer prompts cross it,
        # so both factor sets are exercised (prompts themselves stay below it, where
        # transformers and a per-position switch agree).
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
            "original_max_position_embeddings": 64,
        }
        cfg = Phi3Config(
            **common, rope_parameters=rope, original_max_position_embeddings=64,
            tie_word_embeddings=False, pad_token_id=0,
        )  # fmt: skip
        cls = Phi3ForCausalLM
    elif arch == "gemma2":
        # A window shorter than the prompts and caps small enough to bend the scores.
        cfg = Gemma2Config(
            **common, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            attn_logit_softcapping=3.0, final_logit_softcapping=4.0, tie_word_embeddings=True,
        )  # fmt: skip
        cls = Gemma2ForCausalLM
    elif arch == "gemma3":
        common3 = {**common, "num_hidden_layers": 3}
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        cfg = Gemma3TextConfig(
            **common3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters=rope, tie_word_embeddings=True,
        )  # fmt: skip
        cls = Gemma3ForCausalLM
    elif arch == "mixtral":
        cfg = MixtralConfig(
            **{**common, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=None, tie_word_embeddings=False,
        )  # fmt: skip
        cls = MixtralForCausalLM
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, head_dim=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False, tie_word_embeddings=False,
        )  # fmt: skip
        cls = Qwen3MoeForCausalLM
    elif arch == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False,
        )  # fmt: skip
        cls = Qwen2MoeForCausalLM
    elif arch == "mistral":
        cfg, cls = MistralConfig(**common, sliding_window=None), MistralForCausalLM
    elif arch == "granite":
        # Scalars away from 1 (the real models': 12, 0.22, 1/128, 8 at larger widths), each of
        # which changes this model's greedy tokens (logits_scaling only its logprobs), and the
        # attention bias, which gives o_proj one too.
        cfg = GraniteConfig(
            **common, embedding_multiplier=2.0, residual_multiplier=1.5, attention_multiplier=1.2,
            logits_scaling=0.5, attention_bias=True, tie_word_embeddings=True,
        )  # fmt: skip
        cls = GraniteForCausalLM
    elif arch == "smollm3":
        # three layers, the second without rotary (the real model: every fourth)
        cfg = SmolLM3Config(
            **{**common, "num_hidden_layers": 3}, no_rope_layers=[1, 0, 1],
            tie_word_embeddings=True, pad_token_id=0,
        )  # fmt: skip
        cls = SmolLM3ForCausalLM
    elif arch == "olmo2":
        cfg = Olmo2Config(**common, tie_word_embeddings=False, pad_token_id=0)
        cls = Olmo2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch.startswith("qwen3") or arch == "olmo2":  # make the q/k norm weights matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
                if arch == "olmo2":  # and the norms after each sublayer
                    layer.post_attention_layernorm.weight.normal_(1, 0.5)
                    layer.post_feedforward_layernorm.weight.normal_(1, 0.5)
    if arch.startswith("gemma"):  # (1 + weight) norms start at zero weights
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
    if arch in ("qwen2", "qwen2_moe", "granite"):  # make the qkv bias matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="150KB" if shard else "5GB")
    return path


def edited_copy(src: str, dst, **fields) -> str:
    """A copy of the model directory ``src`` at ``dst`` (a Path) with ``fields`` set in its
    config.json (weights unchanged)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs
) -> list[list[int]]:
    """Reference: transformers' greedy generate, one prompt at a time, float32 on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **generate_kwargs,
            )
        outs.append(out[0, len(p) :].tolist())
    return outs


def generate_watching(llm, prompts, max_tokens: int, ignore_eos: bool = False):
    """Generate greedily, checking the cache's integrity after every step; returns the outputs
    and, over the steps where every running request decodes (a prefill chunk holds blocks for
    all its tokens), the most blocks one request held and the most in use (neither free nor
    evictable) at once."""
    from fulcrum import SamplingParams

    core, peak = llm.core, {"held": 0, "used": 0}
    step = core.step

    def watched():
        out = step()
        kv, running = core.scheduler.kv, core.scheduler.running
        kv.check_integrity()
        if all(r.num_computed_tokens > r.num_prompt_tokens for r in running):
            for r in running:
                peak["held"] = max(peak["held"], kv.num_held(r.key))
            peak["used"] = max(peak["used"], kv.num_blocks - kv.num_available)
        return out

    core.step = watched
    try:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        del core.step
    return [o.outputs[0].token_ids for o in outs], peak


def assert_first_divergence_in_top(ours, our_top, ref, ref_top, what: str) -> None:
    """Where two greedy sequences first differ, each side's token is in the other's top-k."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            assert a in ref_top[j] and b in our_top[j], (
                f"{what}: step {j} fulcrum {a} (top {our_top[j]}) vs reference {b} "
                f"(top {ref_top[j]})"
            )
            return


def make_tiny_classifier(path: str, num_labels: int, vocab: int = 320) -> str:
    """A tiny random ``LlamaForSequenceClassification`` (pad id 0) saved to ``path``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(num_labels)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.15, num_labels=num_labels, pad_token_id=0)  # fmt: skip
    LlamaForSequenceClassification(cfg).eval().save_pretrained(path)
    return path


def make_tiny_bert_cross_encoder(path: str) -> str:
    """A tiny random one-label ``BertForSequenceClassification`` (ms-marco-MiniLM's layout) with
    a WordPiece tokenizer, saved to ``path``. Token type 1 sits far from type 0 and the head is
    scaled up, so a pair read without its token types scores visibly differently."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    torch.manual_seed(11)
    words = ("[PAD] [UNK] [CLS] [SEP] [MASK] what is the capital of france paris bananas are "
             "yellow rome ? .").split()  # fmt: skip
    cfg = BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                     num_labels=1)  # fmt: skip
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight[1].normal_(0, 1.0)
        model.bert.pooler.dense.weight.normal_(0, 0.5)
        model.classifier.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=os.path.join(path, "vocab.txt")).save_pretrained(path)
    return path
