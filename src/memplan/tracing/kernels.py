"""Fake-tensor kernels that torch's own do not cover, registered once on import.

``aten._grouped_mm`` (HF transformers' default MoE experts): torch's meta kernel checks the
CUDA kernel's constraints (bf16 only) and, in CPU builds, lays the output out unpadded, while
the CPU kernel that plain training runs takes fp32/fp16/bf16 and pads the output's rows to 16
bytes (ATen's ``create_grouped_gemm_output_tensor``, which the CUDA kernel shares). This fake
kernel mirrors that allocation for every dtype, so fake and real steps count the same bytes.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm_fake(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                     ) -> torch.Tensor:
    if mat_a.dtype not in _DTYPES or mat_b.dtype != mat_a.dtype:
        raise RuntimeError(f"grouped_mm: expected float32/float16/bfloat16 inputs of one "
                           f"dtype, got {mat_a.dtype} and {mat_b.dtype}")
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3) or bias is not None:
        raise RuntimeError("grouped_mm: expected 2D or 3D multiplicands and no bias")
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if offs is None and (a_2d or b_2d):
        raise RuntimeError("grouped_mm: offs is needed for 2D multiplicands")
    if a_2d and b_2d:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif a_2d:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif b_2d:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    dtype = out_dtype or mat_a.dtype
    align = 16 // dtype.itemsize
    padded = (size[-1] + align - 1) // align * align
    stride = [size[1] * padded, padded, 1] if a_2d == b_2d else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


if hasattr(torch.ops.aten, "_grouped_mm"):
    torch.library.register_fake("aten::_grouped_mm", _grouped_mm_fake)
