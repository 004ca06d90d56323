"""The one-launch decode attention's time per KV-split count (kernels/decode_attention.py), for the
8B's whole model and a TP2 rank's heads at batch 16: does the split heuristic pick the fastest?

    python -m strata.bench.decode_attention_splits     # one GPU
"""

import torch

from strata.bench.graph_timing import graph_time_us
from strata.kernels import attention_launch as launch
from strata.kernels.decode_attention import decode_attention
from strata.kernels.testing import make_paged_batch


def main() -> None:
    dev = "cuda"
    for hq, hkv in ((32, 8), (16, 4)):
        for batch in (16,):
            ctx = [575] * batch
            b = make_paged_batch(
                [1] * batch,
                ctx,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=128,
                block_size=16,
                dtype=torch.bfloat16,
                device=dev,
            )
            qkv = torch.randn(batch, (hq + 2 * hkv) * 128, device=dev, dtype=torch.bfloat16)
            pos = (b.seq_lens - 1).long()
            inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
            f = torch.arange(8192, dtype=torch.float32)[:, None] * inv[None, :]
            cos, sin = f.cos().to(dev, torch.bfloat16), f.sin().to(dev, torch.bfloat16)
            auto = launch.choose_launch_config(
                num_seqs=batch,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_dim=128,
                max_query_len=1,
                max_seq_len=8192,
                sm_count=132,
            ).num_kv_splits
            row = []
            for splits in (1, 2, 4, 8, 16, 32):
                t = graph_time_us(
                    lambda _: decode_attention(
                        qkv,
                        pos,
                        cos,
                        sin,
                        b.kv_cache,
                        b.seq_lens,
                        b.block_tables,
                        b.slot_mapping,
                        num_q_heads=hq,
                        scale=0.088,
                        max_seq_len=8192,
                        num_kv_splits=splits,
                    ),
                    32,
                    replays=30,
                )
                row.append(f"{splits}:{t:.2f}")
            print(f"hq {hq} hkv {hkv} batch {batch} ctx 576 (auto splits {auto}):", " ".join(row), flush=True)


if __name__ == "__main__":
    main()
