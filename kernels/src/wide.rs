//! A float32 route on the CPU, where MLX's own op is slow.
//!
//! MLX's CPU matmul calls BLAS only for float32; a quantized product of float32 activations
//! runs a scalar kernel, several times slower than OpenBLAS at prefill sizes. For 32 rows or
//! more, dequantizing the weight to float32 once per call costs little next to the product and
//! gives MLX's result up to summation order. Half-precision weights have their own loops at
//! every row count ([`crate::product`]).
//!
//! Half-precision attention is not routed here: MLX rounds its intermediate scores, so a
//! float32 attention drifts from mlx-lm (by up to 1.6 on the 4-bit fixture's logits). It keeps
//! MLX's steps and roundings with the host's loops for its products (`ops::attention`).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

pub use crate::route::on_cpu;

/// Rows from which a product takes the float32 route.
pub const WIDE_ROWS: i32 = 32;

/// Whether a product with `rows` rows of `dtype` activations (or quantized weights) should take
/// the float32 route. Half-precision activations stay in the host's loops at every row count
/// (see [`crate::product`]).
pub fn takes_float32_route(rows: i32, dtype: Dtype, quantized: bool) -> bool {
    rows >= WIDE_ROWS && quantized && dtype == Dtype::Float32 && on_cpu()
}

/// Rows of `x`: the product of every dimension but the last.
pub fn rows(x: &Array) -> i32 {
    let shape = x.shape();
    shape[..shape.len().saturating_sub(1)].iter().product()
}

/// `x` in float32 (no copy when it already is).
pub fn float32(x: &Array) -> Result<Array, Exception> {
    if x.dtype() == Dtype::Float32 {
        Ok(x.clone())
    } else {
        x.as_dtype(Dtype::Float32)
    }
}
