//! Products on the CPU through hand-written loops ([`dot`]), each weight read once in its stored
//! format, with MLX's result up to summation order: float32 accumulation, the output rounded
//! once to the activation dtype. They take one to sixteen rows (decode steps, verify windows),
//! and half-precision weights or activations at any row count. Anything else (more float32 rows,
//! other dtypes, another device) is left to MLX. On a CPU with AMX, plain bfloat16 weights and
//! quantized ones with bfloat16 scales are repacked for its tile unit and multiplied there
//! ([`amx_bf16`], [`amx_quantized`], [`tiled_product`]); without the unit, the same tiles serve
//! AVX-512 BF16 loops (both formats) or AVX2 ones (quantized weights).
//!
//! Quantized weights of half-precision activations are summed in float32 here, as MLX's Metal
//! and CUDA kernels sum them. MLX's CPU kernel instead rounds to the activation dtype after
//! every multiply and add, one weight at a time; reproducing that costs about 27 vector
//! operations per weight, which bounds a product far below the machine's read rate, and its
//! sums are less accurate than float32's.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{bf16_into, bits16, from_bits16, rounded, row_major, slice, with_floats, with_round, Round};
use crate::dot::{self, Params, Weight, MAX_ROWS};
use crate::{amx_bf16, amx_quantized, helper, wide};

/// How a weight was quantized (MLX's affine scheme): values per scale and bias, bits per value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

/// Multiply-adds (rows × outputs × inputs) from which a product is split with the helper thread
/// ([`crate::helper`]): below it, handing half over costs more than it saves. On the demo
/// target a verify window's products gain from the split and a one-token step's neither gain
/// nor lose. The threshold is not sharp: a quarter of it or four times it does as well.
const SPLIT_WORK: usize = 1 << 17;

/// `x · wᵀ` through the hand-written loops, or `None` where they do not apply.
pub fn small_product(
    x: &Array,
    w: &Array,
    scales: Option<&Array>,
    biases: Option<&Array>,
    q: Option<Quantization>,
) -> Result<Option<Array>, Exception> {
    let shape = x.shape();
    let k = *shape.last().unwrap_or(&0) as usize;
    let rows = wide::rows(x) as usize;
    // Half-precision weights or activations take these loops at every row count, so that a
    // row's result never depends on how many rows share its product: speculative decoding
    // verifies a window of rows where plain decoding computes one, and its output must equal
    // plain decoding's token for token even where a half-precision rounding would tip an argmax.
    // Float32 rows of quantized or float32 weights take them up to MAX_ROWS.
    let half = |d: Dtype| matches!(d, Dtype::Bfloat16 | Dtype::Float16);
    let any_rows = half(w.dtype()) || (q.is_some() && half(x.dtype()));
    if rows == 0 || (rows > MAX_ROWS && !any_rows) || !wide::on_cpu() {
        return Ok(None);
    }
    if !matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) {
        return Ok(None);
    }
    let n = w.shape()[0] as usize;
    // Weights are stored row-major (as loaded); one that is not is left to MLX.
    let weight = match (q, scales, biases) {
        (Some(q), Some(s), Some(b)) => {
            let (Some(packed), Some(scales), Some(biases)) = (slice::<u32>(w), params(s), params(b)) else {
                return Ok(None);
            };
            if !k.is_multiple_of(q.group_size as usize) || !matches!(q.bits, 4 | 8) {
                return Ok(None);
            }
            let (bits, group) = (q.bits as u32, q.group_size as usize);
            Weight::Quantized(dot::Quantized { packed, scales, biases, bits, group })
        }
        (None, None, None) => match w.dtype() {
            // Float32 weights of up to MAX_ROWS rows: with the helper thread taking half of each
            // product, these loops decode faster than MLX's op (OpenBLAS), which packs the whole
            // weight for every product (see `dot`). More rows (prefill) stay with OpenBLAS.
            Dtype::Float32 => match slice::<f32>(w) {
                Some(w) => Weight::F32(w),
                None => return Ok(None),
            },
            Dtype::Bfloat16 => match bits16(w) {
                Some(w) => Weight::Bf16(w),
                None => return Ok(None),
            },
            Dtype::Float16 => match bits16(w) {
                Some(w) => Weight::F16(w),
                None => return Ok(None),
            },
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let split = (rows * n * k >= SPLIT_WORK && n >= 2).then_some(n / 2);
    let x_dtype = x.dtype();
    outputs(x, n, split, |xs, range, y| dot::product(xs, x_dtype, rows, k, weight, range, n, y)).map(Some)
}

/// A weight held as AMX tiles: bfloat16 ([`amx_bf16`]) or MLX-quantized ([`amx_quantized`]).
#[derive(Clone, Copy)]
pub enum Tiled<'a> {
    Bf16(&'a amx_bf16::Tiles),
    Quantized(&'a amx_quantized::QuantTiles),
}

impl Tiled<'_> {
    fn shape(&self) -> (usize, usize) {
        match self {
            Tiled::Bf16(t) => (t.n, t.k),
            Tiled::Quantized(t) => (t.n, t.k),
        }
    }

    fn available(&self) -> bool {
        match self {
            Tiled::Bf16(_) => amx_bf16::held(),
            Tiled::Quantized(_) => amx_quantized::held(),
        }
    }
}

/// `x · wᵀ` for a w held as tiles, at any row count; `None` where the tiles do not apply (x of
/// another width or not floating-point, MLX on another device, a CPU that holds no tiles). With
/// the unit, two bfloat16 rows or more are multiplied on it, a single one through AVX-512 FMAs
/// that sum as the unit does, and rows of another dtype through the FMAs. Without it, bfloat16
/// rows take `tiles_avx512` at every count (others the FMAs), and on a CPU without AVX-512
/// quantized tiles take `tiles_avx2` for every row.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn tiled_product(x: &Array, tiles: Tiled) -> Result<Option<Array>, Exception> {
    let rows = wide::rows(x) as usize;
    let (n, k) = tiles.shape();
    let applies = matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
        && x.shape().last().map(|&k| k as usize) == Some(k)
        && rows > 0
        && wide::on_cpu()
        && tiles.available();
    if !applies {
        return Ok(None);
    }
    #[cfg(target_arch = "x86_64")]
    {
        let bf16 = x.dtype() == Dtype::Bfloat16;
        // Each thread takes whole groups of outputs, where the weight is large enough for
        // halving it to pay for the handover.
        let at = (n / 2).next_multiple_of(amx_bf16::GROUP);
        let split = (n * k >= SPLIT_WORK && at < n).then_some(at);
        // Tiles on a CPU without the unit take the AVX-512 loops at every bfloat16 row count
        // (`tiles_avx512`), or without AVX-512 the AVX2 loops at every row count
        // (`tiles_avx2`).
        let unit = amx_bf16::available();
        let avx2 = !unit && crate::tiles_avx2::available();
        if bf16 && !avx2 && (rows >= 2 || !unit) {
            return bf16_rows(x, tiles, rows, split).map(Some);
        }
        // SAFETY: the tiles' loops have what they need (`available`: the unit, granted, or
        // AVX-512 F and BW, or AVX2, FMA and F16C for `tiles_avx2`, which held only quantized
        // tiles); the tiles hold an [n, k] weight.
        outputs(x, n, split, |xs, range, y| unsafe {
            match tiles {
                Tiled::Quantized(t) if avx2 => crate::tiles_avx2::rows(xs, rows, t, range, y),
                Tiled::Bf16(t) => amx_bf16::fma_rows(xs, rows, t, range, y),
                Tiled::Quantized(t) => amx_quantized::fma_rows(xs, rows, t, range, y),
            }
        })
        .map(Some)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("the tile unit is x86-64's")
}

/// Two bfloat16 rows or more on the unit (any number on `tiles_avx512` where quantized tiles are
/// held without it), read and written as bfloat16 bits: each thread rounds
/// the outputs it summed into the result's own buffer. Through [`outputs`], x would be widened
/// to float32 first and the helper's float32 half read back for rounding, and on a verify
/// window of a quantized model moving those between the cores costs more than the split's
/// handover: the helper's part would spend much of its time reading x.
#[cfg(target_arch = "x86_64")]
fn bf16_rows(x: &Array, tiles: Tiled, rows: usize, split: Option<usize>) -> Result<Array, Exception> {
    let x = row_major(x)?;
    let xb = bits16(&x).ok_or_else(|| Exception::custom("bfloat16 data"))?;
    let (n, k) = tiles.shape();
    let mut bits = vec![0u16; rows * n];
    let out = amx_bf16::Bf16Rows::new(&mut bits, n);
    // Quantized rows' sums per group, once for both threads.
    let sums = match tiles {
        // SAFETY: the CPU has AVX-512 F (`Tiled::available`: the unit, or `tiles_avx512`).
        Tiled::Quantized(t) => unsafe { amx_quantized::group_sums_of_bits(xb, t.group) },
        Tiled::Bf16(_) => Vec::new(),
    };
    let (xb, stride) = amx_bf16::padded(xb, k);
    let xb = &xb[..];
    let unit = amx_bf16::available();
    // SAFETY: the tiles' loops have what they need (`Tiled::available`); the tiles hold an
    // [n, k] weight; each thread writes only its own outputs of `bits`, which outlives both.
    let run = |range: std::ops::Range<usize>| unsafe {
        match tiles {
            Tiled::Bf16(t) if unit => amx_bf16::rows_on_unit(xb, stride, rows, t, range, out),
            Tiled::Bf16(t) => crate::tiles_avx512::bf16_rows(xb, stride, rows, t, range, out),
            Tiled::Quantized(t) if unit => amx_quantized::rows_on_unit(xb, rows, &sums, t, range, out),
            Tiled::Quantized(t) => crate::tiles_avx512::rows(xb, rows, &sums, t, range, out),
        }
    };
    match split {
        Some(at) => helper::join(|| run(0..at), || run(at..n)),
        None => run(0..n),
    }
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("x has a last axis") = n as i32;
    Ok(from_bits16(&bits, &shape, Dtype::Bfloat16))
}

/// Rows `ids` (any shape, int32 or uint32) of a quantized table [vocab, k], dequantized as
/// MLX's `dequantize` does: w = scale · q + bias in the scales' dtype, the product and the sum
/// each rounded to it (tested bit for bit). `None` where the host cannot read the operands, or
/// an id is out of range (MLX's own take then decides what happens).
///
/// A token's embedding otherwise takes four MLX ops (three gathers and the dequantization),
/// whose dispatch, each waiting on MLX's thread, costs more than the rest of the lookup.
pub fn dequantized_rows(
    ids: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    q: Quantization,
) -> Result<Option<Array>, Exception> {
    if !wide::on_cpu() || !matches!(q.bits, 4 | 8) {
        return Ok(None);
    }
    let ids = row_major(ids)?;
    let mut shape = ids.shape().to_vec();
    let Some(ids) = token_ids(&ids) else { return Ok(None) };
    let (Some(packed), Some(s), Some(b)) = (slice::<u32>(w), params(scales), params(biases)) else {
        return Ok(None);
    };
    let (bits, vocab, group) = (q.bits as u32, w.shape()[0] as i64, q.group_size as usize);
    let k = w.shape()[1] as usize * (32 / q.bits) as usize;
    if ids.iter().any(|&i| i < 0 || i >= vocab) || !k.is_multiple_of(group) {
        return Ok(None);
    }
    let table = dot::Quantized { packed, scales: s, biases: b, bits, group };
    let dtype = scales.dtype();
    let mut out = Vec::with_capacity(ids.len() * k);
    with_round!(dtype, |r| {
        for &id in &ids {
            let row = id as usize;
            for i in 0..k {
                let g = row * (k / group) + i / group;
                out.push(dequantized(r, table.q(row, k, i), s.get(g), b.get(g)));
            }
        }
    });
    shape.push(k as i32);
    Ok(Some(rounded(&out, &shape, dtype)))
}

/// One weight dequantized as MLX's `dequantize` does: scale · q + bias in the scales' dtype
/// (`r`), the product and the sum each rounded to it.
#[inline]
pub(crate) fn dequantized(r: impl Round, q: u32, scale: f32, bias: f32) -> f32 {
    r.round(r.round(scale * q as f32) + bias)
}

/// Token ids of int32 or uint32 (evaluated, row-major) as i64, so that a negative int32 id is
/// seen as one; `None` for ids of another dtype.
pub(crate) fn token_ids(ids: &Array) -> Option<Vec<i64>> {
    match ids.dtype() {
        Dtype::Int32 => Some(ids.as_slice::<i32>().iter().map(|&i| i as i64).collect()),
        Dtype::Uint32 => Some(ids.as_slice::<u32>().iter().map(|&i| i as i64).collect()),
        _ => None,
    }
}

/// The `n` outputs of every row of `x` as an array of x's dtype: `run(x, outputs, y)` fills
/// columns `outputs` of y [rows, n], on one thread or, given a split point, on two.
///
/// Half-precision x is widened and y rounded here rather than by MLX ops: each MLX op costs
/// microseconds of dispatch on the CPU, several times what converting a few rows costs. The
/// rounding is MLX's (to nearest, ties to even).
fn outputs(
    x: &Array,
    n: usize,
    split: Option<usize>,
    run: impl Fn(&[f32], std::ops::Range<usize>, &mut [f32]) + Sync,
) -> Result<Array, Exception> {
    let x = row_major(x)?;
    with_floats(&x, |xs| {
        let rows = xs.len() / x.shape().last().map_or(1, |&k| k.max(1) as usize);
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("x has a last axis") = n as i32;
        with_sums(rows * n, split.is_some(), |y, upper| match split {
            None => {
                run(xs, 0..n, y);
                rounded(y, &shape, x.dtype())
            }
            Some(at) => {
                helper::join(|| run(xs, 0..at, y), || run(xs, at..n, upper));
                rounded_halves(y, upper, at, &shape, x.dtype())
            }
        })
    })
}

/// [`rounded`] of rows [.., n] whose columns up to `at` are in `low` and the rest in `high`.
/// Rounded to bfloat16 each half is read where it lies, rather than copied over first.
fn rounded_halves(low: &mut [f32], high: &[f32], at: usize, shape: &[i32], dtype: Dtype) -> Array {
    let n = shape.last().map_or(1, |&n| n as usize);
    if dtype == Dtype::Bfloat16 {
        let mut bits = vec![0u16; low.len()];
        for ((row, low), high) in bits.chunks_exact_mut(n).zip(low.chunks_exact(n)).zip(high.chunks_exact(n)) {
            bf16_into(&low[..at], &mut row[..at]);
            bf16_into(&high[at..], &mut row[at..]);
        }
        return from_bits16(&bits, shape, dtype);
    }
    for (low, high) in low.chunks_exact_mut(n).zip(high.chunks_exact(n)) {
        low[at..].copy_from_slice(&high[at..]);
    }
    rounded(low, shape, dtype)
}

/// Floats a thread's products keep for their sums between calls, up to this many per buffer
/// (32 MB: a 512-token prefill chunk's products up to 16384 outputs wide). Fresh buffers cost
/// each product their zeroing and, past the allocator's reuse, page faults, which a step's
/// dozens of products pay again and again: in a prefill of the 1.3B bench model, with a
/// megabyte kept, the kernel's zeroing of fresh pages took 8% of the time. Larger sums, rarer,
/// take fresh buffers.
const KEPT_SUMS: usize = 1 << 23;

thread_local! {
    static SUMS: std::cell::RefCell<[Vec<f32>; 2]> = const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
}

/// Calls `f` with a buffer of `len` floats for a product's sums, and a second one for the
/// helper thread's share when `two`; their contents are left from earlier products.
fn with_sums<R>(len: usize, two: bool, f: impl FnOnce(&mut [f32], &mut [f32]) -> R) -> R {
    let wanted = |two_buffers: bool| if two_buffers { len } else { 0 };
    SUMS.with(|sums| match sums.try_borrow_mut() {
        Ok(mut sums) if len <= KEPT_SUMS => {
            let [y, upper] = &mut *sums;
            for (buffer, wanted) in [(&mut *y, len), (&mut *upper, wanted(two))] {
                if buffer.len() < wanted {
                    buffer.resize(wanted, 0.0);
                }
            }
            f(&mut y[..len], &mut upper[..wanted(two)])
        }
        _ => f(&mut vec![0.0; len], &mut vec![0.0; wanted(two)]),
    })
}

fn params(a: &Array) -> Option<Params<'_>> {
    match a.dtype() {
        Dtype::Float32 => slice::<f32>(a).map(Params::F32),
        Dtype::Bfloat16 => bits16(a).map(Params::Bf16),
        Dtype::Float16 => bits16(a).map(Params::F16),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "x86_64")]
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_rs::random;

    use super::*;
    #[cfg(target_arch = "x86_64")]
    use crate::arrays::bf16_bits_avx512;
    use crate::arrays::{bf16_all, round_to, widened_bf16};

    #[test]
    fn bfloat16_rounding_is_the_half_crates() {
        let specials = [0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MAX, f32::MIN_POSITIVE];
        let patterns = (0..=u32::MAX).step_by(97).map(f32::from_bits).chain(specials);
        let values: Vec<f32> = patterns.collect();
        // Whole slices as one element at a time, on a length that leaves a partial vector.
        let all = bf16_all(&values);
        for (&v, &b) in values.iter().zip(&all) {
            assert_eq!(b, half::bf16::from_f32(v).to_bits(), "{v:e} ({:#010x})", v.to_bits());
        }
        assert_eq!(values.len() % 8, 5);
        let widened = widened_bf16(&all);
        for (&w, &b) in widened.iter().zip(&all) {
            assert_eq!(w.to_bits(), half::bf16::from_bits(b).to_f32().to_bits());
        }
        // Sixteen at a time, as products on the unit round their rows.
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has!("avx512f") {
            #[target_feature(enable = "avx512f")]
            unsafe fn sixteen(values: &[f32]) -> [u16; 16] {
                let bits = bf16_bits_avx512(std::arch::x86_64::_mm512_loadu_ps(values.as_ptr()));
                std::mem::transmute::<std::arch::x86_64::__m256i, [u16; 16]>(bits)
            }
            for (values, expected) in values.chunks_exact(16).zip(all.chunks_exact(16)) {
                // SAFETY: the CPU has AVX-512 F (checked above).
                assert_eq!(unsafe { sixteen(values) }, expected, "{values:?}");
            }
        }
    }

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// Largest |a − b| relative to the largest |b|.
    fn relative_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.as_dtype(Dtype::Float32).unwrap(), b.as_dtype(Dtype::Float32).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>();
        diff / b.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    const ROWS: [i32; 7] = [1, 2, 3, 4, 5, 8, 16];

    #[test]
    fn dense_products_equal_mlxs_for_every_row_count() {
        for (dtype, k) in [(Dtype::Float32, 256), (Dtype::Bfloat16, 264), (Dtype::Float32, 100), (Dtype::Bfloat16, 36)]
        {
            let w = normal(&[72, k], 1).as_dtype(dtype).unwrap();
            for rows in ROWS {
                let x = normal(&[1, rows, k], 2 + rows as u64);
                let ours = match small_product(&x, &w, None, None, None).unwrap() {
                    Some(ours) => ours,
                    None if dtype == Dtype::Float32 => {
                        // The loops themselves, as the other formats use them.
                        let (n, kk) = (72, k as usize);
                        let xs = x.as_slice::<f32>();
                        let mut y = vec![0f32; rows as usize * n];
                        dot::product(
                            xs,
                            Dtype::Float32,
                            rows as usize,
                            kk,
                            Weight::F32(w.as_slice::<f32>()),
                            0..n,
                            n,
                            &mut y,
                        );
                        Array::from_slice(&y, &[1, rows, n as i32])
                    }
                    None => panic!("{dtype:?}: the loops apply"),
                };
                let mlx = x.matmul(w.as_dtype(Dtype::Float32).unwrap().t()).unwrap();
                let d = relative_difference(&ours, &mlx);
                assert!(d <= 1e-5, "{dtype:?}, k {k}, {rows} rows: {d}");
            }
        }
    }

    /// bfloat16 rows times bfloat16 weights (the AVX-512 BF16 loops where the CPU has them)
    /// give MLX's float32 product of the same values up to summation order.
    #[test]
    fn bfloat16_rows_equal_mlxs_float32_product_of_their_values() {
        for k in [264, 36, 1000] {
            let w = normal(&[72, k], 1).as_dtype(Dtype::Bfloat16).unwrap();
            for rows in ROWS {
                let x = normal(&[rows, k], 2 + rows as u64).as_dtype(Dtype::Bfloat16).unwrap();
                let widened = x.as_dtype(Dtype::Float32).unwrap();
                let mut y = vec![0f32; rows as usize * 72];
                let w_bits = bits16(&w).unwrap();
                dot::product(
                    widened.as_slice::<f32>(),
                    Dtype::Bfloat16,
                    rows as usize,
                    k as usize,
                    Weight::Bf16(w_bits),
                    0..72,
                    72,
                    &mut y,
                );
                let ours = Array::from_slice(&y, &[rows, 72]);
                let mlx = widened.matmul(w.as_dtype(Dtype::Float32).unwrap().t()).unwrap();
                let d = relative_difference(&ours, &mlx);
                assert!(d <= 1e-5, "k {k}, {rows} rows: {d}");
            }
        }
    }

    #[test]
    fn half_precision_activations_are_rounded_once_like_mlxs() {
        let w = normal(&[64, 128], 3).as_dtype(Dtype::Bfloat16).unwrap();
        let x = normal(&[4, 128], 4).as_dtype(Dtype::Bfloat16).unwrap();
        let ours = small_product(&x, &w, None, None, None).unwrap().unwrap();
        assert_eq!(ours.dtype(), Dtype::Bfloat16);
        let d = relative_difference(&ours, &x.matmul(w.t()).unwrap());
        assert!(d <= 2f32.powi(-8), "{d}");
    }

    /// MLX's quantized product of x's values in float32 (scales and biases widened exactly).
    fn mlx_in_float32(x: &Array, wq: &Array, scales: &Array, biases: &Array, q: Quantization) -> Array {
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32).unwrap();
        mlx_rs::ops::quantized_matmul(f32(x), wq, f32(scales), &f32(biases), true, q.group_size, q.bits).unwrap()
    }

    /// Largest |a − b| beyond what rounding b once to a's dtype may move it, relative to the
    /// largest |b|: zero when a is b rounded (half precision) or equal (float32).
    fn beyond_one_rounding(a: &Array, b: &Array) -> f32 {
        let half_ulp = match a.dtype() {
            Dtype::Bfloat16 => 2f32.powi(-8),
            Dtype::Float16 => 2f32.powi(-11),
            _ => 0.0,
        };
        let (a, b) = (a.as_dtype(Dtype::Float32).unwrap(), b.as_dtype(Dtype::Float32).unwrap());
        let largest = b.abs().unwrap().max(None).unwrap().item_exact::<f32>();
        a.as_slice::<f32>()
            .iter()
            .zip(b.as_slice::<f32>())
            .map(|(a, b)| ((a - b).abs() - half_ulp * b.abs()).max(0.0))
            .fold(0.0, f32::max)
            / largest
    }

    /// How far a product may lie from the float32 one relative to its largest value: summation
    /// order only, unless the activations are rounded to 8 bits (`HOST_QUANTIZED_ACTIVATIONS=int8`
    /// on AVX2), which moves each by up to 1/254 of its block's largest value.
    fn tolerance(w: Weight, k: usize) -> f32 {
        match w {
            Weight::Quantized(q) if dot::activations_quantized(&q, k) => 2e-2,
            _ => 1e-5,
        }
    }

    /// Every format, scale dtype and row count, for float32 and half-precision activations: MLX's
    /// float32 product of the same values, up to summation order, rounded once.
    #[test]
    fn quantized_products_equal_mlxs_float32_product_for_every_format_and_row_count() {
        for scale_dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            // Rows of 160 end in part of a block of the AVX-512 BF16 loops (128 4-bit or 64 8-bit
            // elements).
            let formats = [(4, 32, 256), (4, 64, 256), (4, 128, 256), (8, 32, 256), (8, 64, 256), (8, 128, 256)];
            for (bits, group_size, k) in formats.into_iter().chain([(4, 32, 160), (8, 32, 160)]) {
                // 52 outputs: whole register tiles and a tail.
                let w = normal(&[52, k], 5).as_dtype(scale_dtype).unwrap();
                let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
                assert_eq!(scales.dtype(), scale_dtype);
                let q = Quantization { group_size, bits };
                let (packed, s, b) = (slice::<u32>(&wq).unwrap(), params(&scales).unwrap(), params(&biases).unwrap());
                let weight =
                    dot::Quantized { packed, scales: s, biases: b, bits: bits as u32, group: group_size as usize };
                let tolerance = tolerance(Weight::Quantized(weight), k as usize);
                for x_dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                    // Half-precision rows beyond MAX_ROWS too: these loops serve every row count.
                    let extra = if x_dtype == Dtype::Float32 { None } else { Some(40) };
                    for rows in ROWS.into_iter().chain(extra) {
                        let x = normal(&[rows, k], 6 + rows as u64).as_dtype(x_dtype).unwrap();
                        let ours = small_product(&x, &wq, Some(&scales), Some(&biases), Some(q)).unwrap().unwrap();
                        assert_eq!(ours.dtype(), x_dtype);
                        let d = beyond_one_rounding(&ours, &mlx_in_float32(&x, &wq, &scales, &biases, q));
                        assert!(
                            d <= tolerance,
                            "{bits} bits, group {group_size}, k {k}, {scale_dtype:?}, {x_dtype:?}, {rows} rows: {d}"
                        );
                    }
                }
            }
        }
    }

    /// A verify window of five or six rows shares one tile of quantized weights, and of float32
    /// weights on AVX-512; on AVX2 up to six rows of half-precision or quantized weights take
    /// other loops than more rows do, half-precision weights from seven rows on in blocks (at
    /// 1184 wide more than two chunks of a row; 13 outputs are more than a panel of W's rows, 131
    /// rows more than a panel of x's). Each row still gives what it gives alone.
    #[test]
    fn rows_of_a_window_equal_each_row_alone() {
        for k in [128, 1184] {
            window_rows_equal_each_row_alone(k);
        }
    }

    fn window_rows_equal_each_row_alone(k: usize) {
        let n = 13;
        let packed: Vec<u32> = (0..n * k / 4).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let scales: Vec<f32> = (0..n * k / 32).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let biases: Vec<f32> = (0..n * k / 32).map(|i| -0.05 + i as f32 * 1e-3).collect();
        let quantized = |bits| {
            Weight::Quantized(dot::Quantized {
                packed: &packed[..n * k * bits as usize / 32],
                scales: Params::F32(&scales),
                biases: Params::F32(&biases),
                bits,
                group: 32,
            })
        };
        let name = |w: Weight| match w {
            Weight::Quantized(q) => format!("{}-bit", q.bits),
            Weight::Bf16(_) => "bfloat16".into(),
            Weight::F16(_) => "float16".into(),
            Weight::F32(_) => "float32".into(),
        };
        // Finite in both half-precision formats, of either sign.
        let halves: Vec<u16> = (0..n * k).map(|i| 0x3c00 ^ ((i as u16).wrapping_mul(40503) & 0x83ff)).collect();
        let floats: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0).collect();
        for w in [quantized(4), quantized(8), Weight::Bf16(&halves), Weight::F16(&halves), Weight::F32(&floats)] {
            let dispatched = |x: &[f32], rows, y: &mut [f32]| dot::product(x, Dtype::Float32, rows, k, w, 0..n, n, y);
            // Rows of bfloat16 values, which take their own loops where the CPU has AVX-512 BF16.
            let bf16_rows = |x: &[f32], rows, y: &mut [f32]| {
                let x: Vec<f32> = x.iter().map(|&v| crate::arrays::round_to(Dtype::Bfloat16, v)).collect();
                dot::product(&x, Dtype::Bfloat16, rows, k, w, 0..n, n, y)
            };
            // The AVX2 loops too, which a CPU with AVX-512 does not take.
            #[cfg(target_arch = "x86_64")]
            // SAFETY: called only where the CPU has AVX2, FMA and F16C (checked below).
            let avx2 = |x: &[f32], rows, y: &mut [f32]| unsafe { dot::avx2::product(x, rows, k, w, 0..n, n, y) };
            type Product<'a> = &'a dyn Fn(&[f32], usize, &mut [f32]);
            #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
            let mut routes: Vec<(&str, Product)> = vec![("dispatched", &dispatched), ("bfloat16 rows", &bf16_rows)];
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c") {
                routes.push(("AVX2", &avx2));
            }
            for (route, product) in routes {
                for rows in [2, 3, 5, 6, 7, 9, 17, 40, 131] {
                    let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                    let mut window = vec![0f32; rows * n];
                    product(&x, rows, &mut window);
                    for m in 0..rows {
                        let mut alone = vec![0f32; n];
                        product(&x[m * k..(m + 1) * k], 1, &mut alone);
                        assert_eq!(alone, window[m * n..(m + 1) * n], "{route}, {}, k {k}, row {m} of {rows}", name(w));
                    }
                }
            }
        }
    }

    /// Summing in float32 is not MLX's CPU kernel for half-precision activations, which rounds
    /// after every operation: the check above tells the two apart.
    #[test]
    fn half_precision_sums_are_not_rounded_at_every_weight() {
        let w = normal(&[64, 1024], 8).as_dtype(Dtype::Bfloat16).unwrap();
        let (wq, scales, biases) = mlx_rs::ops::quantize(&w, 64, 4).unwrap();
        let x = normal(&[1, 1024], 9).as_dtype(Dtype::Bfloat16).unwrap();
        let rounded_each_step = mlx_rs::ops::quantized_matmul(&x, &wq, &scales, &biases, true, 64, 4).unwrap();
        let q = Quantization { group_size: 64, bits: 4 };
        let d = beyond_one_rounding(&rounded_each_step, &mlx_in_float32(&x, &wq, &scales, &biases, q));
        assert!(d > 1e-3, "{d}");
    }

    /// Rows of a quantized table equal MLX's gather and `dequantize` bit for bit.
    #[test]
    fn dequantized_rows_equal_mlxs() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            for (bits, group_size) in [(4, 32), (4, 64), (8, 64), (8, 128)] {
                let table = normal(&[40, 256], 20).as_dtype(dtype).unwrap();
                let (wq, scales, biases) = mlx_rs::ops::quantize(&table, group_size, bits).unwrap();
                let ids = Array::from_slice(&[3i32, 0, 39, 3, 17, 8], &[2, 3]);
                let q = Quantization { group_size, bits };
                let ours = dequantized_rows(&ids, &wq, &scales, &biases, q).unwrap().unwrap();
                let take = |a: &Array| a.take_axis(&ids, 0).unwrap();
                let mlx = mlx_rs::ops::dequantize(take(&wq), take(&scales), &take(&biases), group_size, bits).unwrap();
                assert_eq!((ours.shape(), ours.dtype()), (mlx.shape(), mlx.dtype()));
                let equal = ours.eq(&mlx).unwrap().all(None).unwrap().item_exact::<bool>();
                assert!(equal, "{dtype:?}, {bits} bits, group {group_size}");
            }
        }
        let (wq, scales, biases) = mlx_rs::ops::quantize(normal(&[8, 64], 21), 64, 4).unwrap();
        let q = Quantization { group_size: 64, bits: 4 };
        let outside = Array::from_slice(&[8i32], &[1]);
        assert!(dequantized_rows(&outside, &wq, &scales, &biases, q).unwrap().is_none());
    }

    #[test]
    fn products_split_over_two_threads_equal_mlxs() {
        // Large enough to split: a 1.2 MB bfloat16 weight, and 266,240 quantized weights.
        let w = normal(&[1024, 600], 12).as_dtype(Dtype::Bfloat16).unwrap();
        let x = normal(&[3, 600], 13);
        let ours = small_product(&x, &w, None, None, None).unwrap().unwrap();
        let d = relative_difference(&ours, &x.matmul(w.as_dtype(Dtype::Float32).unwrap().t()).unwrap());
        assert!(d <= 1e-5, "bfloat16: {d}");

        let w = normal(&[1040, 256], 14).as_dtype(Dtype::Bfloat16).unwrap();
        let (wq, scales, biases) = mlx_rs::ops::quantize(&w, 64, 4).unwrap();
        let x = normal(&[2, 256], 15).as_dtype(Dtype::Bfloat16).unwrap();
        let q = Quantization { group_size: 64, bits: 4 };
        let ours = small_product(&x, &wq, Some(&scales), Some(&biases), Some(q)).unwrap().unwrap();
        let d = beyond_one_rounding(&ours, &mlx_in_float32(&x, &wq, &scales, &biases, q));
        let weight = Weight::Quantized(dot::Quantized {
            packed: slice::<u32>(&wq).unwrap(),
            scales: params(&scales).unwrap(),
            biases: params(&biases).unwrap(),
            bits: 4,
            group: 64,
        });
        assert!(d <= tolerance(weight, 256), "4-bit, bfloat16 activations: {d}");
    }

    /// Appending zeros to both operands leaves every sum bit for bit as it was, whatever the
    /// lengths (an attention over keys and masked slots; see `dot`), and a row's result does not
    /// depend on which block of rows it falls in.
    #[test]
    fn sums_ignore_appended_zeros_and_the_rows_beside_them() {
        let (rows, n) = (7, 10);
        let value = |i: usize, salt: usize| (((i * 2654435761 + salt) % 1009) as f32 - 504.0) / 97.0;
        // Lengths on both sides of the AVX-512 loops' 32 lanes, x of any float32 value or of
        // bfloat16 values (which the AVX-512 BF16 loops take where the CPU has them).
        for (k, x_dtype) in
            [13, 21, 29, 37, 45, 70].into_iter().flat_map(|k| [(k, Dtype::Float32), (k, Dtype::Bfloat16)])
        {
            let x: Vec<f32> = (0..rows * k).map(|i| value(i, 1)).map(|v| round_to(x_dtype, v)).collect();
            let wf: Vec<f32> = (0..n * k).map(|i| value(i, 2)).collect();
            let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            for extra in [1, 3, 11, 40] {
                let pad = |a: &[f32], r: usize| -> Vec<f32> {
                    a.chunks(k)
                        .take(r)
                        .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0.0, extra)))
                        .collect()
                };
                let (xp, wfp) = (pad(&x, rows), pad(&wf, n));
                let wbp: Vec<u16> = wfp.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                for (w, wp) in [(Weight::F32(&wf), Weight::F32(&wfp)), (Weight::Bf16(&wb), Weight::Bf16(&wbp))] {
                    let (mut y, mut yp) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                    dot::product(&x, x_dtype, rows, k, w, 0..n, n, &mut y);
                    dot::product(&xp, x_dtype, rows, k + extra, wp, 0..n, n, &mut yp);
                    assert_eq!(y, yp, "{x_dtype:?}, k {k} + {extra} zeros");
                    // The last row alone gives what it gave as the fourth of a block of four.
                    let mut alone = vec![0f32; n];
                    dot::product(&x[(rows - 1) * k..], x_dtype, 1, k, w, 0..n, n, &mut alone);
                    assert_eq!(alone, y[(rows - 1) * n..], "{x_dtype:?}, k {k}, last row alone");
                }
            }
        }
    }

    /// Whether this CPU lets the tests of the tiled route run (saying so where it does not).
    #[cfg(target_arch = "x86_64")]
    fn tiles_here() -> bool {
        let here = amx_bf16::supported();
        if !here {
            eprintln!("no AMX tiles on this CPU: the tiled route is not tested here");
        }
        here
    }

    /// y [rows, n] of x [rows, k] by the routes a product takes: two bfloat16 rows or more
    /// (`bf16_rows`) on the unit, their float32 sums before rounding; others through the FMAs.
    #[cfg(target_arch = "x86_64")]
    fn unit_or_fmas(
        x: &[f32],
        rows: usize,
        bf16_rows: bool,
        tiles: Tiled,
        outputs: std::ops::Range<usize>,
    ) -> Vec<f32> {
        let (n, k) = tiles.shape();
        let mut y = vec![0f32; rows * n];
        // SAFETY: the callers checked that the CPU has the unit and this process may use it.
        unsafe {
            if rows == 1 || !bf16_rows {
                match tiles {
                    Tiled::Bf16(t) => amx_bf16::fma_rows(x, rows, t, outputs, &mut y),
                    Tiled::Quantized(t) => amx_quantized::fma_rows(x, rows, t, outputs, &mut y),
                }
                return y;
            }
            // x's rows as bfloat16 bits (exact: they hold bfloat16 values).
            let xb: Vec<u16> = x.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let out = amx_bf16::F32Rows { y: &mut y, n };
            match tiles {
                Tiled::Bf16(t) => {
                    let (xb, stride) = amx_bf16::padded(&xb, k);
                    amx_bf16::rows_on_unit(&xb, stride, rows, t, outputs, out);
                }
                Tiled::Quantized(t) => {
                    let sums = amx_quantized::group_sums_of_bits(&xb, t.group);
                    amx_quantized::rows_on_unit(&xb, rows, &sums, t, outputs, out);
                }
            }
        }
        y
    }

    /// The AMX tiles ([`amx_bf16`]) where the CPU has them: MLX's float32 product of the same
    /// values up to summation order, a row's result the same alone, in a window of any size and
    /// in either half of a split, and zeros appended to both operands changing no sum.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn tiled_products_equal_mlxs_and_each_row_alone() {
        if !tiles_here() {
            return;
        }
        let tiled = |x: &[f32], rows: usize, bf16_rows: bool, tiles: &amx_bf16::Tiles, outputs| {
            unit_or_fmas(x, rows, bf16_rows, Tiled::Bf16(tiles), outputs)
        };
        for (n, k) in [(72, 264), (16, 32), (100, 36), (40, 1000)] {
            let w = normal(&[n, k], 1).as_dtype(Dtype::Bfloat16).unwrap();
            let (n, k) = (n as usize, k as usize);
            let tiles = amx_bf16::Tiles::pack(bits16(&w).unwrap(), n, k);
            assert_eq!(tiles.unpack(), bits16(&w).unwrap(), "n {n}, k {k}: the weight back from its tiles");
            // The same weight and rows with 11 zeros after each row's inputs.
            let padded_w: Vec<u16> =
                bits16(&w).unwrap().chunks(k).flat_map(|r| r.iter().copied().chain([0; 11])).collect();
            let padded_tiles = amx_bf16::Tiles::pack(&padded_w, n, k + 11);
            let w32 = w.as_dtype(Dtype::Float32).unwrap();
            for rows in [1, 2, 5, 16, 21] {
                let x = normal(&[rows, k as i32], 2 + rows as u64).as_dtype(Dtype::Bfloat16).unwrap();
                let xs = x.as_dtype(Dtype::Float32).unwrap();
                let xs = xs.as_slice::<f32>();
                let rows = rows as usize;
                // Two rows or more take the unit, one row the FMA loops, which sum as it does.
                let window = tiled(xs, rows, true, &tiles, 0..n);
                let ours = Array::from_slice(&window, &[rows as i32, n as i32]);
                let mlx = x.as_dtype(Dtype::Float32).unwrap().matmul(w32.t()).unwrap();
                let d = relative_difference(&ours, &mlx);
                assert!(d <= 1e-5, "n {n}, k {k}, {rows} rows: {d}");
                for m in 0..rows {
                    let alone = tiled(&xs[m * k..(m + 1) * k], 1, true, &tiles, 0..n);
                    assert_eq!(alone, window[m * n..(m + 1) * n], "n {n}, k {k}, row {m} of {rows}");
                }
                let mut halves = tiled(xs, rows, true, &tiles, 0..n / 3);
                let upper = tiled(xs, rows, true, &tiles, n / 3..n);
                for m in 0..rows {
                    halves[m * n + n / 3..(m + 1) * n].copy_from_slice(&upper[m * n + n / 3..(m + 1) * n]);
                }
                assert_eq!(halves, window, "n {n}, k {k}, {rows} rows split at {}", n / 3);
                let padded_x: Vec<f32> = xs.chunks(k).flat_map(|r| r.iter().copied().chain([0.0; 11])).collect();
                assert_eq!(tiled(&padded_x, rows, true, &padded_tiles, 0..n), window, "n {n}, k {k} + 11 zeros");
                // Float32 rows: each through the FMA loops, near MLX's float32 product.
                let x32 = normal(&[rows as i32, k as i32], 40 + rows as u64);
                let floats = tiled(x32.as_slice::<f32>(), rows, false, &tiles, 0..n);
                let mlx = x32.matmul(w32.t()).unwrap();
                let d = relative_difference(&Array::from_slice(&floats, &[rows as i32, n as i32]), &mlx);
                assert!(d <= 1e-5, "n {n}, k {k}, {rows} float32 rows: {d}");
                let last = tiled(&x32.as_slice::<f32>()[(rows - 1) * k..], 1, false, &tiles, 0..n);
                assert_eq!(last, floats[(rows - 1) * n..], "n {n}, k {k}, float32 row {rows} alone");
            }
        }
    }

    /// Whether this CPU lets the tests of quantized tiles run (saying so where it does not).
    #[cfg(target_arch = "x86_64")]
    fn quantized_tiles_here() -> bool {
        let here = amx_quantized::available();
        if !here {
            eprintln!("no AMX tiles with AVX-512 BF16 on this CPU: quantized tiles are not tested here");
        }
        here
    }

    /// Quantized tiles ([`amx_quantized`]) where the CPU has the unit: MLX's packed weight,
    /// scales and biases back from them; MLX's float32 product of the same values up to
    /// summation order, for every format; a row's result the same alone, in a window of any
    /// size (on the unit) and in either part of a split.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantized_tiles_equal_mlxs_product_and_each_row_alone() {
        if !quantized_tiles_here() {
            return;
        }
        let run = |x: &[f32], rows: usize, bf16_rows: bool, t: &amx_quantized::QuantTiles, outputs| {
            unit_or_fmas(x, rows, bf16_rows, Tiled::Quantized(t), outputs)
        };
        for (bits, group_size) in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)] {
            for (n, k) in [(72, 256), (16, 128), (130, 384)] {
                let w = normal(&[n, k], 30).as_dtype(Dtype::Bfloat16).unwrap();
                let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
                let q = Quantization { group_size, bits };
                let (n, k) = (n as usize, k as usize);
                let case = format!("{bits} bits, group {group_size}, n {n}, k {k}");
                let words = wq.as_slice::<u32>();
                let (s, b) = (bits16(&scales).unwrap(), bits16(&biases).unwrap());
                let t = amx_quantized::QuantTiles::pack(words, s, b, n, k, bits as u32, group_size as usize);
                assert_eq!(t.unpack(), (words.to_vec(), s.to_vec(), b.to_vec()), "{case}: MLX's arrays back");
                for rows in [1, 2, 5, 16, 21] {
                    let x = normal(&[rows, k as i32], 31 + rows as u64).as_dtype(Dtype::Bfloat16).unwrap();
                    let xs = x.as_dtype(Dtype::Float32).unwrap();
                    let xs = xs.as_slice::<f32>();
                    let rows = rows as usize;
                    let window = run(xs, rows, true, &t, 0..n);
                    let ours = Array::from_slice(&window, &[rows as i32, n as i32]);
                    let d = relative_difference(&ours, &mlx_in_float32(&x, &wq, &scales, &biases, q));
                    assert!(d <= 1e-5, "{case}, {rows} rows: {d}");
                    each_row_alone_and_split(|x, r, o| run(x, r, true, &t, o), xs, (rows, k, n), &window, &case);
                    // Float32 rows: through the FMAs, near MLX's float32 product.
                    let x32 = normal(&[rows as i32, k as i32], 50 + rows as u64);
                    let floats = run(x32.as_slice::<f32>(), rows, false, &t, 0..n);
                    let ours = Array::from_slice(&floats, &[rows as i32, n as i32]);
                    let d = relative_difference(&ours, &mlx_in_float32(&x32, &wq, &scales, &biases, q));
                    assert!(d <= 1e-5, "{case}, {rows} float32 rows: {d}");
                }
            }
        }
    }

    /// That each row of `window` (y [rows, n] of x's rows [rows, k] by `run`) is what `run`
    /// gives for that row alone, and that the outputs split where the threads split them, at a
    /// whole group of outputs, give the window.
    #[cfg(target_arch = "x86_64")]
    fn each_row_alone_and_split(
        run: impl Fn(&[f32], usize, std::ops::Range<usize>) -> Vec<f32>,
        xs: &[f32],
        (rows, k, n): (usize, usize, usize),
        window: &[f32],
        case: &str,
    ) {
        for m in 0..rows {
            let alone = run(&xs[m * k..(m + 1) * k], 1, 0..n);
            assert_eq!(alone, window[m * n..(m + 1) * n], "{case}, row {m} of {rows}");
        }
        let at = amx_bf16::GROUP.min(n);
        let mut parts = run(xs, rows, 0..at);
        let upper = run(xs, rows, at..n);
        for m in 0..rows {
            parts[m * n + at..(m + 1) * n].copy_from_slice(&upper[m * n + at..(m + 1) * n]);
        }
        assert_eq!(parts, window, "{case}, {rows} rows split at {at}");
    }

    /// Whether this CPU has what `tiles_avx512` needs (with the unit or not), saying so where not.
    /// With AVX-512 BF16 the loops take `vdpbf16ps`, without it (or under
    /// `HOST_SIMD=avx512-nobf16`) FMAs at every row count.
    #[cfg(target_arch = "x86_64")]
    fn vector_tiles_here() -> bool {
        let here = crate::lanes::available() && crate::simd::has!("avx512bw");
        if !here {
            eprintln!("no AVX-512 on this CPU: tiles on its vectors are not tested here");
        }
        here
    }

    /// bfloat16 tiles on the AVX-512 loops of CPUs without the unit (`tiles_avx512`), where
    /// this CPU has those instructions: MLX's float32 product of the same values up to summation
    /// order, a row's result the same alone, in a window of any size and in either part of a
    /// split, and zeros appended to both operands changing no sum.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn bfloat16_tiles_on_vectors_equal_mlxs_product_and_each_row_alone() {
        if !vector_tiles_here() {
            return;
        }
        let run = |xs: &[f32], rows: usize, t: &amx_bf16::Tiles, outputs: std::ops::Range<usize>| {
            let xb: Vec<u16> = xs.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let (xb, stride) = amx_bf16::padded(&xb, t.k);
            let mut y = vec![0f32; rows * t.n];
            // SAFETY: the CPU has AVX-512 F, BW, VL and DQ (checked above).
            unsafe {
                let out = amx_bf16::F32Rows { y: &mut y, n: t.n };
                crate::tiles_avx512::bf16_rows(&xb, stride, rows, t, outputs, out);
            }
            y
        };
        for (n, k) in [(72, 264), (16, 32), (100, 36), (40, 1000)] {
            let w = normal(&[n, k], 70).as_dtype(Dtype::Bfloat16).unwrap();
            let (n, k) = (n as usize, k as usize);
            let tiles = amx_bf16::Tiles::pack(bits16(&w).unwrap(), n, k);
            let padded_w: Vec<u16> =
                bits16(&w).unwrap().chunks(k).flat_map(|r| r.iter().copied().chain([0; 11])).collect();
            let padded_tiles = amx_bf16::Tiles::pack(&padded_w, n, k + 11);
            let w32 = w.as_dtype(Dtype::Float32).unwrap();
            for rows in [1, 2, 6, 7, 50] {
                let x = normal(&[rows, k as i32], 71 + rows as u64).as_dtype(Dtype::Bfloat16).unwrap();
                let xs = x.as_dtype(Dtype::Float32).unwrap();
                let xs = xs.as_slice::<f32>();
                let rows = rows as usize;
                let window = run(xs, rows, &tiles, 0..n);
                let mlx = x.as_dtype(Dtype::Float32).unwrap().matmul(w32.t()).unwrap();
                let d = relative_difference(&Array::from_slice(&window, &[rows as i32, n as i32]), &mlx);
                assert!(d <= 1e-5, "n {n}, k {k}, {rows} rows: {d}");
                let case = format!("n {n}, k {k}");
                each_row_alone_and_split(|x, r, o| run(x, r, &tiles, o), xs, (rows, k, n), &window, &case);
                let padded_x: Vec<f32> = xs.chunks(k).flat_map(|r| r.iter().copied().chain([0.0; 11])).collect();
                assert_eq!(run(&padded_x, rows, &padded_tiles, 0..n), window, "n {n}, k {k} + 11 zeros");
            }
        }
    }

    /// Quantized tiles on the AVX2 loops of CPUs without AVX-512 (`tiles_avx2`), wherever the
    /// CPU has AVX2 and FMA: MLX's float32 product of the same values up to summation order, for
    /// every format and bfloat16 or float32 rows, and a row's result the same alone, in a window
    /// of any size (one row, two, a register tile, past a pass) and in either part of a split.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantized_tiles_on_avx2_equal_mlxs_product_and_each_row_alone() {
        if !(crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c")) {
            eprintln!("no AVX2 with FMA on this CPU: quantized tiles on it are not tested here");
            return;
        }
        let run = |xs: &[f32], rows: usize, t: &amx_quantized::QuantTiles, outputs: std::ops::Range<usize>| {
            let mut y = vec![0f32; rows * t.n];
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { crate::tiles_avx2::rows(xs, rows, t, outputs, &mut y) };
            y
        };
        let windows = [
            (1, Dtype::Bfloat16),
            (2, Dtype::Float32),
            (3, Dtype::Bfloat16),
            (7, Dtype::Float32),
            (43, Dtype::Bfloat16),
        ];
        quantized_tiles_by(run, 80, &windows);
    }

    /// Quantized tiles on the AVX-512 loops of CPUs without the unit (`tiles_avx512`),
    /// where this CPU has those instructions (with the unit or not): MLX's float32 product of the
    /// same values up to summation order, for every format, and a row's result the same alone,
    /// in a window of any size (past a register tile and a pass) and in either part of a split.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantized_tiles_on_vectors_equal_mlxs_product_and_each_row_alone() {
        if !vector_tiles_here() {
            return;
        }
        let run = |xs: &[f32], rows: usize, t: &amx_quantized::QuantTiles, outputs: std::ops::Range<usize>| {
            let xb: Vec<u16> = xs.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            let mut y = vec![0f32; rows * t.n];
            // SAFETY: the CPU has AVX-512 F, BW, VL and DQ (checked above).
            unsafe {
                let sums = amx_quantized::group_sums_of_bits(&xb, t.group);
                let out = amx_bf16::F32Rows { y: &mut y, n: t.n };
                crate::tiles_avx512::rows(&xb, rows, &sums, t, outputs, out);
            }
            y
        };
        let windows = [1, 2, 6, 7, 50].map(|rows| (rows, Dtype::Bfloat16));
        quantized_tiles_by(run, 60, &windows);
    }

    /// Quantized tiles multiplied by `run` (y [rows, n] of x's rows for the outputs given) in
    /// every format MLX makes and three shapes, at each window of `windows` (rows, x's dtype):
    /// MLX's float32 product of the same values up to summation order, and each row alone and
    /// the outputs split as in the window.
    #[cfg(target_arch = "x86_64")]
    fn quantized_tiles_by(
        run: impl Fn(&[f32], usize, &amx_quantized::QuantTiles, std::ops::Range<usize>) -> Vec<f32>,
        seed: u64,
        windows: &[(i32, Dtype)],
    ) {
        for (bits, group_size) in [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)] {
            for (n, k) in [(72, 256), (16, 128), (130, 384)] {
                let w = normal(&[n, k], seed).as_dtype(Dtype::Bfloat16).unwrap();
                let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
                let q = Quantization { group_size, bits };
                let (n, k) = (n as usize, k as usize);
                let case = format!("{bits} bits, group {group_size}, n {n}, k {k}");
                let (s, b) = (bits16(&scales).unwrap(), bits16(&biases).unwrap());
                let t =
                    amx_quantized::QuantTiles::pack(wq.as_slice::<u32>(), s, b, n, k, bits as u32, group_size as usize);
                for &(rows, dtype) in windows {
                    let x = normal(&[rows, k as i32], seed + 1 + rows as u64).as_dtype(dtype).unwrap();
                    let xs = x.as_dtype(Dtype::Float32).unwrap();
                    let xs = xs.as_slice::<f32>();
                    let rows = rows as usize;
                    let window = run(xs, rows, &t, 0..n);
                    let ours = Array::from_slice(&window, &[rows as i32, n as i32]);
                    let d = relative_difference(&ours, &mlx_in_float32(&x, &wq, &scales, &biases, q));
                    assert!(d <= 1e-5, "{case}, {rows} rows of {dtype:?}: {d}");
                    each_row_alone_and_split(|x, r, o| run(x, r, &t, o), xs, (rows, k, n), &window, &case);
                }
            }
        }
    }

    /// The FMAs sum x·q as the unit does over values of every magnitude, denormals among them:
    /// a row alone equals the row in a window, bit for bit. Then through [`tiled_product`],
    /// whichever loops hold the tiles (with `HOST_AMX=off` on a CPU with the unit, or on one
    /// with AVX-512 BF16 alone, `tiles_avx512`).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn quantized_fma_loops_sum_as_the_tile_unit_over_wide_and_denormal_values() {
        if !amx_quantized::held() {
            eprintln!("no quantized tiles on this CPU: not tested here");
            return;
        }
        let (n, k, rows, group) = (80usize, 256usize, 4usize, 64usize);
        let value = |i: usize| {
            let h = (i as u32).wrapping_mul(2654435761) >> 7;
            let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
            sign * (1.0 + (h % 128) as f32 / 128.0) * 2f32.powi((h % 160) as i32 - 140)
        };
        let bf16 = |v: f32| half::bf16::from_f32(v);
        let x: Vec<f32> = (0..rows * k).map(|i| bf16(value(i + 7919)).to_f32()).collect();
        assert!(x.iter().any(|v| *v != 0.0 && v.abs() < f32::MIN_POSITIVE), "denormal inputs");
        let scales: Vec<u16> = (0..n * k / group).map(|i| bf16(value(i + 31)).to_bits()).collect();
        let biases: Vec<u16> = (0..n * k / group).map(|i| bf16(value(i + 97)).to_bits()).collect();
        for bits in [4u32, 8] {
            let packed: Vec<u32> =
                (0..n * k * bits as usize / 32).map(|i| (i as u32).wrapping_mul(2246822519)).collect();
            let t = amx_quantized::QuantTiles::pack(&packed, &scales, &biases, n, k, bits, group);
            if quantized_tiles_here() {
                let window = unit_or_fmas(&x, rows, true, Tiled::Quantized(&t), 0..n);
                let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                for m in 0..rows {
                    let alone = unit_or_fmas(&x[m * k..(m + 1) * k], 1, true, Tiled::Quantized(&t), 0..n);
                    assert_eq!(bits_of(&alone), bits_of(&window[m * n..(m + 1) * n]), "{bits} bits, row {m}");
                }
            }
            // The same rows as a bfloat16 array, the window's route reading their bits; the
            // first row all denormals, read as zero by the unit and so by its groups' sums (of
            // normal size unflushed).
            let mut xb: Vec<u16> = x.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            for (i, b) in xb[..k].iter_mut().enumerate() {
                *b = (i % 127 + 1) as u16;
            }
            let x_array = from_bits16(&xb, &[1, rows as i32, k as i32], Dtype::Bfloat16);
            let window = tiled_product(&x_array, Tiled::Quantized(&t)).unwrap().expect("the tiles apply");
            for m in 0..rows {
                let row = from_bits16(&xb[m * k..(m + 1) * k], &[1, 1, k as i32], Dtype::Bfloat16);
                let alone = tiled_product(&row, Tiled::Quantized(&t)).unwrap().expect("the tiles apply");
                assert_eq!(
                    bits16(&alone).unwrap(),
                    &bits16(&window).unwrap()[m * n..(m + 1) * n],
                    "{bits} bits, row {m} of the array"
                );
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_fma_loops_sum_as_the_tile_unit_over_wide_and_denormal_values() {
        if !tiles_here() {
            return;
        }
        // Magnitudes from 2^-140 (denormal) to 2^19, of both signs: sums that round at every
        // step, and inputs the unit reads as zero.
        let (n, k, rows) = (48usize, 96usize, 3usize);
        let value = |i: usize| {
            let h = (i as u32).wrapping_mul(2654435761) >> 7;
            let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
            sign * (1.0 + (h % 128) as f32 / 128.0) * 2f32.powi((h % 160) as i32 - 140)
        };
        let bf16 = |v: f32| half::bf16::from_f32(v);
        let w: Vec<u16> = (0..n * k).map(|i| bf16(value(i)).to_bits()).collect();
        let x: Vec<f32> = (0..rows * k).map(|i| bf16(value(i + 7919)).to_f32()).collect();
        assert!(x.iter().any(|v| *v != 0.0 && v.abs() < f32::MIN_POSITIVE), "denormal inputs");
        let tiles = amx_bf16::Tiles::pack(&w, n, k);
        let window = unit_or_fmas(&x, rows, true, Tiled::Bf16(&tiles), 0..n);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for m in 0..rows {
            let alone = unit_or_fmas(&x[m * k..(m + 1) * k], 1, true, Tiled::Bf16(&tiles), 0..n);
            assert_eq!(bits(&alone), bits(&window[m * n..(m + 1) * n]), "row {m}");
        }
    }

    /// Bfloat16 windows on the unit, rounded by the threads that summed them: each row the
    /// bits it has alone (a step's route: the FMAs, then rounding), split between the threads
    /// or not, for bfloat16 tiles of every padding and quantized tiles of every format.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn bfloat16_windows_on_the_unit_equal_each_row_alone() {
        if !quantized_tiles_here() {
            return;
        }
        let check = |case: &str, k: usize, tiles: Tiled| {
            for rows in [2, 5, 17] {
                let x = normal(&[1, rows, k as i32], 70 + rows as u64).as_dtype(Dtype::Bfloat16).unwrap();
                let window = tiled_product(&x, tiles).unwrap().expect("the tiles apply");
                for m in 0..rows {
                    let row = x.index((.., m..m + 1, ..));
                    let alone = tiled_product(&row, tiles).unwrap().expect("the tiles apply");
                    let expected = bits16(&alone).unwrap();
                    let n = expected.len();
                    assert_eq!(&bits16(&window).unwrap()[m as usize * n..][..n], expected, "{case}, row {m} of {rows}");
                }
            }
        };
        // 520 × 256 is split between the threads; the others are not.
        for (n, k) in [(520, 256), (72, 264), (40, 1000)] {
            let w = normal(&[n, k], 71).as_dtype(Dtype::Bfloat16).unwrap();
            let tiles = amx_bf16::Tiles::pack(bits16(&w).unwrap(), n as usize, k as usize);
            check(&format!("bfloat16, n {n}, k {k}"), k as usize, Tiled::Bf16(&tiles));
        }
        for (bits, group) in [(4, 32), (4, 64), (4, 128), (8, 64)] {
            for (n, k) in [(520, 256), (72, 128)] {
                let w = normal(&[n, k], 72).as_dtype(Dtype::Bfloat16).unwrap();
                let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group, bits).unwrap();
                let (s, b) = (bits16(&scales).unwrap(), bits16(&biases).unwrap());
                let t = amx_quantized::QuantTiles::pack(
                    wq.as_slice::<u32>(),
                    s,
                    b,
                    n as usize,
                    k as usize,
                    bits as u32,
                    group as usize,
                );
                check(&format!("{bits} bits, group {group}, n {n}, k {k}"), k as usize, Tiled::Quantized(&t));
            }
        }
    }

    #[test]
    fn the_portable_loops_equal_the_simd_ones() {
        let (rows, k, n) = (5, 128, 24);
        let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let wf: Vec<f32> = (0..n * k).map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0).collect();
        let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let packed: Vec<u32> = (0..n * k / 4).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let scales: Vec<f32> = (0..n * k / 32).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let biases: Vec<f32> = (0..n * k / 32).map(|i| -0.05 + i as f32 * 1e-3).collect();
        let quantized = |bits| {
            Weight::Quantized(dot::Quantized {
                packed: &packed[..n * k * bits as usize / 32],
                scales: Params::F32(&scales),
                biases: Params::F32(&biases),
                bits,
                group: 32,
            })
        };
        let xb: Vec<f32> = x.iter().map(|&v| round_to(Dtype::Bfloat16, v)).collect();
        let cases = [Weight::F32(&wf), Weight::Bf16(&wb), quantized(4), quantized(8)].map(|w| (w, Dtype::Float32, &x));
        for (w, x_dtype, x) in cases.into_iter().chain([(Weight::Bf16(&wb), Dtype::Bfloat16, &xb)]) {
            let (mut simd, mut portable) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            dot::product(x, x_dtype, rows, k, w, 0..n, n, &mut simd);
            dot::portable::product(x, rows, k, w, 0..n, n, &mut portable);
            let scale = portable.iter().fold(0f32, |a, v| a.max(v.abs()));
            let worst = simd.iter().zip(&portable).fold(0f32, |a, (s, p)| a.max((s - p).abs()));
            assert!(worst <= tolerance(w, k) * scale, "{worst} of {scale}");
            // The AVX2 loops too, which a CPU with AVX-512 does not take.
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c") {
                let mut avx2 = vec![0f32; rows * n];
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
                unsafe { dot::avx2::product(x, rows, k, w, 0..n, n, &mut avx2) };
                let worst = avx2.iter().zip(&portable).fold(0f32, |a, (s, p)| a.max((s - p).abs()));
                assert!(worst <= 1e-5 * scale, "AVX2: {worst} of {scale}");
            }
        }
    }
}
