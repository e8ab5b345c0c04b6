//! Quantized weights times half-precision activations, computed exactly as MLX's CPU kernel
//! computes them, only faster.
//!
//! MLX (`_qmm_t` in mlx/backend/cpu/quantized.cpp) computes each output in the activation
//! dtype: for every weight in order, `sum += x · (scale · q + bias)`, each of the four
//! operations rounded to bfloat16 (or float16) as it is made (measured: this reproduces MLX bit
//! for bit, forming any of them in float32 does not). That rounding makes the result depend on
//! the order, so it cannot be summed any other way without changing mlx-lm's greedy tokens. MLX
//! does it one output at a time in scalar code; here outputs (rows of W) run in the lanes of
//! vector registers, sixteen to an AVX-512 register or eight to an AVX2 one, each lane still
//! adding its weights one by one in MLX's order and rounding after each addition. No crate or
//! BLAS computes a product with this rounding, hence the hand-written loops.

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
        if lanes_fit && avx512::available() {
            while o + avx512::OUTPUTS <= outputs.end {
                // SAFETY: the CPU has AVX-512F (checked above).
                unsafe { avx512::thirty_two_outputs(x, rows, k, w, half, o, n, y) };
                o += avx512::OUTPUTS;
            }
        }
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

/// Group g's scale or bias of rows o..o + N of W, one per lane.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn group_parameters<const N: usize>(params: Params, o: usize, groups: usize, g: usize) -> [f32; N] {
    let mut lanes = [0f32; N];
    for (j, lane) in lanes.iter_mut().enumerate() {
        *lane = params.get((o + j) * groups + g);
    }
    lanes
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
        _mm256_loadu_ps(group_parameters::<8>(params, o, groups, g).as_ptr())
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

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::*;

    /// Outputs per call: two registers of sixteen lanes. Each lane's additions wait for one
    /// another (a sum is rounded before the next weight joins it), so two registers' chains
    /// interleave to keep the vector units busy through a one-token step.
    pub const OUTPUTS: usize = 32;
    const LANES: usize = 16;
    /// Rows of x whose sums stay in registers together, sharing each dequantized weight.
    const X_BLOCK: usize = 4;

    pub fn available() -> bool {
        std::is_x86_feature_detected!("avx512f")
    }

    /// Outputs o..o + 32, one per lane, of every row of x.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn thirty_two_outputs(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Quantized,
        half: Half,
        o: usize,
        n: usize,
        y: &mut [f32],
    ) {
        match (w.bits, half) {
            (4, Half::Bf16) => every_row::<4, true>(x, rows, k, w, o, n, y),
            (4, Half::F16) => every_row::<4, false>(x, rows, k, w, o, n, y),
            (8, Half::Bf16) => every_row::<8, true>(x, rows, k, w, o, n, y),
            _ => every_row::<8, false>(x, rows, k, w, o, n, y),
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn every_row<const BITS: u32, const BF16: bool>(
        x: &[f32],
        rows: usize,
        k: usize,
        w: Quantized,
        o: usize,
        n: usize,
        y: &mut [f32],
    ) {
        let mut m = 0;
        while m < rows {
            let block = X_BLOCK.min(rows - m);
            let at = Block { x, k, w, o, n, m };
            match block {
                1 => at.run::<1, BITS, BF16>(y),
                2 => at.run::<2, BITS, BF16>(y),
                3 => at.run::<3, BITS, BF16>(y),
                _ => at.run::<4, BITS, BF16>(y),
            }
            m += block;
        }
    }

    /// Rows m.. of x times outputs o..o + 32.
    struct Block<'a> {
        x: &'a [f32],
        k: usize,
        w: Quantized<'a>,
        o: usize,
        n: usize,
        m: usize,
    }

    impl Block<'_> {
        #[allow(clippy::needless_range_loop, reason = "registers and rows read best by index")]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const ROWS: usize, const BITS: u32, const BF16: bool>(&self, y: &mut [f32]) {
            let Block { x, k, w, o, n, m } = *self;
            let per_word = (32 / BITS) as usize;
            let words_per_row = k / per_word;
            let groups = k / w.group;
            let lane_rows = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(words_per_row as i32),
            );
            let mask = _mm512_set1_epi32(((1u32 << BITS) - 1) as i32);
            let packed = w.packed.as_ptr() as *const i32;
            let bases = [packed.add(o * words_per_row), packed.add((o + LANES) * words_per_row)];
            let mut sums = [[_mm512_setzero_ps(); ROWS]; 2];
            for g in 0..groups {
                let scales = [per_lane(w.scales, o, groups, g), per_lane(w.scales, o + LANES, groups, g)];
                let biases = [per_lane(w.biases, o, groups, g), per_lane(w.biases, o + LANES, groups, g)];
                for word in g * w.group / per_word..(g + 1) * w.group / per_word {
                    // The same word of each register's sixteen rows of W.
                    let words = [
                        _mm512_i32gather_epi32::<4>(lane_rows, bases[0].add(word)),
                        _mm512_i32gather_epi32::<4>(lane_rows, bases[1].add(word)),
                    ];
                    for p in 0..per_word {
                        let shift = _mm512_set1_epi32((p as u32 * BITS) as i32);
                        let mut weights = [_mm512_setzero_ps(); 2];
                        for r in 0..2 {
                            let q = _mm512_and_si512(_mm512_srlv_epi32(words[r], shift), mask);
                            let scaled = round::<BF16>(_mm512_mul_ps(scales[r], _mm512_cvtepi32_ps(q)));
                            weights[r] = round::<BF16>(_mm512_add_ps(scaled, biases[r]));
                        }
                        let i = word * per_word + p;
                        for b in 0..ROWS {
                            let xi = _mm512_set1_ps(*x.get_unchecked((m + b) * k + i));
                            for r in 0..2 {
                                let product = round::<BF16>(_mm512_mul_ps(xi, weights[r]));
                                sums[r][b] = round::<BF16>(_mm512_add_ps(sums[r][b], product));
                            }
                        }
                    }
                }
            }
            for b in 0..ROWS {
                for r in 0..2 {
                    let at = &mut y[(m + b) * n + o + r * LANES..(m + b) * n + o + (r + 1) * LANES];
                    _mm512_storeu_ps(at.as_mut_ptr(), sums[r][b]);
                }
            }
        }
    }

    /// Group g's parameter of rows o..o + 16, one per lane.
    #[target_feature(enable = "avx512f")]
    unsafe fn per_lane(params: Params, o: usize, groups: usize, g: usize) -> __m512 {
        _mm512_loadu_ps(group_parameters::<LANES>(params, o, groups, g).as_ptr())
    }

    /// Rounds each lane to the nearest bfloat16 (BF16) or float16 (ties to even), kept as
    /// float32. bfloat16 rounds by integer arithmetic on the bits, exactly as MLX's software
    /// conversion does, subnormals included (VCVTNEPS2BF16 would flush those).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn round<const BF16: bool>(v: __m512) -> __m512 {
        if BF16 {
            let bits = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
            _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(0xFFFF_0000u32 as i32)))
        } else {
            _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
        }
    }
}
