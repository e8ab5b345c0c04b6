//! Weights widened to float32 eight at a time with AVX2, and the weight's rows asked for ahead
//! of the loops that read them: shared by the AVX2 product loops.

use std::arch::x86_64::*;

use crate::weight::{Params, Quantized, Weight};

/// Asks for W's rows `rows` (the next block) to be brought into cache while the current
/// block is multiplied: each weight is read once per product, so it comes from memory, and
/// a block of a few hundred bytes per row is done before the hardware prefetcher catches
/// up: without the request, each block would start by waiting on memory.
#[inline(always)]
pub unsafe fn prefetch_rows(w: Weight, k: usize, rows: std::ops::Range<usize>) {
    let (base, row_bytes) = match w {
        Weight::F32(w) => (w.as_ptr() as *const u8, k * 4),
        Weight::Bf16(w) | Weight::F16(w) => (w.as_ptr() as *const u8, k * 2),
        Weight::Quantized(w) => (w.packed.as_ptr() as *const u8, k * w.bits as usize / 8),
    };
    for at in (rows.start * row_bytes..rows.end * row_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(base.add(at) as *const i8);
    }
}

/// Asks for the scales and biases of W's rows `rows` (of `k`) into the cache level `HINT`
/// names, while the rows before them are multiplied: each is read once per product, so it comes
/// from memory.
#[inline(always)]
pub fn prefetch_params<const HINT: i32>(w: &Quantized, k: usize, rows: std::ops::Range<usize>) {
    let groups = k / w.group;
    for params in [w.scales, w.biases] {
        let (base, size) = match params {
            Params::F32(p) => (p.as_ptr() as *const u8, 4),
            Params::Bf16(p) | Params::F16(p) => (p.as_ptr() as *const u8, 2),
        };
        for at in (rows.start * groups * size..rows.end * groups * size).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe { _mm_prefetch::<HINT>(base.wrapping_add(at) as *const i8) };
        }
    }
}

/// Eight bfloat16 values as floats: each is the top half of its float32.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bf16x8(p: *const u16) -> __m256 {
    let halves = _mm_loadu_si128(p as *const __m128i);
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
}

/// Eight float16 values as floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16x8(p: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// `out.len()` half-precision values of W (bfloat16 or float16 bits) from element `from`, as
/// floats: eight at a time, the tail one by one.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn halves(w: Weight, from: usize, out: &mut [f32]) {
    let (dst, whole) = (out.as_mut_ptr(), out.len() / 8 * 8);
    match w {
        Weight::Bf16(w) => {
            let w = &w[from..from + out.len()];
            for i in (0..whole).step_by(8) {
                _mm256_storeu_ps(dst.add(i), bf16x8(w.as_ptr().add(i)));
            }
            for (o, &b) in out[whole..].iter_mut().zip(&w[whole..]) {
                *o = f32::from_bits((b as u32) << 16);
            }
        }
        Weight::F16(w) => {
            let w = &w[from..from + out.len()];
            for i in (0..whole).step_by(8) {
                _mm256_storeu_ps(dst.add(i), f16x8(w.as_ptr().add(i)));
            }
            for (o, &b) in out[whole..].iter_mut().zip(&w[whole..]) {
                *o = half::f16::from_bits(b).to_f32();
            }
        }
        Weight::F32(_) | Weight::Quantized(_) => unreachable!("half-precision weights only"),
    }
}

/// Eight 8-bit values (two words, low byte first) as floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn u8x8(p: *const u32) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// The eight 4-bit values of one word (low nibble first) as floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn u4x8(word: u32) -> __m256 {
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts), _mm256_set1_epi32(0xF));
    _mm256_cvtepi32_ps(nibbles)
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn horizontal_sum(v: __m256) -> f32 {
    let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    let one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
    _mm_cvtss_f32(one)
}

/// `out.len()` parameters from `first` as floats, eight at a time where they are half precision.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn widen_params(params: Params, first: usize, out: &mut [f32]) {
    let whole = out.len() / 8 * 8;
    match params {
        Params::F32(p) => out.copy_from_slice(&p[first..first + out.len()]),
        Params::Bf16(p) | Params::F16(p) => {
            let p = &p[first..first + out.len()];
            for i in (0..whole).step_by(8) {
                let v = match params {
                    Params::Bf16(_) => bf16x8(p.as_ptr().add(i)),
                    _ => f16x8(p.as_ptr().add(i)),
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
            for (i, o) in out.iter_mut().enumerate().skip(whole) {
                *o = params.get(first + i);
            }
        }
    }
}

/// Σ_g biases[g] · sums[g], eight lanes at a time and the lanes added last, then the tail.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn bias_terms(biases: &[f32], sums: &[f32]) -> f32 {
    let whole = biases.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for g in (0..whole).step_by(8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(biases.as_ptr().add(g)), _mm256_loadu_ps(sums.as_ptr().add(g)), acc);
    }
    let mut total = horizontal_sum(acc);
    for g in whole..biases.len() {
        total = biases[g].mul_add(sums[g], total);
    }
    total
}
