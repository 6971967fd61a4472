"""Fake-tensor kernels that torch's own do not cover, registered once on import.

``aten._grouped_mm`` (HF transformers' default MoE experts): torch's meta kernel checks the
CUDA kernel's constraints (bf16 only) and, in CPU builds, lays the output out unpadded, while
the CPU kernel that plain training runs takes fp32/fp16/bf16 and pads the output's rows to 16
bytes (ATen's ``create_grouped_gemm_output_tensor``, which the CUDA kernel shares). This fake
kernel mirrors that allocation for every dtype, so fake and real steps count the same bytes.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

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


# ``aten.mkldnn_rnn_layer`` (nn.LSTM's CPU kernel, oneDNN) returns a workspace for backward
# whose size oneDNN decides (90,112 bytes for one layer of 32 over 10 x 4 steps: page-rounded
# parts); torch's meta kernel returns an empty one, so a fake step under-counted nn.LSTM by
# half. The size depends on the shapes only: it is learned by running the real kernel on zeros
# once per distinct shape (where fake tensors cannot go, memplan runs for real, see datadep).
# A long sequence is not run whole (its workspace alone can take gigabytes): the size grows
# linearly with the steps, so it is extrapolated from 16 and 32 steps, plus 8 pages for the
# rounding: a bound a few KiB over the real size, never under it.
_WORKSPACE_BYTES: dict[tuple[object, ...], int] = {}
_WHOLE_STEPS = 64  # sequences up to this long are run whole: exact
_PAGE = 4096


def _rnn_workspace_bytes(args: tuple[object, ...]) -> int:
    grad = torch.is_grad_enabled()  # the kernel keeps no workspace without it
    key = (grad, *(((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                   else tuple(a) if isinstance(a, list) else a) for a in args))
    known = _WORKSPACE_BYTES.get(key)
    if known is None:
        x = args[0]
        assert isinstance(x, torch.Tensor)
        time_dim = 1 if args[14] else 0  # batch_first
        steps = x.shape[time_dim]
        if steps <= _WHOLE_STEPS:
            known = _run_rnn_layer(args, steps, time_dim)
        else:
            short, longer = _run_rnn_layer(args, 16, time_dim), _run_rnn_layer(args, 32, time_dim)
            known = longer + (longer - short) * (steps - 32) // 16 + 8 * _PAGE
        _WORKSPACE_BYTES[key] = known
    return known


def _run_rnn_layer(args: tuple[object, ...], steps: int, time_dim: int) -> int:
    """Workspace bytes of the real kernel over ``steps`` steps, on zeros that do not require
    grad (no autograd graph)."""
    with unset_fake_temporarily():
        real: list[object] = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor)
                              else a for a in args]
        x = real[0]
        assert isinstance(x, torch.Tensor)
        real[0] = x.narrow(time_dim, 0, 1).expand(
            *[steps if d == time_dim else n for d, n in enumerate(x.shape)]).contiguous()
        workspace = torch.ops.aten.mkldnn_rnn_layer.default(*real)[3]
    return 0 if workspace is None else int(workspace.numel())


def _mkldnn_rnn_layer_fake(input: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor,
                           w2: torch.Tensor, w3: torch.Tensor, hx_: torch.Tensor | None,
                           cx_: torch.Tensor | None, reverse: bool, batch_sizes: list[int],
                           mode: int, hidden_size: int, num_layers: int, has_biases: bool,
                           bidirectional: bool, batch_first: bool, train: bool
                           ) -> tuple[torch.Tensor, ...]:
    """torch's meta kernel (``_meta_registrations.mkldnn_rnn_layer``), with the CPU kernel's
    workspace."""
    seq, batch = (input.shape[1], input.shape[0]) if batch_first else input.shape[:2]
    output = input.new_empty([batch, seq, hidden_size] if batch_first
                             else [seq, batch, hidden_size])
    hy = torch.empty(0, device=input.device) if hx_ is None else hx_.new_empty(hx_.shape)
    cy = torch.empty(0, device=input.device) if cx_ is None else cx_.new_empty(cx_.shape)
    args = (input, w0, w1, w2, w3, hx_, cx_, reverse, batch_sizes, mode, hidden_size,
            num_layers, has_biases, bidirectional, batch_first, train)
    size = _rnn_workspace_bytes(args) if input.device.type == "cpu" else 0
    workspace = torch.empty(size, device=input.device, dtype=torch.uint8)
    return output, hy, cy, workspace


def _mkldnn_rnn_layer_backward_fake(input: torch.Tensor, weight1: torch.Tensor,
                                    weight2: torch.Tensor, weight3: torch.Tensor,
                                    weight4: torch.Tensor, hx_: torch.Tensor,
                                    cx_tmp: torch.Tensor, *rest: object) -> tuple[torch.Tensor, ...]:
    """torch's meta kernel (``_meta_registrations.mkldnn_rnn_layer_backward``), except that
    the two bias gradients are two tensors, as the CPU kernel returns them (the meta kernel
    returns one tensor twice, and autograd then copies one: ops the real step does not run)."""
    mode, hidden_size = rest[7], rest[8]
    assert isinstance(hidden_size, int)
    bias = 4 * hidden_size if mode == 3 else weight3.shape[0]  # mode 3: GRU
    return (input.new_empty(input.shape, dtype=torch.float),
            weight1.new_empty(weight1.shape, dtype=torch.float),
            weight2.new_empty(weight2.shape, dtype=torch.float),
            weight3.new_empty([bias], dtype=torch.float),
            weight3.new_empty([bias], dtype=torch.float),
            hx_.new_empty(hx_.shape, dtype=torch.float),
            cx_tmp.new_empty(cx_tmp.shape, dtype=torch.float))


if hasattr(torch.ops.aten, "mkldnn_rnn_layer"):
    torch.library.register_fake("aten::mkldnn_rnn_layer", _mkldnn_rnn_layer_fake)
    torch.library.register_fake("aten::mkldnn_rnn_layer_backward",
                                _mkldnn_rnn_layer_backward_fake)
