//! Vector passes over a vocabulary (a quarter of a megabyte of logits, or a megabyte at Gemma
//! 4's size), for the host's sampling: each chunk's largest value, the tokens at or above a
//! value, exponentials and their sum by MLX's own exponential, and per-token flags.

use crate::exp::mlx_exp;

/// Tokens per chunk of [`chunk_maxima`].
pub const CHUNK: usize = 64;

/// The largest value of each `CHUNK` of `values` (-inf for a chunk of removed tokens).
pub fn chunk_maxima(values: &[f32]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { chunk_maxima_avx2(values) };
    }
    chunk_maxima_body(values)
}

/// The finite tokens of `values` at or above `cut`, in token order.
pub fn at_or_above(values: &[f32], cut: f32) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { at_or_above_avx2(values, cut) };
    }
    at_or_above_body(values, cut)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_maxima_avx2(values: &[f32]) -> Vec<f32> {
    chunk_maxima_body(values)
}

/// [`at_or_above_body`] with each eight values' comparison read as eight bits of a mask.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn at_or_above_avx2(values: &[f32], cut: f32) -> Vec<u32> {
    use std::arch::x86_64::*;
    let mut tokens = Vec::new();
    let (cut8, removed8) = (_mm256_set1_ps(cut), _mm256_set1_ps(f32::NEG_INFINITY));
    let mut eights = values.chunks_exact(8);
    for (w, eight) in (&mut eights).enumerate() {
        let x = _mm256_loadu_ps(eight.as_ptr());
        let kept = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, cut8), _mm256_cmp_ps::<_CMP_NEQ_OQ>(x, removed8));
        let mut bits = _mm256_movemask_ps(kept) as u32;
        while bits != 0 {
            tokens.push((w * 8) as u32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    let rest = values.len() - eights.remainder().len();
    tokens.extend(at_or_above_body(eights.remainder(), cut).into_iter().map(|t| t + rest as u32));
    tokens
}

fn lane_max(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// Eight running maxima a chunk, one per lane of a vector, then the eight's.
#[inline(always)]
fn chunk_maxima_body(values: &[f32]) -> Vec<f32> {
    values
        .chunks(CHUNK)
        .map(|chunk| {
            let mut lanes = [f32::NEG_INFINITY; 8];
            let mut rows = chunk.chunks_exact(8);
            for row in &mut rows {
                for (m, &x) in lanes.iter_mut().zip(row) {
                    *m = lane_max(*m, x);
                }
            }
            rows.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, lane_max)
        })
        .collect()
}

fn at_or_above_body(values: &[f32], cut: f32) -> Vec<u32> {
    (0..values.len() as u32).filter(|&t| values[t as usize] >= cut && values[t as usize] > f32::NEG_INFINITY).collect()
}

/// The positions of the non-zero bytes of `flags` (each 0 or 1), read eight at a time.
#[inline(always)]
pub fn set_flags(flags: &[u8]) -> impl Iterator<Item = usize> + '_ {
    flags.chunks(8).enumerate().flat_map(|(w, eight)| {
        let mut word = [0u8; 8];
        word[..eight.len()].copy_from_slice(eight);
        let mut bits = u64::from_le_bytes(word);
        std::iter::from_fn(move || {
            let byte = (bits != 0).then(|| bits.trailing_zeros() as usize / 8)?;
            bits &= bits - 1;
            Some(w * 8 + byte)
        })
    })
}

/// `flags[j] = reaches(first + j)` for every j, compiled for the widest vectors the CPU has:
/// `reaches` should be branch-free arithmetic (a hash compared with a bound), which then hashes
/// eight tokens at once with AVX-512's 64-bit multiplies.
pub fn flags_where<F: Fn(u64) -> bool + Copy>(first: u64, flags: &mut [u8], reaches: F) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::simd::has!("avx512f") && crate::simd::has!("avx512dq") {
            // SAFETY: the CPU has AVX-512 F and DQ (checked above).
            return unsafe { flags_where_avx512(first, flags, reaches) };
        }
        if crate::simd::has!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above).
            return unsafe { flags_where_avx2(first, flags, reaches) };
        }
    }
    flags_where_body(first, flags, reaches)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx512bw")]
unsafe fn flags_where_avx512<F: Fn(u64) -> bool + Copy>(first: u64, flags: &mut [u8], reaches: F) {
    flags_where_body(first, flags, reaches)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn flags_where_avx2<F: Fn(u64) -> bool + Copy>(first: u64, flags: &mut [u8], reaches: F) {
    flags_where_body(first, flags, reaches)
}

#[inline(always)]
fn flags_where_body<F: Fn(u64) -> bool + Copy>(first: u64, flags: &mut [u8], reaches: F) {
    for (j, flag) in flags.iter_mut().enumerate() {
        *flag = reaches(first + j as u64) as u8;
    }
}

/// `out[i] = exp(values[i])` by MLX's float32 exponential, eight at a time where the CPU has
/// AVX2: a sampler's masses otherwise cost a C library call per token.
pub fn exponentials(values: &[f32], out: &mut [f32]) {
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") && crate::simd::has!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        done = unsafe { exponentials_avx2(values, out) };
    }
    for (e, &x) in out[done..].iter_mut().zip(&values[done..]) {
        *e = mlx_exp(x);
    }
}

/// [`exponentials`] of whole runs of eight; returns how many it wrote. (The loop sits in a
/// function of its own so that the intrinsics compile inline, with the features enabled.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exponentials_avx2(values: &[f32], out: &mut [f32]) -> usize {
    use std::arch::x86_64::*;
    let done = values.len().min(out.len()) / 8 * 8;
    for i in (0..done).step_by(8) {
        // SAFETY: i + 8 <= both lengths.
        let e = crate::exp::mlx_exp8(_mm256_loadu_ps(values.as_ptr().add(i)));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), e);
    }
    done
}

/// Σ exp(x − max) over `values`: each exponential MLX's float32 one, summed in double
/// precision in eight interleaved partial sums (value i into sum i mod 8, then the eight in
/// order), a fixed order that vectorizes. A libm exponential in double precision per token cost
/// a third of sampling from a 262,144-token vocabulary.
pub fn exp_sum(values: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") && crate::simd::has!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { exp_sum_avx2(values, max) };
    }
    exp_sum_body(values, max)
}

/// [`exp_sum`] eight values a vector: the same results.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(values: &[f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let mut sums = [_mm256_setzero_pd(); 2];
    let mut chunks = values.chunks_exact(8);
    for chunk in &mut chunks {
        let exps = crate::exp::mlx_exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), _mm256_set1_ps(max)));
        sums[0] = _mm256_add_pd(sums[0], _mm256_cvtps_pd(_mm256_castps256_ps128(exps)));
        sums[1] = _mm256_add_pd(sums[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(exps)));
    }
    let mut lanes = [0f64; 8];
    _mm256_storeu_pd(lanes.as_mut_ptr(), sums[0]);
    _mm256_storeu_pd(lanes.as_mut_ptr().add(4), sums[1]);
    add_remainder(lanes, chunks.remainder(), max)
}

fn exp_sum_body(values: &[f32], max: f32) -> f64 {
    let mut sums = [0f64; 8];
    let mut chunks = values.chunks_exact(8);
    for chunk in &mut chunks {
        for (sum, &x) in sums.iter_mut().zip(chunk) {
            *sum += mlx_exp(x - max) as f64;
        }
    }
    add_remainder(sums, chunks.remainder(), max)
}

/// The partial sums with the last (fewer than eight) values added, then summed in order.
fn add_remainder(mut sums: [f64; 8], remainder: &[f32], max: f32) -> f64 {
    for (sum, &x) in sums.iter_mut().zip(remainder) {
        *sum += mlx_exp(x - max) as f64;
    }
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_passes_equal_plain_loops() {
        for n in [0usize, 1, 7, 63, 64, 65, 1000, 4099] {
            let values: Vec<f32> = (0..n)
                .map(|i| match i % 11 {
                    3 => f32::NEG_INFINITY,
                    _ => ((i * 7919 % 4001) as f32 - 2000.0) / 100.0,
                })
                .collect();
            let maxima: Vec<f32> =
                values.chunks(CHUNK).map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
            assert_eq!(chunk_maxima(&values), maxima, "{n} values");
            assert_eq!(chunk_maxima_body(&values), maxima, "{n} values");
            for cut in [f32::NEG_INFINITY, -5.0, 0.0, 19.0] {
                let above: Vec<u32> = (0..n as u32)
                    .filter(|&t| values[t as usize] >= cut && values[t as usize] > f32::NEG_INFINITY)
                    .collect();
                assert_eq!(at_or_above(&values, cut), above, "{n} values, cut {cut}");
                assert_eq!(at_or_above_body(&values, cut), above, "{n} values, cut {cut}");
            }
        }
    }

    #[test]
    fn the_vector_exponential_sum_is_the_scalar_one() {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has!("avx2") && crate::simd::has!("fma") {
            for n in [0, 5, 8, 13, 1000, 4099] {
                let values: Vec<f32> = (0..n).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) / 10.0).collect();
                let max = values.iter().copied().fold(0f32, f32::max);
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                let vector = unsafe { exp_sum_avx2(&values, max) };
                assert_eq!(vector.to_bits(), exp_sum_body(&values, max).to_bits(), "{n} values");
            }
        }
    }

    #[test]
    fn flags_are_set_where_the_test_holds_on_every_route() {
        let reaches = |t: u64| (t.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 61) >= 4;
        let mut flags = vec![0u8; 1000];
        flags_where(17, &mut flags, reaches);
        let mut plain = vec![0u8; 1000];
        flags_where_body(17, &mut plain, reaches);
        assert_eq!(flags, plain);
        assert!(flags.contains(&0) && flags.contains(&1));
    }
}
