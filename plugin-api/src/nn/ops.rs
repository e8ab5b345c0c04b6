//! Small functional pieces, each as mlx-lm computes it.

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

/// RMSNorm with a weight (multiplied as is, not 1 + w) or without one.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    mlx_rs::fast::rms_norm(x, weight, eps)
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, mlx's `gelu_approx`.
pub fn gelu_approx(x: &Array) -> Result<Array, Exception> {
    let dtype = x.dtype();
    let c = scalar(0.044715, dtype)?;
    let k = scalar((2.0 / std::f32::consts::PI).sqrt(), dtype)?;
    // x³ as one power (rounded once), like mlx's `x ** 3`, not two products.
    let cube = x.power(scalar(3.0, dtype)?)?;
    let inner = x.add(cube.multiply(&c)?)?.multiply(&k)?;
    let gate = mlx_rs::ops::tanh(&inner)?.add(scalar(1.0, dtype)?)?;
    x.multiply(scalar(0.5, dtype)?)?.multiply(&gate)
}

/// GeGLU: `gelu_approx(gate) ⊙ up`.
pub fn geglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    gelu_approx(gate)?.multiply(up)
}

/// `tanh(x / cap) · cap`.
pub fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    let c = scalar(cap, x.dtype())?;
    mlx_rs::ops::tanh(x.divide(&c)?)?.multiply(&c)
}

/// A scalar in `dtype`, so that it does not promote the array it meets (Python floats are
/// weakly typed in MLX; a Rust f32 array is not).
pub fn scalar(value: f32, dtype: Dtype) -> Result<Array, Exception> {
    let x = Array::from_f32(value);
    if dtype == Dtype::Float32 {
        return Ok(x);
    }
    x.as_dtype(dtype)
}

/// Which keys each query of an attention may read.
#[derive(Clone)]
pub enum Mask {
    /// Every key.
    All,
    /// The L queries are the last L positions of the S keys, each reading itself and before.
    Causal,
    /// Boolean, broadcastable to [B, Hq, L, S]; true = attend.
    Array(Array),
}

/// Attention of queries [B, Hq, L, D] over keys/values [B, Hkv, S, D].
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Mask) -> Result<Array, Exception> {
    let mask = match mask {
        Mask::All => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    mlx_rs::fast::scaled_dot_product_attention(q, k, v, scale, mask, None)
}
