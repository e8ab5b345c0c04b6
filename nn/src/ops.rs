//! Small functional pieces, each as mlx-lm computes it: this crate's kernels where the CPU route
//! covers them ([`kernels`]), MLX's ops otherwise.

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

use kernels::layout::first_slots;

use crate::fused::{fused, Chain};

pub use kernels::argmax::{first_max, first_max_half};
pub use kernels::arrays::scalar;
pub use kernels::attention::{KeyPiece, Mask, RowKeys};
pub use kernels::exp::mlx_exp;
pub use kernels::softmax::tempered_softmax_rows;

/// RMSNorm with a weight (multiplied as is, not 1 + w) or without one.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    if let Some(y) = kernels::norm::rms_norm(x, weight, eps)? {
        return Ok(y);
    }
    if kernels::route::device_is_cpu() && weight.is_none_or(|w| w.dtype() == x.dtype()) {
        return compiled_rms_norm(x, weight, eps);
    }
    mlx_rs::fast::rms_norm(x, weight, eps)
}

/// [`rms_norm`] where MLX computes on the CPU. MLX's CPU backend has no kernel for
/// `fast::rms_norm` and runs its composition op by op; compiled, the ops around the sum fuse:
/// three tasks on MLX's stream rather than twelve. For a weight of x's dtype.
fn compiled_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    let eps = Array::from_f32(eps);
    match weight {
        Some(w) => fused(|a| Ok(vec![normalized(&a[0], &a[1])?.multiply(&a[2])?]), &[x.clone(), eps, w.clone()]),
        None => fused(|a| Ok(vec![normalized(&a[0], &a[1])?]), &[x.clone(), eps]),
    }
}

/// x / rms(x) in float32, back in x's dtype: MLX's own fallback for `fast::rms_norm`, op for op.
fn normalized(x: &Array, eps: &Array) -> Result<Array, Exception> {
    let wide = x.as_dtype(Dtype::Float32)?;
    let mean_square = wide.square()?.mean_axes(&[-1], true)?;
    wide.multiply(mean_square.add(eps)?.rsqrt()?)?.as_dtype(x.dtype())
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
    if let Some(y) = kernels::activation::geglu(gate, up)? {
        return Ok(y);
    }
    fused(GEGLU, &[gate.clone(), up.clone()])
}

/// [`geglu`] as one chain of MLX ops over (gate, up).
const GEGLU: Chain = |x| Ok(vec![gelu_approx(&x[0])?.multiply(&x[1])?]);

/// SwiGLU: `silu(gate) ⊙ up`, silu being `gate · sigmoid(gate)` (Qwen's MLP, as mlx-lm writes
/// it).
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    if let Some(y) = kernels::activation::swiglu(gate, up)? {
        return Ok(y);
    }
    gate.multiply(mlx_rs::ops::sigmoid(gate)?)?.multiply(up)
}

/// `tanh(x / cap) · cap`.
pub fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    if let Some(y) = kernels::activation::softcap(x, cap)? {
        return Ok(y);
    }
    fused(SOFTCAP, &[x.clone(), scalar(cap, x.dtype())?])
}

/// [`softcap`] as one chain over (x, cap): the cap an input, so that one compiled chain serves
/// every cap.
const SOFTCAP: Chain = |x| Ok(vec![mlx_rs::ops::tanh(x[0].divide(&x[1])?)?.multiply(&x[1])?]);

/// Attention of queries [B, Hq, L, D] over keys/values [B, Hkv, S, D].
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Mask) -> Result<Array, Exception> {
    attention_over_slots(q, k, v, k.shape().get(2).map_or(0, |&s| s as usize), scale, mask)
}

/// [`attention`] over the first `slots` slots of keys/values [B, Hkv, S, D]: a KV cache's
/// storage, of which only those are written. The host's loops read them where they lie; the
/// slice MLX would need to cut them is an op, and each op waits on MLX's thread (four per
/// decode step of the demo target, about a tenth of it).
pub fn attention_over_slots(
    q: &Array,
    k: &Array,
    v: &Array,
    slots: usize,
    scale: f32,
    mask: &Mask,
) -> Result<Array, Exception> {
    if let Some(out) = kernels::attention::attention_over_slots(q, k, v, slots, scale, mask)? {
        return Ok(out);
    }
    let (k, v) = (first_slots(k, slots)?, first_slots(v, slots)?);
    let (k, v) = (&k, &v);
    let mask = match mask {
        Mask::All => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    mlx_rs::fast::scaled_dot_product_attention(q, k, v, scale, mask, None)
}

/// Attention of row b of queries q [B, Hq, L, D] over row b's own keys and values, for rows
/// whose key counts differ (a drafter's per-row contexts): each row gets, bit for bit, what
/// [`attention`] gives it alone, in one call rather than one per row.
pub fn attention_rows(q: &Array, rows: &[RowKeys], scale: f32) -> Result<Array, Exception> {
    if let Some(out) = kernels::attention::attention_rows(q, rows, scale)? {
        return Ok(out);
    }
    let take = |a: &Array, r: usize| a.take_axis(Array::from_slice(&[r as i32], &[1]), 0);
    let outs = rows
        .iter()
        .enumerate()
        .map(|(b, row)| {
            let keys = row.pieces.iter().map(|p| take(p.keys, p.row)).collect::<Result<Vec<_>, _>>()?;
            let values = row.pieces.iter().map(|p| take(p.values, p.row)).collect::<Result<Vec<_>, _>>()?;
            let (keys, values) = (mlx_rs::ops::concatenate(&keys, 2)?, mlx_rs::ops::concatenate(&values, 2)?);
            attention(&take(q, b)?, &keys, &values, scale, &row.mask)
        })
        .collect::<Result<Vec<_>, Exception>>()?;
    mlx_rs::ops::concatenate(&outs, 0)
}

/// The first largest value's index in each row of `x` [.., V], as MLX's argmax over the last
/// axis gives it. Read on the host when MLX runs on the CPU, where its arrays live in host
/// memory: the op, its conversion and their round trip to MLX's stream thread cost several
/// times the scan over a small vocabulary. MLX's op elsewhere.
pub fn argmax_rows(x: &Array) -> Result<Vec<u32>, Exception> {
    if let Some(best) = kernels::argmax::argmax_rows(x)? {
        return Ok(best);
    }
    let best = mlx_argmax(x)?;
    crate::sync::eval([&best])?;
    Ok(best.as_slice::<u32>().to_vec())
}

/// [`argmax_rows`] as an array of uint32 (x's shape less its last axis): built from the host's
/// scan where MLX runs on the CPU, MLX's argmax left lazy elsewhere, so that a chain of steps
/// can feed each step's tokens to the next and wait once for them all.
pub fn argmax_tokens(x: &Array) -> Result<Array, Exception> {
    if let Some(best) = kernels::argmax::argmax_rows(x)? {
        return Ok(Array::from_slice(&best, &x.shape()[..x.ndim().saturating_sub(1)]));
    }
    mlx_argmax(x)
}

/// MLX's argmax over the last axis, as uint32, left lazy.
fn mlx_argmax(x: &Array) -> Result<Array, Exception> {
    mlx_rs::ops::indexing::argmax_axis(x, -1, None)?.as_dtype(Dtype::Uint32)
}

#[cfg(test)]
mod compiled_tests {
    use mlx_rs::random;

    use super::*;
    use crate::sync::graph;

    fn differing(a: &Array, b: &Array) -> u32 {
        a.ne(b).unwrap().sum(None).unwrap().item_cast::<u32>()
    }

    /// Compiled, RMSNorm gives what MLX's `fast::rms_norm` gives on the CPU, bit for bit.
    #[test]
    fn compiled_rms_norm_is_mlxs() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            for shape in [&[1, 1, 256][..], &[2, 7, 64], &[1, 3, 4, 32]] {
                let x = random::normal::<f32>(shape, None, None, None).unwrap().as_dtype(dtype).unwrap();
                let width = *shape.last().unwrap();
                let w = random::normal::<f32>(&[width], None, None, None).unwrap().as_dtype(dtype).unwrap();
                let ours = compiled_rms_norm(&x, Some(&w), 1e-6).unwrap();
                let mlx = mlx_rs::fast::rms_norm(&x, Some(&w), 1e-6).unwrap();
                assert_eq!((ours.dtype(), ours.shape()), (mlx.dtype(), mlx.shape()));
                assert_eq!(differing(&ours, &mlx), 0, "{dtype:?} {shape:?} with a weight");
                let ours = compiled_rms_norm(&x, None, 1e-6).unwrap();
                let mlx = mlx_rs::fast::rms_norm(&x, None, 1e-6).unwrap();
                assert_eq!(differing(&ours, &mlx), 0, "{dtype:?} {shape:?} without a weight");
            }
        }
    }

    /// The chains are fused: MLX's graph holds a compiled op, and fewer ops than one by one.
    #[test]
    fn chains_are_compiled() {
        let x = random::normal::<f32>(&[2, 3, 64], None, None, None).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let w = random::normal::<f32>(&[64], None, None, None).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let fused_norm = graph(&compiled_rms_norm(&x, Some(&w), 1e-6).unwrap());
        let composed = graph(&mlx_rs::fast::rms_norm(&x, Some(&w), 1e-6).unwrap());
        assert!(fused_norm.contains("Compiled") && !composed.contains("Compiled"), "{fused_norm}");
        assert!(fused_norm.lines().count() < composed.lines().count(), "{fused_norm}\n{composed}");
        let fused_geglu = graph(&fused(GEGLU, &[x.clone(), x.clone()]).unwrap());
        assert!(fused_geglu.contains("Compiled"), "{fused_geglu}");
    }

    /// Compiled, GeGLU and the softcap give what their ops give one by one, bit for bit.
    #[test]
    fn compiled_activations_are_their_ops() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let gate = random::normal::<f32>(&[3, 5, 96], None, None, None).unwrap().as_dtype(dtype).unwrap();
            let up = random::normal::<f32>(&[3, 5, 96], None, None, None).unwrap().as_dtype(dtype).unwrap();
            let fused_geglu = fused(GEGLU, &[gate.clone(), up.clone()]);
            assert_eq!(differing(&fused_geglu.unwrap(), &gelu_approx(&gate).unwrap().multiply(&up).unwrap()), 0);
            let logits = gate.multiply(scalar(40.0, dtype).unwrap()).unwrap();
            let c = scalar(30.0, dtype).unwrap();
            let one_by_one = mlx_rs::ops::tanh(logits.divide(&c).unwrap()).unwrap().multiply(&c).unwrap();
            assert_eq!(differing(&fused(SOFTCAP, &[logits, c]).unwrap(), &one_by_one), 0, "{dtype:?}");
        }
    }
}

#[cfg(test)]
mod elementwise_tests {
    use mlx_rs::random;

    use super::*;

    /// Largest |a − b| relative to the largest |b|.
    fn relative_difference(a: &Array, b: &Array) -> f32 {
        let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>();
        diff / b.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    /// Float32 takes vector code for MLX's `powf` and `tanhf` (see `kernels::tanh`): MLX's result
    /// within a few units in the last place.
    #[test]
    fn float32_is_mlxs_within_rounding() {
        for (seed, spread) in [0.3f32, 2.0, 9.0].into_iter().enumerate() {
            let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
            let normal = |k| random::normal::<f32>(&[7, 300], None, None, &key(k)).unwrap();
            let gate = normal(1).multiply(Array::from_f32(spread)).unwrap();
            let up = normal(2);
            let ours = geglu(&gate, &up).unwrap();
            let d = relative_difference(&ours, &gelu_approx(&gate).unwrap().multiply(&up).unwrap());
            assert!(d <= 1e-6, "geglu, spread {spread}: {d}");
            let logits = gate.multiply(Array::from_f32(10.0)).unwrap();
            let c = Array::from_f32(30.0);
            let mlx = mlx_rs::ops::tanh(logits.divide(&c).unwrap()).unwrap().multiply(&c).unwrap();
            let d = relative_difference(&softcap(&logits, 30.0).unwrap(), &mlx);
            assert!(d <= 1e-6, "softcap, spread {spread}: {d}");
        }
    }

    /// A decode step's rows, and a prefill's, which the kernels split between two threads.
    #[test]
    fn half_precision_equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            for (seed, (spread, shape)) in
                [(0.3f32, [7, 300]), (2.0, [33, 2049]), (9.0, [7, 300])].into_iter().enumerate()
            {
                let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
                let normal = |k| random::normal::<f32>(&shape, None, None, &key(k)).unwrap();
                let gate = normal(1).multiply(Array::from_f32(spread)).unwrap().as_dtype(dtype).unwrap();
                let up = normal(2).as_dtype(dtype).unwrap();
                let ours = geglu(&gate, &up).unwrap();
                let mlx = gelu_approx(&gate).unwrap().multiply(&up).unwrap();
                assert_eq!(ours.dtype(), mlx.dtype());
                let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                assert_eq!(differing, 0, "{dtype:?}, spread {spread}");
            }
        }
    }

    /// Every finite value of a half-precision `dtype`, as an array of that dtype.
    fn every_finite(dtype: Dtype) -> Array {
        let values: Vec<f32> = (0..=u16::MAX)
            .map(|b| match dtype {
                Dtype::Bfloat16 => f32::from_bits((b as u32) << 16),
                _ => half::f16::from_bits(b).to_f32(),
            })
            .filter(|v| v.is_finite())
            .collect();
        Array::from_slice(&values, &[values.len() as i32]).as_dtype(dtype).unwrap()
    }

    /// The softcap tables, checked at every finite value a logit can take.
    #[test]
    fn every_finite_half_precision_logit_softcaps_as_mlx_does() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let x = every_finite(dtype);
            for cap in [30.0f32, 15.0] {
                let ours = softcap(&x, cap).unwrap();
                let c = scalar(cap, dtype).unwrap();
                let mlx = mlx_rs::ops::tanh(x.divide(&c).unwrap()).unwrap().multiply(&c).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                assert_eq!(differing, 0, "{dtype:?}, cap {cap}");
            }
        }
    }

    /// `ours` equals `mlx` at every finite value a half-precision gate can take, times random
    /// ups (drawn with `seed`).
    fn equal_at_every_finite_gate(
        ours: impl Fn(&Array, &Array) -> Option<Array>,
        mlx: impl Fn(&Array, &Array) -> Array,
        seed: u64,
    ) {
        for gate in [every_finite(Dtype::Bfloat16), every_finite(Dtype::Float16)] {
            let n = gate.shape()[0];
            let up = random::normal::<f32>(&[n], None, None, &random::key(seed).unwrap())
                .unwrap()
                .as_dtype(gate.dtype())
                .unwrap();
            let ours = ours(&gate, &up).expect("covered");
            let differing = ours.ne(mlx(&gate, &up)).unwrap().sum(None).unwrap().item_cast::<u32>();
            assert_eq!(differing, 0, "{:?}", gate.dtype());
        }
    }

    /// The half-precision tables, checked at every finite value a gate can take.
    #[test]
    fn every_finite_half_precision_gate_equals_mlxs() {
        equal_at_every_finite_gate(
            |gate, up| Some(geglu(gate, up).unwrap()),
            |gate, up| gelu_approx(gate).unwrap().multiply(up).unwrap(),
            5,
        );
    }

    #[test]
    fn swiglu_equals_mlxs_at_every_finite_half_precision_gate() {
        equal_at_every_finite_gate(
            |gate, up| Some(swiglu(gate, up).unwrap()),
            |gate, up| gate.multiply(mlx_rs::ops::sigmoid(gate).unwrap()).unwrap().multiply(up).unwrap(),
            6,
        );
    }
}

#[cfg(test)]
mod attention_tests {
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    use super::*;
    use kernels::row_major;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap().as_dtype(dtype).unwrap()
    }

    fn largest_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.as_dtype(Dtype::Float32).unwrap(), b.as_dtype(Dtype::Float32).unwrap());
        a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    /// Keys and values given as the first slots of a larger cache (a view, read in place) give
    /// what their row-major copies give, bit for bit.
    #[test]
    fn reads_a_caches_first_slots_in_place() {
        let dtype = Dtype::Bfloat16;
        let q = normal(&[2, 4, 1, 64], 1, dtype);
        let (k, v) = (normal(&[2, 2, 48, 64], 2, dtype), normal(&[2, 2, 48, 64], 3, dtype));
        let (k, v) = (first_slots(&k, 37).unwrap(), first_slots(&v, 37).unwrap());
        let in_place = attention(&q, &k, &v, 0.125, &Mask::All).unwrap();
        let copied = attention(&q, &row_major(&k).unwrap(), &row_major(&v).unwrap(), 0.125, &Mask::All).unwrap();
        assert_eq!(largest_difference(&in_place, &copied), 0.0);
        let reference = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.125, None, None).unwrap();
        assert!(largest_difference(&in_place, &reference) < 0.05);
    }

    #[test]
    fn attends_over_a_storages_first_slots_as_over_their_copy() {
        for dtype in [Dtype::Bfloat16, Dtype::Float32] {
            let q = normal(&[2, 4, 3, 64], 1, dtype);
            let (k, v) = (normal(&[2, 2, 48, 64], 2, dtype), normal(&[2, 2, 48, 64], 3, dtype));
            let copy = |a: &Array| row_major(&a.try_index((.., .., ..37)).unwrap()).unwrap();
            for mask in [Mask::All, Mask::Causal] {
                let over_slots = attention_over_slots(&q, &k, &v, 37, 0.125, &mask).unwrap();
                let over_copy = attention(&q, &copy(&k), &copy(&v), 0.125, &mask).unwrap();
                assert_eq!(over_slots.shape(), &[2, 4, 3, 64]);
                assert_eq!(largest_difference(&over_slots, &over_copy), 0.0, "{dtype:?}");
            }
        }
    }

    #[test]
    fn equals_mlxs_attention_within_a_rounding_step_and_ignores_how_many_queries_share_it() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
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
                // Outputs are near 1 in size: a rounding step is 2⁻⁸ (bfloat16) or 2⁻¹¹; float32
                // differs only in the order of its sums.
                let within = if dtype == Dtype::Float32 { 1e-5 } else { 2f32.powi(-7) };
                assert!(largest_difference(&ours, &mlx) <= within, "{dtype:?} {name}");
            }
            // The last query alone (a decode step) gives what it gives among six (a window).
            let window = attention(&q, &k, &v, 0.17, &Mask::Causal).unwrap();
            let last = q.try_index((.., .., 5..6)).unwrap();
            let alone = attention(&last, &k, &v, 0.17, &Mask::Causal).unwrap();
            assert_eq!(largest_difference(&alone, &window.try_index((.., .., 5..6)).unwrap()), 0.0, "{dtype:?}");
        }
    }

    /// Each query of a verify window gives what it gives alone over the keys it sees, whether
    /// either call splits its queries between two threads or not.
    #[test]
    fn a_windows_queries_equal_each_query_alone_across_the_threads_split() {
        let dtype = Dtype::Bfloat16;
        for (s, d) in [(20, 64), (300, 64), (300, 128)] {
            let q = normal(&[1, 8, 5, d], 7, dtype);
            let (k, v) = (normal(&[1, 2, s, d], 8, dtype), normal(&[1, 2, s, d], 9, dtype));
            let window = attention(&q, &k, &v, 0.125, &Mask::Causal).unwrap();
            for i in 0..5 {
                let seen = s - 4 + i;
                let keys = |a: &Array| a.try_index((.., .., ..seen)).unwrap();
                let query = q.try_index((.., .., i..i + 1)).unwrap();
                let alone = attention(&query, &keys(&k), &keys(&v), 0.125, &Mask::All).unwrap();
                let row = window.try_index((.., .., i..i + 1)).unwrap();
                assert_eq!(largest_difference(&alone, &row), 0.0, "{s} keys of {d}, query {i}");
            }
        }
    }

    /// A prefill's queries over a sliding window (each reads a band of keys, many queries
    /// sharing a call) give, bit for bit, what each gives alone over just its band: a decode
    /// step over a full window. Likewise under a causal mask.
    #[test]
    fn a_prefills_queries_equal_each_query_over_just_the_keys_it_reads() {
        let (l, window, d) = (70, 16, 64);
        for dtype in [Dtype::Bfloat16, Dtype::Float32] {
            let q = normal(&[1, 4, l, d], 11, dtype);
            let (k, v) = (normal(&[1, 2, l, d], 12, dtype), normal(&[1, 2, l, d], 13, dtype));
            let band = |i: i32, j: i32| j <= i && i - j < window;
            let mask = Array::from_iter((0..l * l).map(|x| band(x / l, x % l)), &[1, 1, l, l]);
            // The band's first key for query i: the window's, or the first.
            for (name, mask, band_start) in [("band", Mask::Array(mask), window), ("causal", Mask::Causal, l)] {
                let first = |i: i32| (i - band_start + 1).max(0);
                let prefill = attention(&q, &k, &v, 0.125, &mask).unwrap();
                for i in [0, 1, 15, 16, 17, 40, l - 1] {
                    let keys = |a: &Array| a.try_index((.., .., first(i)..i + 1)).unwrap();
                    let query = q.try_index((.., .., i..i + 1)).unwrap();
                    let alone = attention(&query, &keys(&k), &keys(&v), 0.125, &Mask::All).unwrap();
                    let row = prefill.try_index((.., .., i..i + 1)).unwrap();
                    assert_eq!(largest_difference(&alone, &row), 0.0, "{dtype:?} {name}, query {i}");
                }
            }
        }
    }

    /// Rows of different key counts in one call, each key set in two pieces, give what each row
    /// gives alone over its keys in one piece.
    #[test]
    fn rows_of_different_lengths_equal_each_row_alone_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            let q = normal(&[3, 4, 5, 32], 4, dtype);
            let (block_k, block_v) = (normal(&[3, 2, 5, 32], 5, dtype), normal(&[3, 2, 5, 32], 6, dtype));
            let contexts: Vec<(Array, Array)> = [7, 19, 12]
                .iter()
                .enumerate()
                .map(|(r, &n)| {
                    (normal(&[1, 2, n, 32], 10 + r as u64, dtype), normal(&[1, 2, n, 32], 20 + r as u64, dtype))
                })
                .collect();
            let mask = |r: usize, n: i32| match r {
                0 => Mask::All,
                1 => Mask::Causal,
                _ => Mask::Array(Array::from_iter((0..5 * (n + 5)).map(|i| (i * 7) % 5 != 0), &[1, 1, 5, n + 5])),
            };
            let rows: Vec<RowKeys> = contexts
                .iter()
                .enumerate()
                .map(|(r, (k, v))| RowKeys {
                    pieces: vec![
                        KeyPiece { keys: k, values: v, row: 0 },
                        KeyPiece { keys: &block_k, values: &block_v, row: r },
                    ],
                    mask: mask(r, k.shape()[2]),
                })
                .collect();
            let together = attention_rows(&q, &rows, 0.17).unwrap();
            for (r, (k, v)) in contexts.iter().enumerate() {
                let take = |a: &Array| a.try_index(r as i32..r as i32 + 1).unwrap();
                let keys = mlx_rs::ops::concatenate(&[k, &take(&block_k)], 2).unwrap();
                let values = mlx_rs::ops::concatenate(&[v, &take(&block_v)], 2).unwrap();
                let alone = attention(&take(&q), &keys, &values, 0.17, &mask(r, k.shape()[2])).unwrap();
                assert_eq!(largest_difference(&take(&together), &alone), 0.0, "{dtype:?}, row {r}");
            }
        }
    }
}
