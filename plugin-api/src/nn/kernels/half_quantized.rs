//! Quantized weights times half-precision activations, computed exactly as MLX's CPU kernel
//! computes them, only faster.
//!
//! MLX (`_qmm_t` in mlx/backend/cpu/quantized.cpp) computes each output in the activation
//! dtype: for every weight in order, `sum += x · (scale · q + bias)`, each of the four
//! operations rounded to bfloat16 (or float16) as it is made (measured: this reproduces MLX bit
//! for bit, forming any of them in float32 does not). That rounding makes the result depend on
//! the order, so it cannot be summed any other way without changing mlx-lm's greedy tokens. MLX does it one output at a time in scalar code;
//! here eight outputs (rows of W) run in the eight lanes of an AVX2 register, each lane still
//! adding its weights one by one in MLX's order and rounding after each addition.

use super::dot::Params;

/// The activation dtype whose rounding the sums follow.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Half {
    Bf16,
    F16,
}

/// A quantized weight [n, k] as MLX stores it.
#[derive(Clone, Copy)]
pub struct Quantized<'a> {
    pub packed: &'a [u32],
    pub scales: Params<'a>,
    pub biases: Params<'a>,
    pub bits: u32,
    pub group: usize,
}

/// y[m, o] for o in `outputs` and every row m of x [rows, k] (x's values are exact in `half`).
#[allow(clippy::too_many_arguments)]
pub fn product(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Quantized,
    half: Half,
    outputs: std::ops::Range<usize>,
    n: usize,
    y: &mut [f32],
) {
    let mut o = outputs.start;
    #[cfg(target_arch = "x86_64")]
    {
        let lanes_fit = w.bits == 4 || w.bits == 8;
        if lanes_fit && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("f16c") {
            while o + 8 <= outputs.end {
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                unsafe { avx2::eight_outputs(x, rows, k, w, half, o, n, y) };
                o += 8;
            }
        }
    }
    for o in o..outputs.end {
        for m in 0..rows {
            y[m * n + o] = one_output(&x[m * k..(m + 1) * k], k, w, half, o);
        }
    }
}

/// One output, element by element: the reference the lanes follow.
pub fn one_output(x: &[f32], k: usize, w: Quantized, half: Half, o: usize) -> f32 {
    let per_word = (32 / w.bits) as usize;
    let mask = (1u32 << w.bits) - 1;
    let groups = k / w.group;
    let mut sum = 0f32;
    for (i, &xi) in x.iter().enumerate().take(k) {
        let q = (w.packed[(o * k + i) / per_word] >> (w.bits as usize * (i % per_word))) & mask;
        let g = o * groups + i / w.group;
        let weight = round(half, round(half, w.scales.get(g) * q as f32) + w.biases.get(g));
        sum = round(half, sum + round(half, xi * weight));
    }
    sum
}

fn round(half: Half, v: f32) -> f32 {
    match half {
        Half::Bf16 => {
            let bits = v.to_bits();
            let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
            f32::from_bits(rounded)
        }
        Half::F16 => ::half::f16::from_f32(v).to_f32(),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    /// Rows of x whose sums stay in registers together.
    const X_BLOCK: usize = 4;

    /// Outputs o..o+8, one per lane.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop, reason = "lanes and rows read best by index")]
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn eight_outputs(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Quantized,
        half: Half,
        o: usize,
        n: usize,
        y: &mut [f32],
    ) {
        let per_word = (32 / w.bits) as usize;
        let words_per_row = (k / per_word) as i32;
        let groups = k / w.group;
        let row_offsets =
            _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(words_per_row));
        let mask = _mm256_set1_epi32(((1u32 << w.bits) - 1) as i32);
        let base = w.packed.as_ptr().add(o * k / per_word) as *const i32;
        let mut m0 = 0;
        while m0 < rows {
            let block = X_BLOCK.min(rows - m0);
            let mut sums = [_mm256_setzero_ps(); X_BLOCK];
            for g in 0..groups {
                let scale = per_lane(w.scales, o, groups, g);
                let bias = per_lane(w.biases, o, groups, g);
                let mut word = g * w.group / per_word;
                while word < (g + 1) * w.group / per_word {
                    // The same word of each of the eight rows.
                    let words = _mm256_i32gather_epi32::<4>(base.add(word), row_offsets);
                    for p in 0..per_word {
                        let q = _mm256_and_si256(
                            _mm256_srlv_epi32(words, _mm256_set1_epi32((p as u32 * w.bits) as i32)),
                            mask,
                        );
                        let scaled = round8(half, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)));
                        let weight = round8(half, _mm256_add_ps(scaled, bias));
                        let i = word * per_word + p;
                        for b in 0..block {
                            let xi = _mm256_set1_ps(*x.get_unchecked((m0 + b) * k + i));
                            let product = round8(half, _mm256_mul_ps(xi, weight));
                            sums[b] = round8(half, _mm256_add_ps(sums[b], product));
                        }
                    }
                    word += 1;
                }
            }
            for (b, sum) in sums.iter().enumerate().take(block) {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), *sum);
                for (j, &v) in lanes.iter().enumerate() {
                    y[(m0 + b) * n + o + j] = v;
                }
            }
            m0 += block;
        }
    }

    /// Group g's parameter of rows o..o+8, one per lane.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn per_lane(params: Params, o: usize, groups: usize, g: usize) -> __m256 {
        let mut lanes = [0f32; 8];
        for (j, lane) in lanes.iter_mut().enumerate() {
            *lane = params.get((o + j) * groups + g);
        }
        _mm256_loadu_ps(lanes.as_ptr())
    }

    /// Rounds each lane to the nearest bfloat16 or float16 (ties to even), kept as float32.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn round8(half: Half, v: __m256) -> __m256 {
        match half {
            Half::Bf16 => {
                let bits = _mm256_castps_si256(v);
                let odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
                let rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
                _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(0xFFFF_0000u32 as i32)))
            }
            Half::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
        }
    }
}
