//! MLX affine-quantized weights (4 and 8 bits) on AVX2 with activations rounded to 8-bit
//! integers, as llama.cpp computes its quantized formats: the route of
//! [`super::dot::product`] for quantized weights on x86 CPUs with AVX2 (AVX-512 ones too) when
//! `HOST_QUANTIZED_ACTIVATIONS=int8` asks for it ([`crate::simd::ACTIVATIONS_ENV`]), at every
//! row count. Weights repacked for AMX tiles keep the tile unit (`HOST_AMX=off` to use these;
//! without the unit, quantized weights then keep MLX's layout for these loops).
//!
//! Why: dequantizing each weight to float32 (w = scale · q + bias) and multiplying it in takes
//! five or six AVX2 operations per eight weights, which bounds a 4-bit product at about half of
//! what memory delivers. Here each row of x is rounded once per call to 8-bit
//! integers, a scale per block of 32, and `vpmaddubsw` multiplies 32 weight bytes by 32
//! activation bytes and adds them in pairs in one operation. For one weight group,
//!
//! Σ (s·q + b)·x = s · Σ q·x + b · Σ x  ≈  s · Σ_blocks d · Σ q·xq + b · Σ x,
//!
//! with Σ x summed from the float32 values. The approximation is xq = round(x / d), d the
//! block's largest |x| / 127: up to 1/254 of that value per activation. It is not the default:
//! on the small random checkpoints of the parity tests it moves logits by up to 2.9 from
//! mlx-lm's, where the float32 loops stay within 0.004 (host/tests/gemma4_parity.rs). Users
//! who accept llama.cpp's trade for its speed ask for it.
//!
//! 4-bit weights are read 64 at a time (32 bytes): the low nibbles are the even elements and
//! the high ones the odd, so each row of x is rounded into the same order: per 64 elements, the
//! 32 even ones, then the 32 odd ones. 8-bit weights are unsigned (0 to 255), past what
//! `vpmaddubsw` may add in pairs without saturating, so they are taken as q − 128 (signed) by
//! the sign trick llama.cpp uses, and the 128 · s · Σ x that moves goes to the bias term.
//!
//! Each output is summed the same way whatever the tile it falls in or the number of rows, so a
//! row gives the same result alone, in a verify window or in a batch: speculative decoding on
//! this route equals plain decoding on it.

use std::arch::x86_64::*;

use crate::weight::Quantized;
use crate::widen_avx2::{bias_terms, widen_params};

/// Activations share one scale per this many elements.
const BLOCK: usize = 32;
/// Rows of x whose quantized values stay in L2 while every row of W passes over them.
const PANEL: usize = 64;

/// Whether these loops serve: asked for, and the CPU has AVX2, FMA and F16C.
pub fn available() -> bool {
    crate::simd::int8_activations()
        && crate::simd::has!("avx2")
        && crate::simd::has!("fma")
        && crate::simd::has!("f16c")
}

/// Whether these loops take `w` with rows of `k`: 4 or 8 bits, groups of whole blocks (a
/// power of two, as MLX's are), and rows of whole 32-byte loads.
pub fn takes(w: &Quantized, k: usize) -> bool {
    w.group.is_multiple_of(BLOCK)
        && w.group.is_power_of_two()
        && match w.bits {
            4 => k.is_multiple_of(64),
            8 => k.is_multiple_of(32),
            _ => false,
        }
}

/// x's rows as the loops read them.
struct Activations {
    /// Each row's integers, in the weights' element order (see the module's notes).
    q: Vec<i8>,
    /// Each block's scale d: for 4 bits, per 32-byte load of weights (two blocks) eight floats,
    /// each block's repeated over the four lanes its products land in; for 8 bits, one per
    /// block (one load).
    d: Vec<f32>,
    /// Per row and weight group, Σ x, for the bias terms.
    sums: Vec<f32>,
}

/// Floats of [`Activations::d`] per load of weights.
const fn d_per_load(bits: u32) -> usize {
    if bits == 4 {
        8
    } else {
        1
    }
}

/// Rounds every row of x [rows, k] for weights of `bits` in groups of `group`.
fn quantize(x: &[f32], rows: usize, k: usize, bits: u32, group: usize) -> Activations {
    let per_load = if bits == 4 { 64 } else { 32 };
    let d_row = k / per_load * d_per_load(bits);
    let groups = k / group;
    let mut q = vec![0i8; rows * k];
    let mut d = vec![0f32; rows * d_row];
    let mut sums = vec![0f32; rows * groups];
    for m in 0..rows {
        let row = &x[m * k..(m + 1) * k];
        for (g, sum) in sums[m * groups..(m + 1) * groups].iter_mut().enumerate() {
            *sum = row[g * group..(g + 1) * group].iter().sum();
        }
        for b in 0..k / BLOCK {
            let values = &row[b * BLOCK..(b + 1) * BLOCK];
            let largest = values.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = largest / 127.0;
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            match bits {
                4 => d[m * d_row + b / 2 * 8 + b % 2 * 4..][..4].fill(scale),
                _ => d[m * d_row + b] = scale,
            }
            for (i, v) in values.iter().enumerate() {
                let e = b * BLOCK + i;
                // 4 bits: element e of its 64 goes to position e/2 among the evens or the odds.
                let at = match bits {
                    4 => (e / 64) * 64 + (e % 2) * 32 + (e % 64) / 2,
                    _ => e,
                };
                q[m * k + at] = (v * inverse).round_ties_even() as i8;
            }
        }
    }
    Activations { q, d, sums }
}

/// y[m, o] for o in `outputs` and every row m of x [rows, k]; y is [rows, n].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`available`]), and `takes(&w, k)` must hold.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn product(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Quantized,
    outputs: std::ops::Range<usize>,
    n: usize,
    y: &mut [f32],
) {
    let a = quantize(x, rows, k, w.bits, w.group);
    let row_bytes = k * w.bits as usize / 8;
    let groups = k / w.group;
    let (mut scales, mut biases) = (vec![0f32; groups], vec![0f32; groups]);
    for first in (0..rows).step_by(PANEL) {
        let panel = PANEL.min(rows - first);
        for r in outputs.clone() {
            prefetch(&w, row_bytes, r + 1);
            // The row's scales and biases as floats, once for all its loads.
            widen_params(w.scales, r * groups, &mut scales);
            widen_params(w.biases, r * groups, &mut biases);
            if w.bits == 8 {
                // q − 128 in the products, so 128 · scale goes to the bias.
                for (b, s) in biases.iter_mut().zip(&scales) {
                    *b += 128.0 * s;
                }
            }
            let row = Row {
                bytes: (w.packed.as_ptr() as *const u8).add(r * row_bytes),
                scales: scales.as_ptr(),
                biases: biases.as_ptr(),
                group_shift: w.group.trailing_zeros(),
            };
            let mut m0 = first;
            while m0 < first + panel {
                let block = X_BLOCK.min(first + panel - m0);
                let at = Tile { a: &a, k, m0, groups };
                let out = y.as_mut_ptr().add(m0 * n + r);
                match (block, w.bits, w.group == BLOCK) {
                    (1, 4, true) => at.run::<1, 4, true>(row, out, n),
                    (2, 4, true) => at.run::<2, 4, true>(row, out, n),
                    (3, 4, true) => at.run::<3, 4, true>(row, out, n),
                    (4, 4, true) => at.run::<4, 4, true>(row, out, n),
                    (1, 4, _) => at.run::<1, 4, false>(row, out, n),
                    (2, 4, _) => at.run::<2, 4, false>(row, out, n),
                    (3, 4, _) => at.run::<3, 4, false>(row, out, n),
                    (4, 4, _) => at.run::<4, 4, false>(row, out, n),
                    (1, ..) => at.run::<1, 8, false>(row, out, n),
                    (2, ..) => at.run::<2, 8, false>(row, out, n),
                    (3, ..) => at.run::<3, 8, false>(row, out, n),
                    _ => at.run::<4, 8, false>(row, out, n),
                }
                m0 += block;
            }
        }
    }
}

/// One row of W as a tile reads it: its packed bytes, its scales and biases per group (8 bits:
/// with 128 · scale moved in).
#[derive(Clone, Copy)]
struct Row {
    bytes: *const u8,
    scales: *const f32,
    biases: *const f32,
    /// log₂ of the group size.
    group_shift: u32,
}

/// Rows of x one pass over a row of W takes: four accumulators and the vectors of one load
/// stay within the sixteen registers.
const X_BLOCK: usize = 4;

/// Asks for W's row `r` while the one before it is multiplied (a prefetch never faults).
#[inline(always)]
unsafe fn prefetch(w: &Quantized, row_bytes: usize, r: usize) {
    let base = (w.packed.as_ptr() as *const u8).wrapping_add(r * row_bytes);
    for at in (0..row_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(at) as *const i8);
    }
}

/// Where a register tile works: x's quantized rows from `m0`.
struct Tile<'a> {
    a: &'a Activations,
    k: usize,
    m0: usize,
    groups: usize,
}

impl Tile<'_> {
    /// y[m0 + b, r] for b < XB, written `n` apart from `out`: per 32-byte load of W's row, its
    /// blocks' integer sums times the block's d and the group's scale, into one float32
    /// accumulator per output; its lanes' sum, plus the bias terms (each group's bias times its
    /// Σ x, summed as [`bias_terms`] sums them). One W row at a time keeps the accumulators and
    /// a load's vectors in registers.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const XB: usize, const BITS: u32, const SPLIT: bool>(&self, row: Row, out: *mut f32, n: usize) {
        let Tile { a, k, m0, groups } = *self;
        let per_load = if BITS == 4 { 64 } else { 32 };
        let d_row = k / per_load * d_per_load(BITS);
        let ones = _mm256_set1_epi16(1);
        let xq: [*const i8; XB] = std::array::from_fn(|b| a.q.as_ptr().add((m0 + b) * k));
        let ds: [*const f32; XB] = std::array::from_fn(|b| a.d.as_ptr().add((m0 + b) * d_row));
        let mut acc = [_mm256_setzero_ps(); XB];
        for c in 0..k / per_load {
            let start = c * per_load;
            let wv = _mm256_loadu_si256(row.bytes.add(c * 32) as *const __m256i);
            let g0 = start >> row.group_shift;
            // The load as two vectors of bytes, and its scales by lane.
            let (low, high, scale);
            if BITS == 4 {
                let nibble = _mm256_set1_epi8(0x0F);
                low = _mm256_and_si256(wv, nibble);
                high = _mm256_and_si256(_mm256_srli_epi16::<4>(wv), nibble);
                scale = if SPLIT {
                    // Groups of 32: the load's two blocks are two groups.
                    let g1 = (start + BLOCK) >> row.group_shift;
                    _mm256_setr_m128(_mm_broadcast_ss(&*row.scales.add(g0)), _mm_broadcast_ss(&*row.scales.add(g1)))
                } else {
                    _mm256_broadcast_ss(&*row.scales.add(g0))
                };
            } else {
                let signed = _mm256_xor_si256(wv, _mm256_set1_epi8(-128));
                low = _mm256_abs_epi8(signed);
                high = signed;
                scale = _mm256_broadcast_ss(&*row.scales.add(g0));
            }
            for b in 0..XB {
                let x = xq[b].add(start) as *const __m256i;
                let (pairs, d) = if BITS == 4 {
                    let even = _mm256_maddubs_epi16(low, _mm256_loadu_si256(x));
                    let odd = _mm256_maddubs_epi16(high, _mm256_loadu_si256(x.add(1)));
                    // At most 2 · 15 · 127 each: their sum fits 16 bits.
                    (_mm256_add_epi16(even, odd), _mm256_loadu_ps(ds[b].add(c * 8)))
                } else {
                    let pairs = _mm256_maddubs_epi16(low, _mm256_sign_epi8(_mm256_loadu_si256(x), high));
                    (pairs, _mm256_broadcast_ss(&*ds[b].add(c)))
                };
                let products = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                acc[b] = _mm256_fmadd_ps(products, _mm256_mul_ps(d, scale), acc[b]);
            }
        }
        for b in 0..XB {
            let sums = std::slice::from_raw_parts(a.sums.as_ptr().add((m0 + b) * groups), groups);
            let biases = std::slice::from_raw_parts(row.biases, groups);
            *out.add(b * n) = crate::widen_avx2::horizontal_sum(acc[b]) + bias_terms(biases, sums);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::Params;

    /// The scheme in plain arithmetic: per group, s · Σ q · (d · xq) + b · Σ x, with xq and d
    /// computed from x as `quantize` computes them, in element order; for 8 bits
    /// s · Σ (q − 128) · (d · xq) + (b + 128 · s) · Σ x.
    fn reference(x: &[f32], k: usize, w: &Quantized, o: usize) -> f64 {
        let groups = k / w.group;
        let mut y = 0f64;
        for g in 0..groups {
            let (s, b) = (w.scales.get(o * groups + g) as f64, w.biases.get(o * groups + g) as f64);
            for e in g * w.group..(g + 1) * w.group {
                let block = &x[e / BLOCK * BLOCK..][..BLOCK];
                let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
                let xq = if d > 0.0 { (x[e] * (1.0 / d)).round_ties_even() } else { 0.0 };
                let (q, b) = match w.bits {
                    8 => (w.q(o, k, e) as f64 - 128.0, b + 128.0 * s),
                    _ => (w.q(o, k, e) as f64, b),
                };
                y += s * q * (d * xq) as f64 + b * x[e] as f64;
            }
        }
        y
    }

    #[test]
    fn products_are_the_integer_scheme_for_every_tile_and_row_count() {
        // The loops themselves, asked for or not.
        if !(crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c")) {
            return;
        }
        let n = 11;
        for (k, bits, group) in [
            (256, 4, 32),
            (64, 4, 32),
            (256, 4, 64),
            (128, 4, 128),
            (256, 8, 32),
            (96, 8, 32),
            (256, 8, 64),
            (256, 8, 128),
        ] {
            let packed: Vec<u32> = (0..n * k / 4).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
            let params: Vec<f32> = (0..n * k / group).map(|i| 0.01 + (i % 7) as f32 * 2e-3).collect();
            let biases: Vec<f32> = (0..n * k / group).map(|i| -0.05 + (i % 5) as f32 * 1e-2).collect();
            let w = Quantized {
                packed: &packed[..n * k * bits as usize / 32],
                scales: Params::F32(&params),
                biases: Params::F32(&biases),
                bits,
                group,
            };
            assert!(takes(&w, k));
            for rows in [1, 2, 3, 5, 9, 70] {
                // Zeros in the first block: a block of zeros has no scale.
                let x: Vec<f32> = (0..rows * k)
                    .map(|i| if i % k < BLOCK { 0.0 } else { ((i * 37 % 101) as f32 - 50.0) / 25.0 })
                    .collect();
                let mut y = vec![0f32; rows * n];
                // SAFETY: the CPU has AVX2 and FMA (checked above), and the loops take w.
                unsafe { product(&x, rows, k, w, 0..n, n, &mut y) };
                for m in 0..rows {
                    for o in 0..n {
                        let expected = reference(&x[m * k..(m + 1) * k], k, &w, o);
                        let got = y[m * n + o] as f64;
                        assert!(
                            (got - expected).abs() <= 1e-5 * (1.0 + expected.abs()),
                            "{bits} bits, group {group}, {rows} rows, y[{m}, {o}]: {got} vs {expected}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_row_gives_the_same_alone_and_among_others() {
        if !(crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c")) {
            return;
        }
        let (k, n) = (128, 13);
        let packed: Vec<u32> = (0..n * k / 4).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let params: Vec<f32> = (0..n * k / 32).map(|i| 0.01 + i as f32 * 1e-3).collect();
        for bits in [4, 8] {
            let w = Quantized {
                packed: &packed[..n * k * bits as usize / 32],
                scales: Params::F32(&params),
                biases: Params::F32(&params),
                bits,
                group: 32,
            };
            for rows in [2, 5, 9, 70] {
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let mut window = vec![0f32; rows * n];
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the loops take w.
                unsafe { product(&x, rows, k, w, 0..n, n, &mut window) };
                for m in 0..rows {
                    let mut alone = vec![0f32; n];
                    // SAFETY: as above.
                    unsafe { product(&x[m * k..(m + 1) * k], 1, k, w, 0..n, n, &mut alone) };
                    assert_eq!(alone, window[m * n..(m + 1) * n], "{bits} bits, row {m} of {rows}");
                }
            }
        }
    }
}
