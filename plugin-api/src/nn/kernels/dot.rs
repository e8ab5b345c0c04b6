//! `y = x · Wᵀ`, reading each weight once: the inner loops, per weight format.
//!
//! Written by hand because neither MLX nor a BLAS does this well on the CPU: OpenBLAS packs the
//! whole weight for every product, even of one row, and MLX's bfloat16 and quantized CPU
//! kernels are generic or scalar code. Decoding reads every weight once per step, so the
//! step's time is the time to stream the weights from memory; these loops convert each loaded
//! row of W once into a buffer that stays in L1 and use it for every row of x. Each row of x is
//! summed in the same order whatever the number of rows.
//!
//! AVX2 with FMA where the CPU has it (runtime detection), a portable loop elsewhere. AVX-512
//! is not used: these loops are bound by memory, not arithmetic, and the CPUs this runs on
//! (AMD Zen 4) execute 512-bit operations as two 256-bit halves.

/// The most rows one call handles for weights MLX reads faster at many rows (quantized weights of
/// float32 activations, which go through BLAS); half-precision weights take these loops at any
/// row count (see `kernels`).
pub const MAX_ROWS: usize = 16;

/// Scales or biases of quantized weights, in the dtype the checkpoint stores.
#[derive(Clone, Copy)]
pub enum Params<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl Params<'_> {
    pub fn get(&self, i: usize) -> f32 {
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
    /// float16 bit patterns.
    F16(&'a [u16]),
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
    debug_assert!(x.len() == rows * k && y.len() == rows * n);
    #[cfg(target_arch = "x86_64")]
    {
        let features = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        if features {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { avx2::product(x, rows, k, w, outputs, n, y) };
            return;
        }
    }
    portable::product(x, rows, k, w, outputs, n, y)
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
                Weight::F16(w) => {
                    for (r, &b) in row.iter_mut().zip(&w[o * k..(o + 1) * k]) {
                        *r = half::f16::from_bits(b).to_f32();
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

    /// Rows of x and of W handled together: 4 × 2 accumulators stay in registers, and each
    /// loaded weight vector serves four rows of x, each loaded x vector two rows of W.
    const X_BLOCK: usize = 4;
    const W_BLOCK: usize = 2;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn product(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Weight,
        outputs: std::ops::Range<usize>,
        n: usize,
        y: &mut [f32],
    ) {
        let supported = match w {
            Weight::Quantized { bits, group, .. } => group.is_multiple_of(8) && (bits == 4 || bits == 8),
            _ => true,
        };
        if !supported {
            return portable::product(x, rows, k, w, outputs, n, y);
        }
        // Rows of W in another format (or of a length that is not a whole number of vectors)
        // are converted to floats once, into a buffer that stays in L1 and is padded with zeros
        // to whole vectors, and read from there by every block of x rows.
        let stride = k.next_multiple_of(8);
        let mut converted = vec![0f32; W_BLOCK * stride];
        let mut o = outputs.start;
        while o < outputs.end {
            let width = W_BLOCK.min(outputs.end - o);
            let rows_of_w = match w {
                Weight::F32(w) if stride == k => &w[o * k..(o + width) * k],
                _ => {
                    for j in 0..width {
                        convert_row(w, o + j, k, &mut converted[j * stride..j * stride + k]);
                    }
                    &converted[..width * stride]
                }
            };
            tile(x, rows, k, rows_of_w, o, width, n, y);
            o += width;
        }
    }

    /// Row r of W as floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn convert_row(w: Weight, r: usize, k: usize, out: &mut [f32]) {
        let dst = out.as_mut_ptr();
        match w {
            Weight::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            Weight::Bf16(w) => {
                let whole = k / 8 * 8;
                for i in (0..whole).step_by(8) {
                    _mm256_storeu_ps(dst.add(i), bf16x8(w.as_ptr().add(r * k + i)));
                }
                for i in whole..k {
                    out[i] = f32::from_bits((w[r * k + i] as u32) << 16);
                }
            }
            Weight::F16(w) => {
                let whole = k / 8 * 8;
                for i in (0..whole).step_by(8) {
                    let halves = _mm_loadu_si128(w.as_ptr().add(r * k + i) as *const __m128i);
                    _mm256_storeu_ps(dst.add(i), _mm256_cvtph_ps(halves));
                }
                for i in whole..k {
                    out[i] = half::f16::from_bits(w[r * k + i]).to_f32();
                }
            }
            Weight::Quantized { packed, scales, biases, bits, group } => {
                let groups = k / group;
                for g in 0..groups {
                    // MLX's dequantization: w = scale · q + bias.
                    let scale = _mm256_set1_ps(scales.get(r * groups + g));
                    let bias = _mm256_set1_ps(biases.get(r * groups + g));
                    for i in (g * group..(g + 1) * group).step_by(8) {
                        let q = if bits == 8 {
                            u8x8(packed.as_ptr().add((r * k + i) / 4))
                        } else {
                            u4x8(*packed.as_ptr().add((r * k + i) / 8))
                        };
                        _mm256_storeu_ps(dst.add(i), _mm256_fmadd_ps(q, scale, bias));
                    }
                }
            }
        }
    }

    /// y[m, o + j] = Σ_i w[j, i] · x[m, i] for the `width` rows of `w` (float32, [width, k]
    /// padded with zeros to whole vectors) and every row m of x.
    ///
    /// Element i of a row always goes to lane i mod 8 and the lanes are summed last, so a sum
    /// does not change when zeros are appended to both operands: an attention over keys padded
    /// with masked (zero-probability) slots gives what it gives over the keys alone.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile(x: &[f32], rows: usize, k: usize, w: &[f32], o: usize, width: usize, n: usize, y: &mut [f32]) {
        let stride = k.next_multiple_of(8);
        let (whole, tail) = (k / 8 * 8, k % 8);
        let mut m0 = 0;
        while m0 < rows {
            let block = X_BLOCK.min(rows - m0);
            let mut acc = [[_mm256_setzero_ps(); X_BLOCK]; W_BLOCK];
            let mut i = 0;
            while i < whole {
                let xs = std::array::from_fn(|b| x.as_ptr().wrapping_add((m0 + b.min(block - 1)) * k + i));
                accumulate(&mut acc, w.as_ptr().add(i), stride, width, block, xs);
                i += 8;
            }
            if tail > 0 {
                // The last partial vector of each x row, padded with zeros.
                let mut padded = [[0f32; 8]; X_BLOCK];
                for b in 0..block {
                    padded[b][..tail].copy_from_slice(&x[(m0 + b) * k + whole..(m0 + b + 1) * k]);
                }
                let xs = std::array::from_fn(|b| padded[b].as_ptr());
                accumulate(&mut acc, w.as_ptr().add(whole), stride, width, block, xs);
            }
            for j in 0..width {
                for b in 0..block {
                    y[(m0 + b) * n + o + j] = horizontal_sum(acc[j][b]);
                }
            }
            m0 += block;
        }
    }

    /// One vector of every (x row, W row) pair: `w` points at the first W row's vector, the
    /// others `stride` floats apart; `xs[b]` at x row b's.
    #[inline(always)]
    unsafe fn accumulate(
        acc: &mut [[__m256; X_BLOCK]; W_BLOCK],
        w: *const f32,
        stride: usize,
        width: usize,
        block: usize,
        xs: [*const f32; X_BLOCK],
    ) {
        let mut wv = [_mm256_setzero_ps(); W_BLOCK];
        for (j, v) in wv.iter_mut().enumerate().take(width) {
            *v = _mm256_loadu_ps(w.add(j * stride));
        }
        for b in 0..block {
            let xv = _mm256_loadu_ps(xs[b]);
            for j in 0..width {
                acc[j][b] = _mm256_fmadd_ps(wv[j], xv, acc[j][b]);
            }
        }
    }

    /// Eight bfloat16 values as floats: each is the top half of its float32.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bf16x8(p: *const u16) -> __m256 {
        let halves = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
    }

    /// Eight 8-bit values (two words, low byte first) as floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn u8x8(p: *const u32) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    /// The eight 4-bit values of one word (low nibble first) as floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn u4x8(word: u32) -> __m256 {
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let nibbles =
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts), _mm256_set1_epi32(0xF));
        _mm256_cvtepi32_ps(nibbles)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let quad = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
        let one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
        _mm_cvtss_f32(one)
    }
}
