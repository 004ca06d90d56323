"""Greedy tokens through the model shards' Triton kernels on a GPU equal transformers' generate().

The CPU tests (tests/test_model_shard.py) check the shards against HF on the torch attention
path; this runs the same steps with the GPU's kernels (paged attention, the one-launch decode
attention, the fused norm, rotary and SiLU kernels), in float32 so that the only difference from
HF is the order of float32 sums (the attention kernels take IEEE dots there). The prompts are long
enough for the launches the offline benchmarks take: 64-key tiles every query sees in full (no
masks), 128-row query blocks where the step's every query fills one, and decodes beside prefill
chunks over cached keys.

    python -m pytest tests/gpu/test_greedy_hf_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from tiny_models import write_tiny_model  # noqa: E402

from strata.kernels.attention_launch import choose_launch_config  # noqa: E402
from strata.services.worker.model.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.paged_inputs import SequenceChunk  # noqa: E402
from tests.shard_pipeline import Pipeline, greedy_decode, hf_greedy, random_prompts, shuffled_block_tables  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch, seed=7) for arch in ("llama", "qwen2")}


def gpu_pipeline(model_dir, num_stages: int) -> Pipeline:
    return Pipeline(
        model_dir,
        num_stages,
        device="cuda",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        attn_backend=TritonAttentionBackend(),
    )


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_logits_match_hf_on_the_kernels(arch, num_stages, tiny_dirs):
    hf = hf_model(tiny_dirs[arch])
    pipeline = gpu_pipeline(tiny_dirs[arch], num_stages)
    lengths = [300, 150]
    config = pipeline.config
    # The launch this step takes: every query at least 64 tokens at GQA 2 fills a 128-row block.
    launch = choose_launch_config(
        num_seqs=2,
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_query_len=300,
        max_seq_len=300,
        sm_count=132,
        min_query_len=150,
    )
    assert launch.block_q * config.num_attention_heads // config.num_key_value_heads == 128
    prompts = random_prompts(lengths, config.vocab_size, seed=1)
    tables = shuffled_block_tables(lengths, seed=num_stages, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    logits = pipeline.step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], all_logits=True)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(logits.cpu(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_decoding_matches_hf_generate_on_the_kernels(arch, num_stages, tiny_dirs):
    hf = hf_model(tiny_dirs[arch])
    pipeline = gpu_pipeline(tiny_dirs[arch], num_stages)
    prompts = random_prompts([300, 150, 200], pipeline.config.vocab_size, seed=2)
    # Step 1: three prompts' first chunks, each at least 64 tokens (128-row blocks). Step 2: the
    # first decodes beside the others' chunks over their cached keys. Then decodes alone (the
    # one-launch decode attention), past several 64-key tiles of context.
    chunk_plans = [[300], [64, 86], [128, 72]]
    max_new_tokens = 24
    ours = greedy_decode(pipeline, prompts, chunk_plans, max_new_tokens, pipeline.config.eos_token_id)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, max_new_tokens)
