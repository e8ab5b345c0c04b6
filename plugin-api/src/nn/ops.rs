//! Small functional pieces, each as mlx-lm computes it.

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

/// RMSNorm with a weight (multiplied as is, not 1 + w) or without one.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(y) = cpu_rms_norm(x, weight, eps)? {
            return Ok(y);
        }
    }
    mlx_rs::fast::rms_norm(x, weight, eps)
}

/// RMSNorm on the CPU as MLX computes it there (its fallback in mlx/fast.cpp, seven ops): in
/// float32, the squares summed in order, times 1/n, plus eps, 1/√, times x; rounded to x's
/// dtype; times the weight, rounded again. Done here in one pass because each MLX op costs
/// microseconds of dispatch on the CPU and a small model meets eight norms per layer; the
/// result is MLX's bit for bit (tested). `None` for what it does not cover.
fn cpu_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Option<Array>, Exception> {
    use super::kernels::{round_to, rounded, row_major, with_floats};
    let dtype = x.dtype();
    let n = x.shape().last().copied().unwrap_or(0) as usize;
    let weight_fits = weight.is_none_or(|w| w.dtype() == dtype && w.shape() == [n as i32]);
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) || n == 0 || !weight_fits {
        return Ok(None);
    }
    let weight = weight.map(|w| row_major(w).and_then(|w| with_floats(&w, <[f32]>::to_vec))).transpose()?;
    let x = row_major(x)?;
    let round = |v| round_to(dtype, v);
    let inverse_n = (1.0 / n as f64) as f32;
    let y = with_floats(&x, |xs| {
        let mut y = Vec::with_capacity(xs.len());
        for row in xs.chunks(n) {
            let mut sum = 0f32;
            for &v in row {
                sum += v * v;
            }
            let scale = 1.0 / (sum * inverse_n + eps).sqrt();
            match &weight {
                Some(w) => y.extend(row.iter().zip(w).map(|(&v, &w)| round(round(v * scale) * w))),
                None => y.extend(row.iter().map(|&v| round(v * scale))),
            }
        }
        rounded(&y, x.shape(), dtype)
    })?;
    Ok(Some(y))
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
    if super::wide::on_cpu() {
        if let Some(y) = cpu_geglu(gate, up)? {
            return Ok(y);
        }
    }
    gelu_approx(gate)?.multiply(up)
}

/// [`geglu`]'s nine MLX ops in one pass, each step rounded to the dtype as MLX rounds it, with
/// the C library's `powf` and `tanhf` that MLX's CPU ops call: MLX's result bit for bit
/// (tested), without nine dispatches of microseconds each. `None` for what it does not cover.
fn cpu_geglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    use super::kernels::{rounded, row_major, with_floats};
    let dtype = gate.dtype();
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || up.dtype() != dtype
        || up.shape() != gate.shape()
    {
        return Ok(None);
    }
    let (gate, up) = (row_major(gate)?, row_major(up)?);
    let ups = with_floats(&up, <[f32]>::to_vec)?;
    let table = half_gelu_table(dtype);
    let y = with_floats(&gate, |xs| {
        let index = half_index(dtype);
        let y: Vec<f32> = xs
            .iter()
            .zip(&ups)
            .map(|(&x, &u)| {
                let g = match table {
                    Some(table) => table[index(x)],
                    None => gelu(dtype, x),
                };
                super::kernels::round_to(dtype, g * u)
            })
            .collect();
        rounded(&y, gate.shape(), dtype)
    })?;
    Ok(Some(y))
}

/// gelu_tanh(x) as MLX's ops compute it in `dtype`, every step rounded.
fn gelu(dtype: Dtype, x: f32) -> f32 {
    let round = |v| super::kernels::round_to(dtype, v);
    let (c, k) = (round(0.044715), round((2.0 / std::f32::consts::PI).sqrt()));
    let inner = round(round(x + round(round(x.powf(3.0)) * c)) * k);
    let g = round(round(inner.tanh()) + 1.0);
    round(round(x * 0.5) * g)
}

/// `f` at each of the 65,536 values of a half-precision `dtype`, indexed by bit pattern: an
/// elementwise op whose input is a half-precision value depends on that value alone, so a table
/// computed once by the op's own steps gives the same bits at the cost of a lookup. One table
/// per op (`what` and its `param`) and dtype, kept for the life of the process; `None` for
/// other dtypes.
fn half_table(dtype: Dtype, what: &'static str, param: f32, f: impl Fn(f32) -> f32) -> Option<&'static [f32]> {
    type Key = (&'static str, bool, u32);
    static TABLES: std::sync::Mutex<Vec<(Key, &'static [f32])>> = std::sync::Mutex::new(Vec::new());
    let widen: fn(u16) -> f32 = match dtype {
        Dtype::Bfloat16 => |b| f32::from_bits((b as u32) << 16),
        Dtype::Float16 => |b| half::f16::from_bits(b).to_f32(),
        _ => return None,
    };
    let key = (what, dtype == Dtype::Bfloat16, param.to_bits());
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, table)) = tables.iter().find(|(k, _)| *k == key) {
        return Some(table);
    }
    let table: &'static [f32] = Box::leak((0..=u16::MAX).map(|b| f(widen(b))).collect());
    tables.push((key, table));
    Some(table)
}

/// gelu's table: a lookup instead of a `powf` and a `tanhf` per element (15% of a batched
/// verify round of the demo target).
fn half_gelu_table(dtype: Dtype) -> Option<&'static [f32]> {
    half_table(dtype, "gelu", 0.0, |x| gelu(dtype, x))
}

/// The table index of a half-precision value held as an f32 (exactly, having been widened).
fn half_index(dtype: Dtype) -> fn(f32) -> usize {
    match dtype {
        Dtype::Bfloat16 => |x| (x.to_bits() >> 16) as usize,
        _ => |x| half::f16::from_f32(x).to_bits() as usize,
    }
}

/// `tanh(x / cap) · cap`.
pub fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(table) = half_softcap_table(x.dtype(), cap) {
            use super::kernels::{rounded, row_major, with_floats};
            let x = row_major(x)?;
            let index = half_index(x.dtype());
            return with_floats(&x, |xs| {
                let y: Vec<f32> = xs.iter().map(|&v| table[index(v)]).collect();
                rounded(&y, x.shape(), x.dtype())
            });
        }
    }
    let c = scalar(cap, x.dtype())?;
    mlx_rs::ops::tanh(x.divide(&c)?)?.multiply(&c)
}

/// The softcap's table, by MLX's three steps (divide, the C library's `tanhf`, multiply), each
/// rounded to the dtype: a lookup per logit instead of three MLX ops over the vocabulary.
fn half_softcap_table(dtype: Dtype, cap: f32) -> Option<&'static [f32]> {
    let round = |v| super::kernels::round_to(dtype, v);
    let c = round(cap);
    half_table(dtype, "softcap", cap, |x| round(round(round(x / c).tanh()) * c))
}

/// A scalar in `dtype`, so that it does not promote the array it meets (Python floats are
/// weakly typed in MLX; a Rust f32 array is not).
///
/// Made as data, rounded to nearest even as MLX's conversion rounds, rather than by converting
/// a float32 array: every MLX op costs microseconds of dispatch on the CPU, and small models
/// meet scalars several times per layer.
pub fn scalar(value: f32, dtype: Dtype) -> Result<Array, Exception> {
    match dtype {
        Dtype::Float32 => Ok(Array::from_f32(value)),
        Dtype::Bfloat16 => Ok(Array::from_slice(&[half::bf16::from_f32(value)], &[])),
        Dtype::Float16 => Ok(Array::from_slice(&[half::f16::from_f32(value)], &[])),
        _ => Array::from_f32(value).as_dtype(dtype),
    }
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
///
/// The products read the arrays' data per head directly rather than slicing them with MLX ops:
/// a decode step of a small model is bound by the count of MLX ops, each costing microseconds
/// of dispatch on the CPU.
fn half_attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Mask) -> Result<Option<Array>, Exception> {
    use super::kernels::dot::{self, Weight};
    use super::kernels::{bits16, rounded, row_major, with_floats};
    let dtype = q.dtype();
    let (qs, ks) = (q.shape().to_vec(), k.shape().to_vec());
    let (b, hq, l, d, hkv, s) = (qs[0], qs[1], qs[2], qs[3], ks[1], ks[2]);
    if hkv == 0 || hq % hkv != 0 || k.dtype() != dtype || v.dtype() != dtype || v.shape() != ks {
        return Ok(None);
    }
    fn weight(dtype: Dtype, bits: &[u16]) -> Weight<'_> {
        if dtype == Dtype::Bfloat16 {
            Weight::Bf16(bits)
        } else {
            Weight::F16(bits)
        }
    }
    // Each (row, KV head) block: the queries of the heads sharing that KV head, [rep·l, d].
    let (rows, blocks) = (((hq / hkv) * l) as usize, (b * hkv) as usize);
    let (d, s) = (d as usize, s as usize);

    let q = row_major(&q.multiply(scalar(scale, dtype)?)?)?;
    let (k, v) = (row_major(k)?, row_major(v)?);
    let (Some(keys), Some(values)) = (bits16(&k), bits16(&v)) else { return Ok(None) };
    let scores = with_floats(&q, |qs| {
        let mut scores = vec![0f32; blocks * rows * s];
        for (i, y) in scores.chunks_mut(rows * s).enumerate() {
            let x = &qs[i * rows * d..(i + 1) * rows * d];
            dot::product(x, rows, d, weight(dtype, &keys[i * s * d..(i + 1) * s * d]), 0..s, s, y);
        }
        rounded(&scores, &[b, hq, l, s as i32], dtype)
    })?;

    let lowest = scalar(f32::from_bits(if dtype == Dtype::Bfloat16 { 0xFF7F_0000 } else { 0xC77F_E000 }), dtype)?;
    let scores = match mask {
        Mask::All => scores,
        Mask::Causal => {
            let offset = (s as i32 - l).max(0);
            let rows = Array::from_iter(offset..offset + l, &[l, 1]);
            let cols = Array::from_iter(0..s as i32, &[1, s as i32]);
            mlx_rs::ops::select(&rows.ge(&cols)?, &scores, &lowest)?
        }
        Mask::Array(m) if m.dtype() == Dtype::Bool => mlx_rs::ops::select(m, &scores, &lowest)?,
        Mask::Array(m) => scores.add(m)?,
    };
    let probs = row_major(&mlx_rs::ops::softmax_axis(&scores, -1, true)?)?;
    let out = with_floats(&probs, |ps| {
        let mut out = vec![0f32; blocks * rows * d];
        let mut values_t = vec![0u16; d * s];
        for (i, y) in out.chunks_mut(rows * d).enumerate() {
            // This head's values as the weight's rows: [d, s].
            for (t, value) in values[i * s * d..(i + 1) * s * d].chunks(d).enumerate() {
                for (j, &bits) in value.iter().enumerate() {
                    values_t[j * s + t] = bits;
                }
            }
            dot::product(&ps[i * rows * s..(i + 1) * rows * s], rows, s, weight(dtype, &values_t), 0..d, d, y);
        }
        rounded(&out, &[b, hq, l, d as i32], dtype)
    })?;
    Ok(Some(out))
}

#[cfg(test)]
mod rms_norm_tests {
    use mlx_rs::random;

    use super::*;

    #[test]
    fn equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            for (seed, (rows, n)) in [(1, 256), (5, 100), (3, 2560), (2, 17), (7, 64)].into_iter().enumerate() {
                let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
                let spread = Array::from_f32([0.05, 1.0, 40.0][seed % 3]);
                let x = random::normal::<f32>(&[rows, n], None, None, &key(1)).unwrap().multiply(&spread).unwrap();
                let x = x.as_dtype(dtype).unwrap();
                let w = random::normal::<f32>(&[n], None, None, &key(2)).unwrap().as_dtype(dtype).unwrap();
                for weight in [Some(&w), None] {
                    let ours = cpu_rms_norm(&x, weight, 1e-6).unwrap().expect("covered");
                    let mlx = mlx_rs::fast::rms_norm(&x, weight, 1e-6).unwrap();
                    assert_eq!(ours.dtype(), mlx.dtype());
                    let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                    assert_eq!(differing, 0, "{dtype:?}, [{rows}, {n}], weight {}", weight.is_some());
                }
            }
        }
    }
}

#[cfg(test)]
mod elementwise_tests {
    use mlx_rs::random;

    use super::*;

    #[test]
    fn equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            for (seed, spread) in [0.3f32, 2.0, 9.0].into_iter().enumerate() {
                let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
                let normal = |k| random::normal::<f32>(&[7, 300], None, None, &key(k)).unwrap();
                let gate = normal(1).multiply(Array::from_f32(spread)).unwrap().as_dtype(dtype).unwrap();
                let up = normal(2).as_dtype(dtype).unwrap();
                let ours = cpu_geglu(&gate, &up).unwrap().expect("covered");
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

    /// The half-precision tables, checked at every finite value a gate can take.
    #[test]
    fn every_finite_half_precision_gate_equals_mlxs() {
        for gate in [every_finite(Dtype::Bfloat16), every_finite(Dtype::Float16)] {
            let n = gate.shape()[0];
            let up = random::normal::<f32>(&[n], None, None, &random::key(5).unwrap())
                .unwrap()
                .as_dtype(gate.dtype())
                .unwrap();
            let ours = cpu_geglu(&gate, &up).unwrap().expect("covered");
            let mlx = gelu_approx(&gate).unwrap().multiply(&up).unwrap();
            let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
            assert_eq!(differing, 0, "{:?}", gate.dtype());
        }
    }
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
