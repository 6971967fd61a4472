"""The one aten op taxonomy: which ops drop-cheap keeps, and which may run in place.

Ops are named by their aten target as capture records it (``"aten.convolution.default"``).
"""

from __future__ import annotations

# Drop-cheap (Sec. 4.2) keeps the outputs of these expensive ops and recomputes every other
# op's output in backward: norms, activations, pooling, pointwise (Korthikanti et al.: keep
# matmuls, recompute softmax/dropout/norms). One set for the planners, the runtime and the
# static allocator's mirror plan.
EXPENSIVE = ("convolution", "aten.mm.", "addmm", "bmm", "matmul", "linear", "scaled_dot_product",
             "flash_attention", "efficient_attention")

# Ops whose output element i depends only on input element i (same size): they may write their
# output over an input that has no other pending use (Sec. 3, "inplace operation").
POINTWISE_OPS = frozenset(
    {
        "abs", "add", "clamp", "clone", "copy", "div", "exp", "gelu", "gelu_backward",
        "hardtanh", "hardtanh_backward", "leaky_relu", "leaky_relu_backward", "log",
        "masked_fill", "mul", "native_dropout", "native_dropout_backward", "neg", "pow",
        "reciprocal", "relu", "rsqrt", "rsub", "sigmoid", "sigmoid_backward", "silu",
        "silu_backward", "sqrt", "sub", "tanh", "tanh_backward", "threshold",
        "threshold_backward", "where",
    }
)


def op_name(target: str) -> str:
    """``"aten.relu.default"`` -> ``"relu"``."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 3 else target


def is_expensive(target: str) -> bool:
    """Whether drop-cheap keeps this op's outputs (conv, matmul, attention)."""
    return any(key in target for key in EXPENSIVE)


def is_pointwise(target: str) -> bool:
    """Whether the op may write its output over a same-sized input (in place)."""
    return op_name(target).rstrip("_") in POINTWISE_OPS
