//! A float32 route on the CPU, where MLX's own op is slow.
//!
//! MLX's CPU matmul calls BLAS only for float32; a quantized product of float32 activations
//! runs a scalar kernel, several times slower than OpenBLAS at prefill sizes. For 32 rows or
//! more, dequantizing the weight to float32 once per call costs little next to the product and
//! gives MLX's result up to summation order. Half-precision weights have their own loops at
//! every row count ([`super::kernels`]).
//!
//! Half-precision attention is not routed here: MLX rounds its intermediate scores, so a
//! float32 attention drifts from mlx-lm (by up to 1.6 on the 4-bit fixture's logits). It keeps
//! MLX's steps and roundings with the host's loops for its products (`ops::attention`).

use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Device, DeviceType, Dtype};

/// Rows from which a product takes the float32 route.
pub const WIDE_ROWS: i32 = 32;

/// Whether MLX computes on the CPU in this process.
pub fn on_cpu() -> bool {
    static CPU: OnceLock<bool> = OnceLock::new();
    *CPU.get_or_init(|| {
        let kind = Device::try_default().ok().and_then(|d| d.get_type().ok());
        matches!(kind, Some(DeviceType::Cpu))
    })
}

/// Whether a product with `rows` rows of `dtype` activations (or quantized weights) should take
/// the float32 route. Half-precision activations stay in the host's loops at every row count
/// (see [`super::kernels`]).
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

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;
    use crate::nn::{Linear, Quantization};

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// Largest |a − b| relative to the largest |b|.
    fn relative_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (float32(a).unwrap(), float32(b).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>();
        diff / b.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    #[test]
    fn quantized_products_equal_mlxs_quantized_matmul() {
        for (bits, group_size) in [(4, 32), (4, 64), (8, 64), (8, 128)] {
            let w = normal(&[64, 256], 3);
            let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
            let x = normal(&[WIDE_ROWS + 3, 256], 4);
            let q = Quantization { group_size, bits };
            let linear = Linear::quantized(wq.clone(), scales.clone(), biases.clone(), q);
            let ours = linear.forward(&x).unwrap();
            let mlx = mlx_rs::ops::quantized_matmul(&x, &wq, &scales, &biases, true, group_size, bits).unwrap();
            let d = relative_difference(&ours, &mlx);
            assert!(d <= 1e-5, "{bits} bits, group {group_size}: {d}");
        }
    }
}
