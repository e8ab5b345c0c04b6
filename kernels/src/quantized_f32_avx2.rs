//! MLX affine-quantized weights (4 and 8 bits) times float32 activations on AVX2: the route of
//! [`super::dot::product`] for quantized weights on x86 CPUs with AVX2 and without AVX-512 (Zen 2
//! and 3, most Intel client parts), at every row count.
//!
//! Why not dequantize each weight (w = scale · q + bias, as MLX's CPU kernel does) and multiply
//! it in: that costs a multiply-add per weight more than the product itself, and unpacking 4-bit
//! words one word per vector (a broadcast, a variable shift, a mask) three operations more;
//! together they held a 4-bit product of one row to a fifth of what memory delivers. Here each
//! group of weights is summed as MLX's Metal kernels and the AMX route sum it,
//!
//! Σ (s·q + b)·x = s · Σ q·x + b · Σ x,
//!
//! so a weight costs its widening to float and one multiply-add per row of x, and a group one
//! multiply-add by its scale; Σ x is summed once per row of x, and the bias terms are added
//! per output after the loop. Eight packed bytes widen to eight 32-bit lanes in one
//! instruction: for 8 bits that is eight weights; for 4 bits sixteen, the low nibbles (the
//! even elements) after a mask and the high ones (the odd) after a shift, so each row of x is
//! first copied into that order: per 16 elements, the 8 even ones, then the 8 odd ones.
//!
//! The float32 sums differ from MLX's CPU rounding (which rounds each dequantized weight first)
//! by float32 rounding only; the parity tests against mlx-lm hold within their tolerances.
//!
//! Each output is summed the same way whatever the tile it falls in or the number of rows:
//! elements i mod 16 < 8 and ≥ 8 (in the order above) into two accumulators, lane by lane, per
//! group; the group's scale times their sum into a third; its lanes added last, then the bias
//! terms. So a row gives the same result alone, in a verify window or in a batch, and
//! speculative decoding on this route equals plain decoding on it.

use std::arch::x86_64::*;

use crate::lanes::prefetch_lines;
use crate::weight::{Quantized, Weight};
use crate::widen_avx2::{bias_terms, horizontal_sum, prefetch_params, prefetch_rows, widen_params};

/// Weights per step of the loops: two vectors of eight.
const STEP: usize = 16;
/// Rows of x that stay in L2 while every row of W passes over them.
const PANEL: usize = 64;
/// Rows of W whose scales and biases are widened to floats at once: one pass over contiguous
/// memory, where two per row cost a twelfth of a one-row product.
const PARAMS_ROWS: usize = 64;
/// From this many rows of x on, each block of W rows is widened to floats once per panel, into
/// a buffer the tiles read, rather than once per tile of x rows: the same floats, summed the
/// same way, so a row's result does not depend on it.
const BUFFERED_FROM: usize = 8;
/// [`Tile::run`]'s `FORM` for rows read from that buffer (otherwise the weights' bits).
const WIDENED: u32 = 0;

/// Whether these loops serve: the CPU has AVX2, FMA and F16C.
pub fn available() -> bool {
    crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c")
}

/// Whether these loops take `w`: 4 or 8 bits, in groups of whole steps (MLX's are 32, 64, 128).
pub fn takes(w: &Quantized) -> bool {
    (w.bits == 4 || w.bits == 8) && w.group.is_multiple_of(STEP)
}

/// Σ x per row of x [rows, k] and group of `group` elements, summed in element order.
fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    x.chunks_exact(group).map(|g| g.iter().sum()).collect()
}

/// y[m, o] for o in `outputs` and every row m of x [rows, k]; y is [rows, n].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C ([`available`]), and `takes(&w)` must hold.
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
    let reordered;
    let xs = if w.bits == 4 {
        reordered = crate::weight::even_then_odd(x, STEP);
        &reordered[..]
    } else {
        x
    };
    let sums = group_sums(x, w.group);
    let groups = k / w.group;
    let row_bytes = k * w.bits as usize / 8;
    // Tiles of `w_block` rows of W by `x_block` rows of x: at least eight accumulator chains, so
    // the multiply-adds' latency hides behind each other.
    let (w_block, x_block) = match rows {
        1 => (4, 1),
        2 => (2, 2),
        _ => (2, 3),
    };
    // Scales and biases as floats, widened PARAMS_ROWS rows of W at a time (contiguous in
    // memory), rows `params_from..` of them.
    let (mut scales, mut biases) = (vec![0f32; PARAMS_ROWS * groups], vec![0f32; PARAMS_ROWS * groups]);
    let mut params_from = usize::MAX;
    let mut widened = vec![0f32; if rows >= BUFFERED_FROM { w_block * k } else { 0 }];
    for first in (0..rows).step_by(PANEL) {
        let panel = PANEL.min(rows - first);
        let mut o = outputs.start;
        while o < outputs.end {
            let width = w_block.min(outputs.end - o);
            let next = o + width..(o + 2 * width).min(outputs.end);
            if rows >= BUFFERED_FROM {
                // The rows are widened at once below; the tiles' loops do not read them.
                prefetch_rows(Weight::Quantized(w), k, next.clone());
            }
            if !(params_from..params_from.saturating_add(PARAMS_ROWS)).contains(&(o + width - 1)) {
                params_from = o;
                let count = PARAMS_ROWS.min(outputs.end - o) * groups;
                widen_params(w.scales, o * groups, &mut scales[..count]);
                widen_params(w.biases, o * groups, &mut biases[..count]);
            }
            // The next PARAMS_ROWS rows' scales and biases, a tile's worth at a time.
            prefetch_params::<_MM_HINT_T0>(
                &w,
                k,
                (o + PARAMS_ROWS).min(outputs.end)..(o + PARAMS_ROWS + width).min(outputs.end),
            );
            let params = (o - params_from) * groups..(o - params_from + width) * groups;
            let bytes = (w.packed.as_ptr() as *const u8).add(o * row_bytes);
            if !widened.is_empty() {
                for j in 0..width {
                    widen_row(w.bits, bytes.add(j * row_bytes), &mut widened[j * k..(j + 1) * k]);
                }
            }
            let at = Tile {
                xs,
                sums: &sums,
                bytes,
                row_bytes,
                widened: widened.as_ptr(),
                ahead: if widened.is_empty() && !next.is_empty() {
                    bytes.wrapping_add(width * row_bytes)
                } else {
                    std::ptr::null()
                },
                scales: &scales[params.clone()],
                biases: &biases[params],
                k,
                group: w.group,
            };
            let mut m0 = first;
            while m0 < first + panel {
                let block = x_block.min(first + panel - m0);
                let out = y.as_mut_ptr().add(m0 * n + o);
                macro_rules! shapes {
                    ($(($j:literal, $b:literal)),*) => {
                        match (width, block, if widened.is_empty() { w.bits } else { WIDENED }) {
                            $(($j, $b, 4) => at.run::<$j, $b, 4>(m0, out, n),
                              ($j, $b, 8) => at.run::<$j, $b, 8>(m0, out, n),
                              ($j, $b, _) => at.run::<$j, $b, WIDENED>(m0, out, n),)*
                            _ => unreachable!("tiles of at most 4 rows of W or of x"),
                        }
                    };
                }
                shapes!((4, 1), (3, 1), (2, 1), (1, 1), (2, 2), (1, 2), (2, 3), (1, 3));
                m0 += block;
            }
            o += width;
        }
    }
}

/// Eight weights of a packed row as floats: elements `i..i + 8` for 8 bits; for 4 bits the low
/// (`half` 0) or high nibbles of bytes `i / 2..i / 2 + 8`, elements i, i + 2, … or i + 1, i + 3, ….
#[inline(always)]
unsafe fn widen<const BITS: u32>(row: *const u8, i: usize, half: usize) -> __m256 {
    _mm256_cvtepi32_ps(if BITS == 4 {
        let pairs = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(i / 2) as *const __m128i));
        if half == 0 {
            _mm256_and_si256(pairs, _mm256_set1_epi32(0x0F))
        } else {
            _mm256_srli_epi32::<4>(pairs)
        }
    } else {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(i + 8 * half) as *const __m128i))
    })
}

/// A packed row of `out.len()` weights as floats, in the order the tiles take them: per step,
/// [`widen`]'s two halves.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_row(bits: u32, row: *const u8, out: &mut [f32]) {
    for i in (0..out.len()).step_by(STEP) {
        for half in 0..2 {
            let v = if bits == 4 { widen::<4>(row, i, half) } else { widen::<8>(row, i, half) };
            _mm256_storeu_ps(out.as_mut_ptr().add(i + 8 * half), v);
        }
    }
}

/// Where a register tile works: x's rows (in the weights' element order) and their group sums;
/// W's rows from `bytes` (or widened, `k` floats apart, from `widened`), with their scales and
/// biases as floats, `groups` per row.
struct Tile<'a> {
    xs: &'a [f32],
    sums: &'a [f32],
    bytes: *const u8,
    row_bytes: usize,
    widened: *const f32,
    /// The next tile's rows, asked for a line at a time as this tile's loops pass the same
    /// place in their own ([`prefetch_lines`]; a whole tile asked for at once, a hundred lines
    /// or more, leaves most requests waiting or dropped); null for the last tile and when the
    /// rows come from `widened`.
    ahead: *const u8,
    scales: &'a [f32],
    biases: &'a [f32],
    k: usize,
    group: usize,
}

impl Tile<'_> {
    /// y[m0 + b, o + j] for j < WB, b < XB, written from `out` (rows `n` apart); `FORM` is the
    /// weights' bits, or [`WIDENED`].
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const WB: usize, const XB: usize, const FORM: u32>(&self, m0: usize, out: *mut f32, n: usize) {
        let Tile { xs, sums, bytes, row_bytes, widened, ahead, scales, biases, k, group } = *self;
        let groups = k / group;
        let x: [*const f32; XB] = std::array::from_fn(|b| xs.as_ptr().add((m0 + b) * k));
        let mut total = [[_mm256_setzero_ps(); XB]; WB];
        for g in 0..groups {
            let mut acc = [[[_mm256_setzero_ps(); 2]; XB]; WB];
            if FORM != WIDENED && !ahead.is_null() {
                // The lines that start within this group's bytes, once per group: per step
                // the test costs more than the requests.
                let (start, end) = (g * group * FORM as usize / 8, (g + 1) * group * FORM as usize / 8);
                for line in (start.next_multiple_of(64)..end).step_by(64) {
                    prefetch_lines(ahead, row_bytes, WB, line);
                }
            }
            for i in (g * group..(g + 1) * group).step_by(STEP) {
                // Each half of the step: each W row's eight weights as floats, then each x row
                // once for all of them (so that a tile of six accumulator pairs stays in the
                // sixteen registers with them).
                for half in 0..2 {
                    let mut q = [_mm256_setzero_ps(); WB];
                    for j in 0..WB {
                        q[j] = match FORM {
                            WIDENED => _mm256_loadu_ps(widened.add(j * k + i + 8 * half)),
                            4 => widen::<4>(bytes.add(j * row_bytes), i, half),
                            _ => widen::<8>(bytes.add(j * row_bytes), i, half),
                        };
                    }
                    for b in 0..XB {
                        let xv = _mm256_loadu_ps(x[b].add(i + 8 * half));
                        for j in 0..WB {
                            acc[j][b][half] = _mm256_fmadd_ps(q[j], xv, acc[j][b][half]);
                        }
                    }
                }
            }
            for j in 0..WB {
                let scale = _mm256_set1_ps(scales[j * groups + g]);
                for b in 0..XB {
                    let sum = _mm256_add_ps(acc[j][b][0], acc[j][b][1]);
                    total[j][b] = _mm256_fmadd_ps(scale, sum, total[j][b]);
                }
            }
        }
        for j in 0..WB {
            for b in 0..XB {
                let row_sums = &sums[(m0 + b) * groups..(m0 + b + 1) * groups];
                let bias = bias_terms(&biases[j * groups..(j + 1) * groups], row_sums);
                *out.add(b * n + j) = horizontal_sum(total[j][b]) + bias;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::Params;

    /// Σ (s·q + b)·x in float64, in element order.
    fn reference(x: &[f32], k: usize, w: &Quantized, o: usize) -> f64 {
        let groups = k / w.group;
        (0..k)
            .map(|e| {
                let g = o * groups + e / w.group;
                let weight = w.scales.get(g) as f64 * w.q(o, k, e) as f64 + w.biases.get(g) as f64;
                weight * x[e] as f64
            })
            .sum()
    }

    fn weights(n: usize, k: usize, bits: u32, group: usize) -> (Vec<u32>, Vec<u16>, Vec<u16>) {
        let packed = (0..n * k * bits as usize / 32).map(|i| (i as u32).wrapping_mul(2654435761)).collect();
        let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
        let scales = (0..n * k / group).map(|i| bf16(0.01 + (i % 7) as f32 * 2e-3)).collect();
        let biases = (0..n * k / group).map(|i| bf16(-0.05 + (i % 5) as f32 * 1e-2)).collect();
        (packed, scales, biases)
    }

    #[test]
    fn products_are_the_dequantized_sums_for_every_tile_and_row_count() {
        if !available() {
            return;
        }
        // Past PARAMS_ROWS outputs, so that scales and biases are widened more than once.
        let n = PARAMS_ROWS + 11;
        for (k, bits, group) in
            [(64, 4, 32), (256, 4, 64), (256, 4, 128), (48, 4, 16), (96, 8, 32), (256, 8, 64), (256, 8, 128)]
        {
            let (packed, scales, biases) = weights(n, k, bits, group);
            let w = Quantized {
                packed: &packed,
                scales: Params::Bf16(&scales),
                biases: Params::Bf16(&biases),
                bits,
                group,
            };
            assert!(takes(&w));
            for rows in [1, 2, 3, 4, 5, 9, 70] {
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let mut y = vec![0f32; rows * n];
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the loops take w.
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
    fn a_row_gives_the_same_alone_among_others_and_in_any_range_of_outputs() {
        if !available() {
            return;
        }
        let (k, n) = (128, PARAMS_ROWS + 13);
        for bits in [4, 8] {
            let (packed, scales, biases) = weights(n, k, bits, 32);
            let w = Quantized {
                packed: &packed,
                scales: Params::Bf16(&scales),
                biases: Params::Bf16(&biases),
                bits,
                group: 32,
            };
            for rows in [2, 3, 5, 9, 70] {
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
                let mut window = vec![0f32; rows * n];
                // SAFETY: the CPU has AVX2, FMA and F16C (checked above), and the loops take w.
                unsafe { product(&x, rows, k, w, 0..n, n, &mut window) };
                for m in 0..rows {
                    let mut alone = vec![0f32; n];
                    // Outputs in two ranges, as helper threads split them: other tile widths.
                    // SAFETY: as above.
                    unsafe {
                        product(&x[m * k..(m + 1) * k], 1, k, w, 0..5, n, &mut alone);
                        product(&x[m * k..(m + 1) * k], 1, k, w, 5..n, n, &mut alone);
                    }
                    assert_eq!(alone, window[m * n..(m + 1) * n], "{bits} bits, row {m} of {rows}");
                }
            }
        }
    }
}
