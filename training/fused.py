"""Gemma 4's GeGLU and softcapped cross-entropy as single kernels for training, with their
gradients written out.

Both tanh (GELU's, the logit softcap's) are written as sigmoids, 1 + tanh(u) = 2 sigmoid(2u):
the same function, but on MLX's CPU backend tanh is libm's scalar call, while sigmoid is MLX's
exp polynomial, which `loop.compile_for_this_cpu` vectorizes. The gradients are written by hand
so that the backward pass is one elementwise kernel each, without the scatter that the gradient
of a gather becomes. The weights and their names stay mlx-lm's; only how these functions are
computed differs, by rounding (`smoke_test.py` checks the gradients against mlx-lm's forms).
"""

import math
from functools import lru_cache

import mlx.core as mx
from mlx_lm.models import gemma4_text

GELU_SCALE = 2 * math.sqrt(2 / math.pi)
GELU_CUBIC = 0.044715


@mx.compile
def _gelu_gate(gate: mx.array):
    """sigmoid of the GELU's argument, and that argument's derivative."""
    s = mx.sigmoid(GELU_SCALE * (gate + GELU_CUBIC * gate * gate * gate))
    return s, GELU_SCALE * (1 + 3 * GELU_CUBIC * gate * gate)


@mx.custom_function
def geglu(gate: mx.array, x: mx.array) -> mx.array:
    """gelu_approx(gate) * x, as mlx-lm's Gemma 4 MLP computes it."""
    return _geglu_forward(gate, x)


@mx.compile
def _geglu_forward(gate, x):
    return gate * _gelu_gate(gate)[0] * x


@mx.compile
def _geglu_backward(gate, x, cot):
    s, da = _gelu_gate(gate)
    dgelu = s + gate * s * (1 - s) * da
    return cot * x * dgelu, cot * gate * s


@geglu.vjp
def _geglu_vjp(primals, cotangent, output):
    gate, x = primals
    return _geglu_backward(gate, x, cotangent)


@lru_cache(maxsize=None)
def softcap_cross_entropy(softcap: float):
    """Per-token cross-entropy of softcap * tanh(logits / softcap), in float32:
    `softcap_cross_entropy(30.0)(logits, targets)`."""

    @mx.compile
    def capped(z):
        s = mx.sigmoid(z.astype(mx.float32) * (2 / softcap))
        return 2 * softcap * s - softcap, s

    def target_capped(logits, targets):
        """The target's capped logit from its raw logit: a gather of one value per token."""
        return capped(mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0])[0]

    @mx.compile
    def logsumexp(c):
        # Written out rather than mx.logsumexp, whose exp is MLX's scalar one on CPU.
        m = mx.stop_gradient(c.max(axis=-1, keepdims=True))
        return (m + mx.log(mx.exp(c - m).sum(axis=-1, keepdims=True)))[..., 0]

    @mx.custom_function
    def loss(logits, targets):
        return logsumexp(capped(logits)[0]) - target_capped(logits, targets)

    @mx.compile
    def backward(logits, targets, cot, lse):
        c, s = capped(logits)
        p = mx.exp(c - lse[..., None])  # the softmax, from the forward's logsumexp
        onehot = mx.arange(c.shape[-1]) == targets[..., None]
        # d capped / d z = 1 - tanh^2 = 4 s (1 - s)
        return ((p - onehot) * (cot[..., None] * 4 * s * (1 - s))).astype(logits.dtype)

    @loss.vjp
    def loss_vjp(primals, cotangent, output):
        logits, targets = primals
        lse = output + target_capped(logits, targets)
        return backward(logits, targets, cotangent, lse), mx.zeros_like(targets)

    return loss


class MLP(gemma4_text.MLP):
    """mlx-lm's Gemma 4 MLP with `geglu` above."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))
