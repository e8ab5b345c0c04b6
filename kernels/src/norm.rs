//! RMSNorm over host arrays, MLX's CPU result bit for bit.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{
    avx2_where_available, bf16_bits, bits16, from_bits16, rounded, row_major, with_floats, with_round, Round, ToBf16,
    Value,
};
use crate::helper;

/// RMSNorm with a weight (multiplied as is, not 1 + w) or without one, where the CPU route
/// covers it; `None` for MLX's op to compute.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Option<Array>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    cpu_rms_norm(x, weight, eps)
}

/// RMSNorm on the CPU as MLX computes it there (its fallback in mlx/fast.cpp, seven ops): in
/// float32, the squares summed in order, times 1/n, plus eps, 1/√, times x; rounded to x's
/// dtype; times the weight, rounded again. Done here in one pass because each MLX op costs
/// microseconds of dispatch on the CPU and a small model meets eight norms per layer; the
/// result is MLX's bit for bit (tested). `None` for what it does not cover.
fn cpu_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Option<Array>, Exception> {
    let dtype = x.dtype();
    let n = x.shape().last().copied().unwrap_or(0) as usize;
    let weight_fits = weight.is_none_or(|w| w.dtype() == dtype && w.shape() == [n as i32]);
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) || n == 0 || !weight_fits {
        return Ok(None);
    }
    let x = row_major(x)?;
    if dtype == Dtype::Bfloat16 {
        // Read and written as bit patterns, with no float32 copy of x or of the weight.
        let weight = weight.map(row_major).transpose()?;
        let weight =
            weight.as_ref().map(|w| bits16(w).ok_or_else(|| Exception::custom("bfloat16 weight"))).transpose()?;
        let bits = bits16(&x).ok_or_else(|| Exception::custom("bfloat16 data"))?;
        let mut y = vec![0u16; bits.len()];
        // Row by row (as below): each half of a prefill's rows on its own thread.
        helper::rows_in_halves(&mut y, n, |first, y| {
            let bits = &bits[first * n..first * n + y.len()];
            let scales = row_scales(bits, n, eps);
            for ((row, out), &scale) in bits.chunks(n).zip(y.chunks_mut(n)).zip(&scales) {
                normalized_bf16(row, scale, weight, out);
            }
        });
        return Ok(Some(from_bits16(&y, x.shape(), dtype)));
    }
    let weight = weight.map(|w| row_major(w).and_then(|w| with_floats(&w, <[f32]>::to_vec))).transpose()?;
    let y = with_floats(&x, |xs| {
        let mut y = vec![0f32; xs.len()];
        helper::rows_in_halves(&mut y, n, |first, y| {
            let xs = &xs[first * n..first * n + y.len()];
            let scales = row_scales(xs, n, eps);
            for ((row, out), &scale) in xs.chunks(n).zip(y.chunks_mut(n)).zip(&scales) {
                with_round!(dtype, |r| normalized(r, row, scale, weight.as_deref(), out));
            }
        });
        rounded(&y, x.shape(), dtype)
    })?;
    Ok(Some(y))
}

avx2_where_available! {
    /// [`normalized`] for bfloat16, read and written as bit patterns.
    fn normalized_bf16(row: &[u16], scale: f32, weight: Option<&[u16]>, out: &mut [u16]) {
        match weight {
            Some(w) => {
                for ((y, &v), &w) in out.iter_mut().zip(row).zip(w) {
                    *y = bf16_bits(ToBf16.round(v.as_f32() * scale) * w.as_f32());
                }
            }
            None => {
                for (y, &v) in out.iter_mut().zip(row) {
                    *y = bf16_bits(v.as_f32() * scale);
                }
            }
        }
    }
}

/// Each row's 1/√(mean of squares + eps), the rows `n` long: what its values are multiplied by.
fn row_scales<T: Value>(xs: &[T], n: usize, eps: f32) -> Vec<f32> {
    let inverse_n = (1.0 / n as f64) as f32;
    let sums = xs.chunks(SUMMED_TOGETHER * n).flat_map(|rows| squares_summed_in_order(rows, n));
    sums.map(|sum| 1.0 / (sum * inverse_n + eps).sqrt()).collect()
}

/// Rows whose sums of squares [`squares_summed_in_order`] takes side by side.
const SUMMED_TOGETHER: usize = 8;

/// The sum of squares of each row of `rows` (at most [`SUMMED_TOGETHER`] rows of `n`), each in
/// element order as MLX sums it. One row's sum is a chain of dependent additions, bound by
/// their latency; several rows' chains advance together, and a batch's norms take little more
/// time than one row's.
fn squares_summed_in_order<T: Value>(rows: &[T], n: usize) -> impl Iterator<Item = f32> {
    let mut sums = [0f32; SUMMED_TOGETHER];
    // The row count is a constant in each arm, so that the sums stay in registers.
    match rows.len() / n {
        1 => squares_of::<1, T>(rows, n, &mut sums),
        2 => squares_of::<2, T>(rows, n, &mut sums),
        3 => squares_of::<3, T>(rows, n, &mut sums),
        4 => squares_of::<4, T>(rows, n, &mut sums),
        5 => squares_of::<5, T>(rows, n, &mut sums),
        6 => squares_of::<6, T>(rows, n, &mut sums),
        7 => squares_of::<7, T>(rows, n, &mut sums),
        _ => squares_of::<8, T>(rows, n, &mut sums),
    }
    sums.into_iter().take(rows.len() / n)
}

/// [`squares_summed_in_order`] of `R` rows, into `out`'s first `R`.
#[inline(always)]
fn squares_of<const R: usize, T: Value>(rows: &[T], n: usize, out: &mut [f32; SUMMED_TOGETHER]) {
    let rows: [&[T]; R] = std::array::from_fn(|r| &rows[r * n..][..n]);
    let mut sums = [0f32; R];
    // Element i of every row, then i + 1: the rows' chains advance together.
    #[allow(clippy::needless_range_loop)]
    for i in 0..n {
        for r in 0..R {
            let v = rows[r][i].as_f32();
            sums[r] += v * v;
        }
    }
    out[..R].copy_from_slice(&sums);
}

/// One row of [`cpu_rms_norm`] after its sum: x times the scale, rounded, times the weight,
/// rounded again.
#[inline(always)]
fn normalized(r: impl Round, row: &[f32], scale: f32, weight: Option<&[f32]>, out: &mut [f32]) {
    match weight {
        Some(w) => {
            for ((y, &v), &w) in out.iter_mut().zip(row).zip(w) {
                *y = r.round(r.round(v * scale) * w);
            }
        }
        None => {
            for (y, &v) in out.iter_mut().zip(row) {
                *y = r.round(v * scale);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;

    #[test]
    fn equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            // (37 rows of 2048 are a prefill's, which the rows' halves take on two threads.)
            let shapes = [(1, 256), (5, 100), (3, 2560), (2, 17), (7, 64), (19, 64), (37, 2048)];
            for (seed, (rows, n)) in shapes.into_iter().enumerate() {
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
