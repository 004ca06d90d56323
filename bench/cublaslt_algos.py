"""Would another cuBLASLt algorithm beat torch's pick on the decode linears? (issue 16)

    python -m strata.bench.cublaslt_algos                      # 1B and 8B shapes at M = 256
    python -m strata.bench.cublaslt_algos --models 1b --m 64,256

torch's F.linear takes cuBLASLt's first heuristic answer. This asks cuBLASLt (through ctypes on
the libcublasLt that torch loads) for up to 64 algorithms per shape, adds split-K variants of the
first six (2-8 parts, reduced in the compute or the output type), checks each against torch's
output and times it as bench_linear does (CUDA-graph replays over enough weight copies to overflow
L2). It prints the five fastest per shape and the per-step total of the best of each shape
against torch's. Needs the CUDA toolkit's cublasLt.h for the enum values (/usr/local/cuda).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re

import torch

from strata.bench.bench_linear import MODELS, parse_list
from strata.bench.graph_timing import graph_time_us

WORKSPACE_BYTES = 64 << 20
CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F = 14, 0, 68  # library_types.h / cublas_api.h
ENUMS = (
    "CUBLASLT_MATMUL_DESC_TRANSA",
    "CUBLASLT_MATMUL_DESC_TRANSB",
    "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
    "CUBLASLT_ALGO_CONFIG_TILE_ID",
    "CUBLASLT_ALGO_CONFIG_SPLITK_NUM",
    "CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME",
    "CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE",
    "CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE",
)


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


def _first(patterns: list[str]) -> str:
    for pattern in patterns:
        hits = sorted(glob.glob(pattern, recursive=True))
        if hits:
            return hits[0]
    raise FileNotFoundError(patterns)


class CublasLt:
    """The few cublasLt calls a y = x W^T search needs, column-major: y^T [N, M] = W [K, N]^T x^T [K, M]."""

    def __init__(self):
        site = os.path.dirname(os.path.dirname(torch.__file__))
        self.lib = ctypes.CDLL(_first([f"{site}/nvidia/**/libcublasLt.so*", "/usr/local/cuda/lib64/libcublasLt.so*"]))
        header = open(_first(["/usr/local/cuda/include/cublasLt.h", f"{site}/nvidia/**/cublasLt.h"])).read()
        self.enum = {name: int(re.search(rf"\b{name}\s*=\s*(\d+)", header).group(1)) for name in ENUMS}
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def _set(self, setter, obj, name: str, value: int, ctype=ctypes.c_int32) -> int:
        v = ctype(value)
        return setter(obj, self.enum[name], ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v)))

    def problem(self, m: int, n: int, k: int) -> tuple:
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        self._check(
            self._set(self.lib.cublasLtMatmulDescSetAttribute, desc, "CUBLASLT_MATMUL_DESC_TRANSA", 1), "transa"
        )
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # W, x, y
            layout = ctypes.c_void_p()
            self._check(
                self.lib.cublasLtMatrixLayoutCreate(
                    ctypes.byref(layout), CUDA_R_16BF, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(ld)
                ),
                "layout",
            )
            layouts.append(layout)
        return (desc, *layouts)

    def heuristics(self, problem: tuple, count: int = 64) -> list[tuple[Algo, int]]:
        desc, a, b, c = problem
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        self._check(
            self._set(
                self.lib.cublasLtMatmulPreferenceSetAttribute,
                pref,
                "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES",
                WORKSPACE_BYTES,
                ctypes.c_uint64,
            ),
            "workspace",
        )
        results, returned = (Heuristic * count)(), ctypes.c_int(0)
        self._check(
            self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, c, c, pref, count, results, ctypes.byref(returned)
            ),
            "heuristic",
        )
        return [(results[i].algo, results[i].workspace_size) for i in range(returned.value) if results[i].state == 0]

    def with_split_k(self, problem: tuple, algo: Algo, parts: int, scheme: str) -> tuple[Algo, int] | None:
        """algo with K cut into `parts`, if cuBLASLt accepts it for this problem."""
        new = Algo()
        ctypes.memmove(ctypes.byref(new), ctypes.byref(algo), ctypes.sizeof(Algo))
        setter = self.lib.cublasLtMatmulAlgoConfigSetAttribute
        for name, value in (
            ("CUBLASLT_ALGO_CONFIG_SPLITK_NUM", parts),
            ("CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME", self.enum[scheme]),
        ):
            if self._set(setter, ctypes.byref(new), name, value, ctypes.c_uint32) != 0:
                return None
        desc, a, b, c = problem
        checked = Heuristic()
        if self.lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, ctypes.byref(new), ctypes.byref(checked)):
            return None
        return (new, checked.workspace_size) if checked.workspace_size <= WORKSPACE_BYTES else None

    def describe(self, algo: Algo) -> str:
        def get(name):
            v, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), self.enum[name], ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written)
            )
            return v.value

        return (
            f"tile {get('CUBLASLT_ALGO_CONFIG_TILE_ID')} split-K {get('CUBLASLT_ALGO_CONFIG_SPLITK_NUM')} "
            f"reduction {get('CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME')}"
        )

    def matmul(self, problem: tuple, algo: Algo, workspace_size: int, x, w, y) -> None:
        desc, a, b, c = problem
        self._check(
            self.lib.cublasLtMatmul(
                self.handle,
                desc,
                ctypes.byref(self.alpha),
                ctypes.c_void_p(w.data_ptr()),
                a,
                ctypes.c_void_p(x.data_ptr()),
                b,
                ctypes.byref(self.beta),
                ctypes.c_void_p(y.data_ptr()),
                c,
                ctypes.c_void_p(y.data_ptr()),
                c,
                ctypes.byref(algo),
                ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(workspace_size),
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            ),
            "matmul",
        )


def search(lt: CublasLt, m: int, n: int, k: int) -> tuple[float, list[tuple[float, str]]]:
    """torch's time and the sorted (time, description) of every cuBLASLt candidate that agrees with it."""
    copies = max(2, (160 << 20) // (n * k * 2) + 1)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, weights[0]).float()
    calls, timing = max(copies, 16), dict(replays=10, repeats=5)
    torch_us = graph_time_us(lambda i: torch.mm(x, weights[i % copies].t(), out=y), calls, **timing)
    problem = lt.problem(m, n, k)
    candidates = lt.heuristics(problem)
    for algo, _ in list(candidates[:6]):
        for parts in (2, 3, 4, 6, 8):
            for scheme in ("CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE", "CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE"):
                split = lt.with_split_k(problem, algo, parts, scheme)
                if split is not None:
                    candidates.append(split)
    timed = []
    for algo, workspace in candidates:
        lt.matmul(problem, algo, workspace, x, weights[0], y)
        if (y.float() - want).abs().max().item() > 0.02 * want.abs().max().item() + 1e-3:
            continue  # wrong answer: never a candidate
        us = graph_time_us(
            lambda i, a=algo, ws=workspace: lt.matmul(problem, a, ws, x, weights[i % copies], y), calls, **timing
        )
        timed.append((us, lt.describe(algo)))
    return torch_us, sorted(timed)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=lambda s: parse_list(s, MODELS),
        default=["1b", "8b"],
        help="comma-separated models whose linear shapes to search: " + ", ".join(MODELS),
    )
    p.add_argument("--m", type=lambda s: parse_list(s, kind=int), default=[256], help="comma-separated rows (batch)")
    args = p.parse_args(argv)
    lt = CublasLt()
    print(f"device: {torch.cuda.get_device_name()}")
    for key in args.models:
        model = MODELS[key]
        for m in args.m:
            total_torch = total_best = 0.0
            for linear, (n, k) in model.shapes.items():
                torch_us, timed = search(lt, m, n, k)
                flops = 2 * m * n * k
                print(
                    f"{model.name} {linear} M={m} N={n} K={k}: torch {torch_us:.2f} us "
                    f"({flops / torch_us / 1e6:.0f} TFLOP/s), {len(timed)} cuBLASLt candidates"
                )
                for us, label in timed[:5]:
                    print(f"    {us:8.2f} us {flops / us / 1e6:6.0f} TFLOP/s {us / torch_us:5.2f}x  {label}")
                layers = 1 if linear == "lm_head" else model.layers
                total_torch += torch_us * layers
                total_best += min([torch_us] + [us for us, _ in timed[:1]]) * layers
            print(
                f"== {model.name} M={m}: per step torch {total_torch:.1f} us, best of each shape {total_best:.1f} us "
                f"({total_best / total_torch:.3f}x)"
            )


if __name__ == "__main__":
    main()
