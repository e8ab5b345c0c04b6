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
    if matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16) && super::wide::on_cpu() {
        if let Some(out) = half_attention(q, k, v, scale, mask)? {
            return Ok(out);
        }
    }
    let mask = match mask {
        Mask::All => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    mlx_rs::fast::scaled_dot_product_attention(q, k, v, scale, mask, None)
}

/// MLX's CPU attention in half precision (its fallback in mlx/fast.cpp: scale q, q·kᵀ, mask with
/// the dtype's lowest value, precise softmax, ·v, every step rounded to the dtype), with the two
/// products through the host's loops instead of MLX's generic kernel: the same roundings, the
/// sums in another order, several times faster, and a query's result independent of how many
/// queries share the call. `None` where the loops do not apply.
fn half_attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Mask) -> Result<Option<Array>, Exception> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let dtype = q.dtype();
    let (qs, ks) = (q.shape().to_vec(), k.shape().to_vec());
    let (b, hq, l, d, hkv, s) = (qs[0], qs[1], qs[2], qs[3], ks[1], ks[2]);
    if hkv == 0 || hq % hkv != 0 {
        return Ok(None);
    }
    let rep = hq / hkv;
    let q = q.multiply(scalar(scale, dtype)?)?.reshape(&[b, hkv, rep * l, d])?;
    let mut scores = Vec::new();
    for bi in 0..b {
        for h in 0..hkv {
            let x = q.try_index((bi, h))?;
            let keys = k.try_index((bi, h))?.contiguous()?;
            let Some(part) = super::kernels::small_product(&x, &keys, None, None, None)? else { return Ok(None) };
            scores.push(part);
        }
    }
    let scores = mlx_rs::ops::stack(&scores, 0)?.reshape(&[b, hq, l, s])?;
    let lowest = scalar(f32::from_bits(if dtype == Dtype::Bfloat16 { 0xFF7F_0000 } else { 0xC77F_E000 }), dtype)?;
    let scores = match mask {
        Mask::All => scores,
        Mask::Causal => {
            let offset = (s - l).max(0);
            let rows = Array::from_iter(offset..offset + l, &[l, 1]);
            let cols = Array::from_iter(0..s, &[1, s]);
            mlx_rs::ops::select(&rows.ge(&cols)?, &scores, &lowest)?
        }
        Mask::Array(m) if m.dtype() == Dtype::Bool => mlx_rs::ops::select(m, &scores, &lowest)?,
        Mask::Array(m) => scores.add(m)?,
    };
    let probs = mlx_rs::ops::softmax_axis(&scores, -1, true)?.reshape(&[b, hkv, rep * l, s])?;
    let mut out = Vec::new();
    for bi in 0..b {
        for h in 0..hkv {
            let x = probs.try_index((bi, h))?;
            let values_t = v.try_index((bi, h))?.t().contiguous()?;
            let Some(part) = super::kernels::small_product(&x, &values_t, None, None, None)? else { return Ok(None) };
            out.push(part);
        }
    }
    Ok(Some(mlx_rs::ops::stack(&out, 0)?.reshape(&[b, hq, l, d])?))
}

#[cfg(test)]
mod half_attention_tests {
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    use super::*;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap().as_dtype(dtype).unwrap()
    }

    fn largest_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.as_dtype(Dtype::Float32).unwrap(), b.as_dtype(Dtype::Float32).unwrap());
        a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    #[test]
    fn equals_mlxs_attention_within_a_rounding_step_and_ignores_how_many_queries_share_it() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let (q, k, v) = (
                normal(&[1, 4, 6, 32], 1, dtype),
                normal(&[1, 2, 40, 32], 2, dtype),
                normal(&[1, 2, 40, 32], 3, dtype),
            );
            let visible = Array::from_iter((0..6 * 40).map(|i| (i * 7) % 5 != 0), &[1, 1, 6, 40]);
            for (name, mask) in [("all", Mask::All), ("causal", Mask::Causal), ("array", Mask::Array(visible))] {
                let ours = attention(&q, &k, &v, 0.17, &mask).unwrap();
                let sdpa_mask = match &mask {
                    Mask::All => None,
                    Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
                    Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
                };
                let mlx = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.17, sdpa_mask, None).unwrap();
                // Outputs are near 1 in size: a rounding step is 2⁻⁸ (bfloat16) or 2⁻¹¹.
                assert!(largest_difference(&ours, &mlx) <= 2f32.powi(-7), "{dtype:?} {name}");
            }
            // The last query alone (a decode step) gives what it gives among six (a window).
            let window = attention(&q, &k, &v, 0.17, &Mask::Causal).unwrap();
            let last = q.try_index((.., .., 5..6)).unwrap();
            let alone = attention(&last, &k, &v, 0.17, &Mask::Causal).unwrap();
            assert_eq!(largest_difference(&alone, &window.try_index((.., .., 5..6)).unwrap()), 0.0, "{dtype:?}");
        }
    }
}
