"""The accelerated backends of native packages (specdec.runtime.kernels): AMD's
zentorch int8 GEMM and llama.cpp's ggml kernels, each skipped with a log line where
its package does not install or its probe fails."""
from __future__ import annotations

import torch

from specdec.runtime.kernels import Backend, register


def _zentorch_prepare(codes: torch.Tensor, scales: torch.Tensor):
    packed = torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(codes.contiguous())
    return packed, scales.float().contiguous()


def _zentorch_run(state, x: torch.Tensor) -> torch.Tensor:
    packed, scales = state
    return torch.ops.zentorch.zentorch_dynamic_qlinear(x.bfloat16(), packed, scales, None,
                                                       is_weight_prepacked=True).float()


# AMD's plugin (`pip install zentorch`, built per torch version): int8 x int8 with
# activations quantized per call from the same codes and scales; one scale per row
# (fbgemm's is one per call), so a row's output is the same in any call. Its GEMM
# (AOCL's s8s8s32) needs AVX-512 VNNI: on an AVX2 CPU it ends the process.
register(Backend("zentorch-int8", "int8-channel", "zentorch", _zentorch_prepare, _zentorch_run, per_row=True,
                 cpu_flags=("avx512_vnni",)))


def _ggml_prepare(blocks: torch.Tensor, ggml_type: int, in_features: int):
    from specdec.runtime import ggml
    linear = ggml.GgmlLinear(blocks, ggml_type, in_features)
    probe = torch.randn(ggml.CHUNK_ROWS, in_features, generator=torch.Generator().manual_seed(1))
    if not linear.rows_alone(probe):
        raise RuntimeError("its rows are not computed alone: a row's output changed with the rows beside it")
    return linear


def _ggml_run(linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, x.dtype)


def _ggml_selftest() -> None:
    from specdec.runtime import ggml
    ggml.selftest()


# llama.cpp's own kernels (ggml, shipped by llama-cpp-python: `pip install ".[llama-cpp]"`) over the
# GGUF's blocks as they are, activations quantized per block of a row (specdec.runtime.ggml). On an
# AVX2 EPYC they ran the 1.5B's Q4_K and Q6_K layers at one row in about a third of torch's int4
# kernel's time and half of fbgemm's; their cost grows with the rows as torch's int4 kernel's does.
register(Backend("ggml", "gguf-blocks", "llama_cpp", _ggml_prepare, _ggml_run, per_row=True,
                 selftest=_ggml_selftest))
