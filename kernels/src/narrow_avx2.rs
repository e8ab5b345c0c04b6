//! Half-precision and MLX affine-quantized weights (4 and 8 bits) times up to six float32 rows,
//! on AVX2 with FMA: decode steps and verify windows on CPUs without AVX-512 (Zen 2 and 3, most
//! Intel client parts).
//!
//! The other AVX2 loops widen each row of W into an L1 buffer and read it back for every block
//! of x rows: a store and a load per eight weights more, which on one row is most of the work
//! besides reading the weights. Here each weight is widened (or dequantized) in a register
//! straight from memory, once for all the rows of the tile, and never written back. Past six rows
//! the buffer wins (it is widened once for any number of rows), so those keep it.
//!
//! Each output is summed exactly as the buffered loops sum it: the same widening (for quantized
//! weights w = scale · q + bias, one multiply-add in float32, as MLX does), element i into lane
//! i mod 8 of one accumulator, the lanes added last by the same tree. So a row gives the same
//! result through either route, and a verify window of any size equals its rows decoded one by
//! one.
//!
//! Sixteen vector registers hold a tile: its accumulators, one weight vector per W row and one
//! x vector; quantized weights' scales and biases are read from memory by the multiply-adds.

use std::arch::x86_64::*;

use crate::weight::Weight;
use crate::widen_avx2::{bf16x8, f16x8, horizontal_sum, prefetch_rows, u4x8, u8x8};

/// The most rows of x these loops take; the caller keeps the buffered loops for more.
pub const MAX_ROWS: usize = 6;

/// Whether these loops take W: rows of whole vectors (the buffered loops pad the last one), and
/// quantized groups of whole vectors.
pub fn takes(w: Weight, k: usize) -> bool {
    k.is_multiple_of(8)
        && match w {
            Weight::F32(_) => false,
            Weight::Bf16(_) | Weight::F16(_) => true,
            Weight::Quantized(q) => q.group.is_multiple_of(8) && (q.bits == 4 || q.bits == 8),
        }
}

/// The W rows one tile takes with `rows` rows of x: as many as keep accumulators and weight
/// vectors within fourteen registers, and at least two chains of multiply-adds per weight
/// vector's latency.
fn w_block(rows: usize) -> usize {
    match rows {
        1..=2 => 4,
        3 => 3,
        _ => 2,
    }
}

/// The formats, as the tiles' constant parameter.
const BF16: u8 = 0;
const F16: u8 = 1;
const Q8: u8 = 2;
const Q4: u8 = 3;

/// y[m, o] for o in `outputs` and every row m of x [rows, k]; y is [rows, n].
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `rows` is 1 to [`MAX_ROWS`] and `takes(w, k)` holds.
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
    let format = match w {
        Weight::Bf16(_) => BF16,
        Weight::F16(_) => F16,
        Weight::Quantized(q) if q.bits == 8 => Q8,
        Weight::Quantized(_) => Q4,
        Weight::F32(_) => unreachable!("float32 rows are read in place by the buffered loops"),
    };
    let mut o = outputs.start;
    while o < outputs.end {
        let width = w_block(rows).min(outputs.end - o);
        // As the other loops do: the next block of W rows is asked for while this one is used.
        prefetch_rows(w, k, o + width..(o + 2 * width).min(outputs.end));
        let at = Tile { x, k, w, o, n };
        macro_rules! shapes {
            ($($b:literal: $($j:literal),*);*) => {
                match (rows, width) {
                    $($(($b, $j) => match format {
                        BF16 => at.run::<$b, $j, BF16>(y),
                        F16 => at.run::<$b, $j, F16>(y),
                        Q8 => at.run::<$b, $j, Q8>(y),
                        _ => at.run::<$b, $j, Q4>(y),
                    },)*)*
                    _ => unreachable!("at most {MAX_ROWS} rows"),
                }
            };
        }
        shapes!(1: 4, 3, 2, 1; 2: 4, 3, 2, 1; 3: 3, 2, 1; 4: 2, 1; 5: 2, 1; 6: 2, 1);
        o += width;
    }
}

/// Where a register tile works: every row of x, W's rows `o..`.
struct Tile<'a> {
    x: &'a [f32],
    k: usize,
    w: Weight<'a>,
    o: usize,
    n: usize,
}

impl Tile<'_> {
    /// y[b, o + j] for b < XB, j < WB.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const XB: usize, const WB: usize, const FORMAT: u8>(&self, y: &mut [f32]) {
        let Tile { x, k, w, o, n } = *self;
        let (base, group, params) = match w {
            Weight::Bf16(w) | Weight::F16(w) => (w.as_ptr() as *const u8, k, None),
            Weight::Quantized(q) => (q.packed.as_ptr() as *const u8, q.group, Some((q.scales, q.biases))),
            Weight::F32(_) => unreachable!("float32 rows are read in place by the buffered loops"),
        };
        // Quantized weights go by groups of their scales and biases; half-precision ones are one.
        let groups = k / group;
        let mut acc = [[_mm256_setzero_ps(); XB]; WB];
        // (Explicit loops throughout: closures would not inherit the target features.)
        let mut scale = [_mm256_setzero_ps(); WB];
        let mut bias = [_mm256_setzero_ps(); WB];
        for g in 0..groups {
            if let Some((scales, biases)) = params {
                for j in 0..WB {
                    scale[j] = _mm256_set1_ps(scales.get((o + j) * groups + g));
                    bias[j] = _mm256_set1_ps(biases.get((o + j) * groups + g));
                }
            }
            for i in (g * group..(g + 1) * group).step_by(8) {
                // All the tile's weight vectors first, then each x vector once for all of them.
                let mut weights = [_mm256_setzero_ps(); WB];
                for j in 0..WB {
                    let at = (o + j) * k + i;
                    weights[j] = match FORMAT {
                        BF16 => bf16x8((base as *const u16).add(at)),
                        F16 => f16x8((base as *const u16).add(at)),
                        _ => {
                            let q = if FORMAT == Q8 {
                                u8x8((base as *const u32).add(at / 4))
                            } else {
                                u4x8(*(base as *const u32).add(at / 8))
                            };
                            // MLX's dequantization: w = scale · q + bias.
                            _mm256_fmadd_ps(q, scale[j], bias[j])
                        }
                    };
                }
                for b in 0..XB {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(b * k + i));
                    for j in 0..WB {
                        acc[j][b] = _mm256_fmadd_ps(weights[j], xv, acc[j][b]);
                    }
                }
            }
        }
        for j in 0..WB {
            for b in 0..XB {
                y[b * n + o + j] = horizontal_sum(acc[j][b]);
            }
        }
    }
}
