"""Tensor <-> bytes for activations crossing stages: raw bytes plus dtype and shape."""

import numpy as np
import torch

from strata.v1 import engine_pb2

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_to_proto(t: torch.Tensor) -> engine_pb2.Tensor:
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    # bfloat16 has no numpy dtype: ship its bits as int16.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return engine_pb2.Tensor(dtype=_NAMES[t.dtype], shape=list(t.shape), data=raw.numpy().tobytes())


def tensor_from_proto(msg: engine_pb2.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {msg.dtype!r}")
    np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    arr = np.frombuffer(msg.data, dtype=np_dtype)
    on_gpu = torch.device(device).type == "cuda"
    # Staged in page-locked memory for a GPU: a copy from pageable memory would wait for every
    # kernel already queued on the stream.
    t = torch.empty(arr.shape, dtype=torch.int16 if dtype == torch.bfloat16 else dtype, pin_memory=on_gpu)
    t.numpy()[:] = arr
    t = t.reshape(tuple(msg.shape))
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device, non_blocking=True) if on_gpu else t
