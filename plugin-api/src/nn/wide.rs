//! Products of many rows (a prefill chunk) on the CPU through float32 BLAS.
//!
//! MLX's CPU matmul calls BLAS only for float32. A bfloat16 or float16 product runs MLX's own
//! generic kernel and a quantized one a scalar kernel, several times slower than OpenBLAS at
//! prefill sizes; attention over a long cache pays it on every chunk, so prefill time grew
//! much faster than the prompt. For many rows, converting the operands to float32 once per call
//! costs little next to the product, and gives MLX's own result up to summation order where
//! MLX accumulates in float32: half-precision products (rounded once at the end) and quantized
//! products of float32 activations. Quantized weights times half-precision activations keep
//! MLX's op, which computes those in half precision element by element (see
//! [`super::kernels::applies_to_quantized`]). Few rows (decode steps, verify windows) are
//! [`super::kernels`]' work.

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
/// the float32 route.
pub fn takes_float32_route(rows: i32, dtype: Dtype, quantized: bool) -> bool {
    let half = matches!(dtype, Dtype::Bfloat16 | Dtype::Float16);
    let worth_it = if quantized { super::kernels::applies_to_quantized(dtype) } else { half };
    rows >= WIDE_ROWS && worth_it && on_cpu()
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
    use crate::nn::ops::{attention, Mask};
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
    fn half_precision_products_equal_mlxs_within_one_rounding() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let x = normal(&[2, WIDE_ROWS, 96], 1).as_dtype(dtype).unwrap();
            let w = normal(&[80, 96], 2).as_dtype(dtype).unwrap();
            let linear = Linear { weight: w.clone(), scales: None, biases: None, quantization: None };
            let ours = linear.forward(&x).unwrap();
            assert_eq!(ours.dtype(), dtype);
            let mlx = x.matmul(w.t()).unwrap();
            let eps = if dtype == Dtype::Bfloat16 { 2f32.powi(-8) } else { 2f32.powi(-11) };
            let d = relative_difference(&ours, &mlx);
            assert!(d <= 2.0 * eps, "{dtype:?}: {d}");
        }
    }

    #[test]
    fn quantized_products_equal_mlxs_quantized_matmul() {
        for (bits, group_size) in [(4, 32), (4, 64), (8, 64), (8, 128)] {
            let w = normal(&[64, 256], 3);
            let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
            let x = normal(&[WIDE_ROWS + 3, 256], 4);
            let q = Quantization { group_size, bits };
            let linear = Linear {
                weight: wq.clone(),
                scales: Some(scales.clone()),
                biases: Some(biases.clone()),
                quantization: Some(q),
            };
            let ours = linear.forward(&x).unwrap();
            let mlx = mlx_rs::ops::quantized_matmul(&x, &wq, &scales, &biases, true, group_size, bits).unwrap();
            let d = relative_difference(&ours, &mlx);
            assert!(d <= 1e-5, "{bits} bits, group {group_size}: {d}");
        }
    }

    #[test]
    fn half_precision_attention_equals_mlxs_within_rounding() {
        let q = normal(&[1, 4, WIDE_ROWS, 64], 5).as_dtype(Dtype::Bfloat16).unwrap();
        let k = normal(&[1, 1, 3 * WIDE_ROWS, 64], 6).as_dtype(Dtype::Bfloat16).unwrap();
        let v = normal(&[1, 1, 3 * WIDE_ROWS, 64], 7).as_dtype(Dtype::Bfloat16).unwrap();
        let ours = attention(&q, &k, &v, 0.125, &Mask::Causal).unwrap();
        let mask = mlx_rs::fast::ScaledDotProductAttentionMask::Causal;
        let mlx = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.125, mask, None).unwrap();
        let d = relative_difference(&ours, &mlx);
        assert!(d <= 2e-2, "{d}");
    }
}
