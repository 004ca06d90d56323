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
        model = _random_llama(preset, dtype, device, args.seed)
        weights = "same shapes, random weights (throughput depends on shapes only)"
    model.eval()
    model.generation_config.eos_token_id = None  # fixed-length generation, like ignore_eos
    return model, weights


def _random_llama(preset: str, dtype, device: str, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from strata.services.worker.model.weights import DUMMY_STD, dummy_config

    c = dummy_config(preset)
    if c.architecture != "LlamaForCausalLM":
        raise SystemExit(f"HF baseline: dummy preset {preset} is a {c.architecture}; only Llama presets are built")
    config = LlamaConfig.from_dict(
        dict(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
            mlp_bias=c.mlp_bias,
        )
    )
    # Built directly on the device: initialising billions of weights on the CPU takes minutes.
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator)
    return model


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
