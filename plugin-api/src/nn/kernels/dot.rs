//! `y = x · Wᵀ` for a few rows of x, reading each weight once: the inner loops, per weight format.
//!
//! Written by hand because neither MLX nor a BLAS does this well on the CPU: OpenBLAS packs the
//! whole weight for every product, even of one row, and MLX's bfloat16 and quantized CPU
//! kernels are generic or scalar code. Decoding reads every weight once per step, so the
//! step's time is the time to stream the weights from memory; these loops convert each loaded
//! weight vector once and use it for every row of x (up to [`MAX_ROWS`]).
//!
//! AVX2 with FMA where the CPU has it (runtime detection), a portable loop elsewhere. AVX-512
//! is not used: these loops are bound by memory, not arithmetic, and the CPUs this runs on
//! (AMD Zen 4) execute 512-bit operations as two 256-bit halves.

/// The most rows one call handles; more rows go to MLX (and BLAS).
pub const MAX_ROWS: usize = 16;

/// Scales or biases of quantized weights, in the dtype the checkpoint stores.
#[derive(Clone, Copy)]
pub enum Params<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl Params<'_> {
    fn get(&self, i: usize) -> f32 {
        match self {
            Params::F32(p) => p[i],
            Params::Bf16(p) => f32::from_bits((p[i] as u32) << 16),
            Params::F16(p) => half::f16::from_bits(p[i]).to_f32(),
        }
    }
}

/// A weight matrix [n, k], row-major.
#[derive(Clone, Copy)]
pub enum Weight<'a> {
    F32(&'a [f32]),
    /// bfloat16 bit patterns.
    Bf16(&'a [u16]),
    /// MLX affine quantization: row o holds k / (32 / bits) words, low bits first; one scale
    /// and bias per `group` weights: w = scale · q + bias.
    Quantized {
        packed: &'a [u32],
        scales: Params<'a>,
        biases: Params<'a>,
        bits: u32,
        group: usize,
    },
}

/// Computes y[m, o] for outputs `outputs` (a range of rows of W) and every row m of x [rows, k];
/// y is [rows, n] and only its `outputs` columns are written.
pub fn product(x: &[f32], rows: usize, k: usize, w: Weight, outputs: std::ops::Range<usize>, n: usize, y: &mut [f32]) {
    debug_assert!(rows <= MAX_ROWS && x.len() == rows * k && y.len() == rows * n);
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { avx2::product(x, rows, k, w, outputs, n, y) };
            return;
        }
    }
    portable::product(x, rows, k, w, outputs, n, y)
}

/// Per row m and group g, the sum of x over the group (the bias term of affine quantization).
fn group_sums(x: &[f32], rows: usize, k: usize, group: usize) -> Vec<f32> {
    let groups = k / group;
    let mut sums = vec![0.0; rows * groups];
    for m in 0..rows {
        for g in 0..groups {
            sums[m * groups + g] = x[m * k + g * group..m * k + (g + 1) * group].iter().sum();
        }
    }
    sums
}

pub(super) mod portable {
    use super::*;

    pub fn product(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Weight,
        outputs: std::ops::Range<usize>,
        n: usize,
        y: &mut [f32],
    ) {
        let mut row = vec![0f32; k];
        for o in outputs {
            match w {
                Weight::F32(w) => row.copy_from_slice(&w[o * k..(o + 1) * k]),
                Weight::Bf16(w) => {
                    for (r, &b) in row.iter_mut().zip(&w[o * k..(o + 1) * k]) {
                        *r = f32::from_bits((b as u32) << 16);
                    }
                }
                Weight::Quantized { packed, scales, biases, bits, group } => {
                    let per_word = (32 / bits) as usize;
                    let words = &packed[o * k / per_word..(o + 1) * k / per_word];
                    let mask = (1u32 << bits) - 1;
                    for (i, r) in row.iter_mut().enumerate() {
                        let q = (words[i / per_word] >> (bits as usize * (i % per_word))) & mask;
                        let g = o * (k / group) + i / group;
                        *r = scales.get(g) * q as f32 + biases.get(g);
                    }
                }
            }
            for m in 0..rows {
                y[m * n + o] = row.iter().zip(&x[m * k..(m + 1) * k]).map(|(a, b)| a * b).sum();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    /// Rows of x handled together: their accumulators stay in registers next to the weights.
    const BLOCK: usize = 4;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn product(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Weight,
        outputs: std::ops::Range<usize>,
        n: usize,
        y: &mut [f32],
    ) {
        if !k.is_multiple_of(8) {
            return portable::product(x, rows, k, w, outputs, n, y);
        }
        match w {
            Weight::F32(w) => {
                for o in outputs {
                    let row = w.as_ptr().add(o * k);
                    dense_row(x, rows, k, |i| _mm256_loadu_ps(row.add(i)), o, n, y);
                }
            }
            Weight::Bf16(w) => {
                for o in outputs {
                    let row = w.as_ptr().add(o * k);
                    let load = |i: usize| {
                        let halves = _mm_loadu_si128(row.add(i) as *const __m128i);
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
                    };
                    dense_row(x, rows, k, load, o, n, y);
                }
            }
            Weight::Quantized { packed, scales, biases, bits, group } => {
                if !group.is_multiple_of(8) || (bits != 4 && bits != 8) {
                    return portable::product(x, rows, k, w, outputs, n, y);
                }
                let sums = group_sums(x, rows, k, group);
                for o in outputs {
                    quantized_row(x, rows, k, packed, scales, biases, bits, group, &sums, o, n, y);
                }
            }
        }
    }

    /// y[m, o] = Σ_i w[o, i] · x[m, i], with `load(i)` giving w[o, i..i+8] as floats.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dense_row(
        x: &[f32],
        rows: usize,
        k: usize,
        load: impl Fn(usize) -> __m256,
        o: usize,
        n: usize,
        y: &mut [f32],
    ) {
        let mut m0 = 0;
        while m0 < rows {
            let block = BLOCK.min(rows - m0);
            let mut acc = [_mm256_setzero_ps(); BLOCK];
            let mut i = 0;
            while i < k {
                let wv = load(i);
                for (b, a) in acc.iter_mut().enumerate().take(block) {
                    let xv = _mm256_loadu_ps(x.as_ptr().add((m0 + b) * k + i));
                    *a = _mm256_fmadd_ps(wv, xv, *a);
                }
                i += 8;
            }
            for (b, a) in acc.iter().enumerate().take(block) {
                y[(m0 + b) * n + o] = horizontal_sum(*a);
            }
            m0 += block;
        }
    }

    /// One output of affine-quantized W: Σ_g scale_g · Σ_{i∈g} q_i x_i + bias_g · Σ_{i∈g} x_i.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn quantized_row(
        x: &[f32],
        rows: usize,
        k: usize,
        packed: &[u32],
        scales: Params,
        biases: Params,
        bits: u32,
        group: usize,
        sums: &[f32],
        o: usize,
        n: usize,
        y: &mut [f32],
    ) {
        let groups = k / group;
        let per_word = (32 / bits) as usize;
        let words = packed.as_ptr().add(o * k / per_word);
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let nibble = _mm256_set1_epi32(0xF);
        // Eight weights as floats from word offset `i / per_word`.
        let load = |i: usize| -> __m256 {
            if bits == 8 {
                let bytes = _mm_loadl_epi64(words.add(i / 4) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes))
            } else {
                let word = _mm256_set1_epi32(*words.add(i / 8) as i32);
                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shifts), nibble))
            }
        };
        let mut m0 = 0;
        while m0 < rows {
            let block = BLOCK.min(rows - m0);
            let mut total = [_mm256_setzero_ps(); BLOCK];
            let mut bias_terms = [0f32; BLOCK];
            for g in 0..groups {
                let scale = scales.get(o * groups + g);
                let bias = biases.get(o * groups + g);
                let mut acc = [_mm256_setzero_ps(); BLOCK];
                let mut i = g * group;
                while i < (g + 1) * group {
                    let qv = load(i);
                    for (b, a) in acc.iter_mut().enumerate().take(block) {
                        let xv = _mm256_loadu_ps(x.as_ptr().add((m0 + b) * k + i));
                        *a = _mm256_fmadd_ps(qv, xv, *a);
                    }
                    i += 8;
                }
                let s = _mm256_set1_ps(scale);
                for b in 0..block {
                    total[b] = _mm256_fmadd_ps(s, acc[b], total[b]);
                    bias_terms[b] += bias * sums[(m0 + b) * groups + g];
                }
            }
            for b in 0..block {
                y[(m0 + b) * n + o] = horizontal_sum(total[b]) + bias_terms[b];
            }
            m0 += block;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
        let one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
        _mm_cvtss_f32(one)
    }
}
