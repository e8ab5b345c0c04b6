//! MLX's precise softmax of float32 rows, bit for bit, computed on the host.

use mlx_rs::Dtype;

use crate::arrays::{with_round, Round};
use crate::exp::mlx_exp;
#[cfg(target_arch = "x86_64")]
use crate::exp::mlx_exp8;

/// `softmax(x / temperature)` over each row of `width` float32 values, in place, bit for bit
/// MLX's divide and precise softmax on float32: a drafter's distribution to draw from. MLX's
/// ops compute each exponential twice, one element at a time, and cost a round trip to MLX's
/// thread; this computes each once, in vector code where the CPU has it.
pub fn tempered_softmax_rows(values: &mut [f32], width: usize, temperature: f32) {
    for v in values.iter_mut() {
        *v /= temperature;
    }
    for row in values.chunks_mut(width.max(1)) {
        softmax_row(Dtype::Float32, row);
    }
}

/// MLX's CPU softmax (precise) of one row of `dtype` values, in place: as MLX 0.32's x86
/// build runs it: the maximum, exp(x − max) by MLX's own polynomial, the float32 sum of those in
/// order, its reciprocal, then each exponential times the reciprocal, rounded once to `dtype`.
/// Bit for bit MLX's op (tested), without its round trip.
pub(crate) fn softmax_row(dtype: Dtype, row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") && crate::simd::has!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { softmax_row_avx2(dtype, row) };
    }
    softmax_row_body(dtype, row)
}

/// [`softmax_row`] with the maximum and the exponentials eight at a time: each lane's maximum
/// is kept as the scalar loop keeps it (a value replaces it only if greater), and each lane's
/// exponential is the scalar one bit for bit ([`mlx_exp8`]); the sum stays in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_avx2(dtype: Dtype, row: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut lanes = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        lanes = _mm256_max_ps(_mm256_loadu_ps(chunk.as_ptr()), lanes);
    }
    let mut maxima = [0f32; 8];
    _mm256_storeu_ps(maxima.as_mut_ptr(), lanes);
    let greater = |m: f32, &x: &f32| if x > m { x } else { m };
    let maximum = chunks.remainder().iter().fold(maxima.iter().fold(f32::NEG_INFINITY, greater), greater);
    let shift = _mm256_set1_ps(maximum);
    let mut chunks = row.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let e = mlx_exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift));
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
    }
    for x in chunks.into_remainder() {
        *x = mlx_exp(*x - maximum);
    }
    let sum = row.iter().fold(0f32, |sum, &e| sum + e);
    scaled_to(dtype, row, 1.0 / sum);
}

#[inline(always)]
fn softmax_row_body(dtype: Dtype, row: &mut [f32]) {
    let maximum = row.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // MLX computes each exponential twice; they are equal, so once is enough here.
    let mut sum = 0f32;
    for x in row.iter_mut() {
        *x = mlx_exp(*x - maximum);
        sum += *x;
    }
    scaled_to(dtype, row, 1.0 / sum);
}

/// Each exponential times the normalizer, rounded to `dtype`.
#[inline(always)]
fn scaled_to(dtype: Dtype, row: &mut [f32], normalizer: f32) {
    with_round!(dtype, |r| {
        for x in row.iter_mut() {
            *x = r.round(*x * normalizer);
        }
    });
}

#[cfg(test)]
mod tests {
    use mlx_rs::{random, Array};

    use super::*;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap().as_dtype(dtype).unwrap()
    }

    #[test]
    fn the_host_softmax_is_mlxs_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            // The lowest value of the dtype, as the attention masks with it.
            let lowest = match dtype {
                Dtype::Bfloat16 => f32::from_bits(0xFF7F_0000),
                Dtype::Float16 => -65504.0,
                _ => f32::MIN,
            };
            for (len, seed) in [(1, 1), (7, 2), (40, 3), (129, 4), (300, 5), (2048, 6), (8192, 7)] {
                let x = normal(&[3, len], seed, Dtype::Float32).multiply(Array::from_f32(4.0)).unwrap();
                let keep = Array::from_iter((0..3 * len).map(|i| i % 7 != 3 || len == 1), &[3, len]);
                let x = mlx_rs::ops::select(&keep, &x, Array::from_f32(lowest)).unwrap().as_dtype(dtype).unwrap();
                let mlx = mlx_rs::ops::softmax_axis(&x, -1, true).unwrap().as_dtype(Dtype::Float32).unwrap();
                let mut ours = x.as_dtype(Dtype::Float32).unwrap().as_slice::<f32>().to_vec();
                for row in ours.chunks_mut(len as usize) {
                    softmax_row(dtype, row);
                }
                let differ = ours.iter().zip(mlx.as_slice::<f32>()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{dtype:?}, length {len}: {differ} of {} differ", ours.len());
            }
        }
    }

    #[test]
    fn tempered_softmax_is_mlxs_divide_and_softmax_bit_for_bit() {
        let x = normal(&[3, 8192], 8, Dtype::Float32).multiply(Array::from_f32(5.0)).unwrap();
        let x = x.as_dtype(Dtype::Bfloat16).unwrap().as_dtype(Dtype::Float32).unwrap();
        let mlx = mlx_rs::ops::softmax_axis(x.divide(Array::from_f32(0.7)).unwrap(), -1, true).unwrap();
        let mut ours = x.as_slice::<f32>().to_vec();
        tempered_softmax_rows(&mut ours, 8192, 0.7);
        let differ = ours.iter().zip(mlx.as_slice::<f32>()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{differ} of {} differ", ours.len());
    }
}
