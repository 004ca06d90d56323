"""The same workload through HF transformers `generate()`, in this process, on the same device.

A model directory is loaded as it is (same weights as the strata workers). A dummy preset becomes
a LlamaForCausalLM of the same shape with random weights of the same distribution: throughput
with ignore_eos and fixed lengths depends on the shapes only, not on the values.
"""

from __future__ import annotations

import time

from strata.bench import common


def _dtype(args, device: str):
    import torch

    from strata.services.worker.main import pick_dtype

    return pick_dtype(args.dtype, torch.device(device))


def build_hf_model(args):
    """(model, description of its weights) on the benchmark's device and dtype."""
    from transformers.utils import logging as hf_logging

    from strata.model_source import resolve_model

    hf_logging.disable_progress_bar()  # its bar would interleave with the tables

    device = common.resolve_device(args.device)
    dtype = _dtype(args, device)
    model_dir, preset = resolve_model(common.resolve_model(args))
    if model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        weights = "same checkpoint as the strata workers"
    else:
        model = _random_hf_model(preset, dtype, device, args.seed)
        weights = "same shapes, random weights (throughput depends on shapes only)"
    model.eval()
    model.generation_config.eos_token_id = None  # fixed-length generation, like ignore_eos
    return model, weights


def _random_hf_model(preset: str, dtype, device: str, seed: int):
    """transformers' own model of a dummy preset's config (hf_config), random weights of the
    dummy initialiser's scale (norms at their unit: 1, or 0 where they scale by 1 + weight)."""
    import torch
    import transformers

    from strata.services.worker.model.weights import DUMMY_STD, dummy_config

    c = dummy_config(preset)
    # Built directly on the device: initialising billions of weights on the CPU takes minutes.
    with torch.device(device):
        model = getattr(transformers, c.architecture)._from_config(hf_config(c), dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if c.norm_unit_offset else 1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)
    return model


def hf_config(c):
    """The transformers config of a ModelConfig (the inverse of ModelConfig.from_dict)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    fields = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        rope_parameters=rope,
    )
    if c.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        fields.update(attention_bias=c.attention_bias)
    if c.architecture == "LlamaForCausalLM":
        fields.update(mlp_bias=c.mlp_bias)
    if c.architecture == "Qwen3MoeForCausalLM":
        fields.update(
            num_experts=c.num_experts,
            num_experts_per_tok=c.num_experts_per_tok,
            moe_intermediate_size=c.moe_intermediate_size,
            norm_topk_prob=c.norm_topk_prob,
            mlp_only_layers=c.mlp_only_layers,
            decoder_sparse_step=c.decoder_sparse_step,
        )
    if c.architecture == "MixtralForCausalLM":
        fields.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    if c.architecture == "Gemma3ForCausalLM":
        local = {"rope_type": "default", "rope_theta": c.rope_local_theta}
        fields.update(
            hidden_activation=c.hidden_act,
            query_pre_attn_scalar=int(c.query_pre_attn_scalar),  # an int to transformers 5's strict config
            sliding_window=c.sliding_window,
            layer_types=c.layer_types,
            final_logit_softcapping=c.final_logit_softcapping,
            rope_parameters={"full_attention": rope, "sliding_attention": local},
        )
    elif c.sliding_window is not None:
        fields.update(sliding_window=c.sliding_window, use_sliding_window=True)
    config_class = {
        "LlamaForCausalLM": "LlamaConfig",
        "MistralForCausalLM": "MistralConfig",
        "Qwen2ForCausalLM": "Qwen2Config",
        "Qwen3ForCausalLM": "Qwen3Config",
        "Gemma3ForCausalLM": "Gemma3TextConfig",
        "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
        "MixtralForCausalLM": "MixtralConfig",
    }[c.architecture]
    return getattr(transformers, config_class)(**fields)


def left_padded(prompts: list[list[int]], pad_id: int, device: str):
    """input_ids and attention_mask of a batch, padded on the left as decoder-only models need."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _generate(model, prompts, output_len: int, temperature: float, device: str) -> int:
    """One batched generate(); returns the number of new tokens."""
    import torch

    ids, mask = left_padded(prompts, 0, device)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
            **sampling,
        )
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


def run_hf_baseline(args, prompts: list[list[int]], output_len: int) -> dict:
    """Time generate() over `prompts` in batches; halve the batch on out-of-memory."""
    import torch

    device = common.resolve_device(args.device)
    cuda = device.startswith("cuda")
    model, weights = build_hf_model(args)
    batch = min(args.hf_batch_size, len(prompts))
    try:
        _generate(model, prompts[:2], 4, args.temperature, device)  # kernels, allocator, lazy init
        while True:
            try:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                tokens = 0
                for i in range(0, len(prompts), batch):
                    tokens += _generate(model, prompts[i : i + batch], output_len, args.temperature, device)
                if cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                break
            except torch.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                common.free_accelerator_memory()
                print(f"HF generate() ran out of memory: retrying with batch {batch}", flush=True)
    finally:
        del model
        common.free_accelerator_memory()
    input_tokens = sum(len(p) for p in prompts)
    return {
        "num_prompts": len(prompts),
        "batch_size": batch,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "total_tokens_per_s": (tokens + input_tokens) / elapsed,
        "weights": weights,
        "dtype": str(_dtype(args, device)).removeprefix("torch."),
    }
