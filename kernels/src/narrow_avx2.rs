//! Half-precision weights times up to six float32 rows, on AVX2 with FMA: decode steps and verify windows on CPUs without AVX-512 (Zen 2 and 3, most
//! Intel client parts).
//!
//! The other AVX2 loops widen each row of W into an L1 buffer and read it back for every block
//! of x rows: a store and a load per eight weights more, which on one row is most of the work
//! besides reading the weights. Here each weight is widened in a register
//! straight from memory, once for all the rows of the tile, and never written back. Past six rows
//! the buffer wins (it is widened once for any number of rows), so those keep it.
//!
//! Each output is summed exactly as the buffered loops sum it: element i into lane i mod 8 of one
//! accumulator, the lanes added last by the same tree. So a row gives the same result through
//! either route, and a verify window of any size equals its rows decoded one by one.
//! (Quantized weights have loops of their own, [`crate::quantized_f32_avx2`].)
//!
//! Sixteen vector registers hold a tile: its accumulators, one weight vector per W row and one
//! x vector.

use std::arch::x86_64::*;

use crate::lanes::prefetch_lines;
use crate::weight::Weight;
use crate::widen_avx2::{bf16x8, f16x8, horizontal_sum};

/// The most rows of x these loops take; the caller keeps the buffered loops for more.
pub const MAX_ROWS: usize = 6;

/// Whether these loops take W: half-precision rows of whole vectors (the buffered loops pad the
/// last one).
pub fn takes(w: Weight, k: usize) -> bool {
    k.is_multiple_of(8) && matches!(w, Weight::Bf16(_) | Weight::F16(_))
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
        _ => unreachable!("half-precision weights only (`takes`)"),
    };
    let mut o = outputs.start;
    while o < outputs.end {
        let width = w_block(rows).min(outputs.end - o);
        // As the other loops do: the next block of W rows is asked for while this one is used
        // (`Tile::ahead`).
        let ahead = width.min(outputs.end - o - width);
        let at = Tile { x, k, w, o, n, ahead };
        macro_rules! shapes {
            ($($b:literal: $($j:literal),*);*) => {
                match (rows, width) {
                    $($(($b, $j) => match format {
                        BF16 => at.run::<$b, $j, BF16>(y),
                        _ => at.run::<$b, $j, F16>(y),
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
    /// Rows of the next tile, asked for a line at a time as the loop passes it in its own.
    ahead: usize,
}

impl Tile<'_> {
    /// y[b, o + j] for b < XB, j < WB.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const XB: usize, const WB: usize, const FORMAT: u8>(&self, y: &mut [f32]) {
        let Tile { x, k, w, o, n, ahead } = *self;
        let base = match w {
            Weight::Bf16(w) | Weight::F16(w) => w.as_ptr(),
            _ => unreachable!("half-precision weights only (`takes`)"),
        };
        let mut acc = [[_mm256_setzero_ps(); XB]; WB];
        // (Explicit loops throughout: closures would not inherit the target features.)
        for i in (0..k).step_by(8) {
            if i % 32 == 0 {
                prefetch_lines(base.wrapping_add((o + WB) * k), k, ahead, i);
            }
            // All the tile's weight vectors first, then each x vector once for all of them.
            let mut weights = [_mm256_setzero_ps(); WB];
            for j in 0..WB {
                let at = base.add((o + j) * k + i);
                weights[j] = if FORMAT == BF16 { bf16x8(at) } else { f16x8(at) };
            }
            for b in 0..XB {
                let xv = _mm256_loadu_ps(x.as_ptr().add(b * k + i));
                for j in 0..WB {
                    acc[j][b] = _mm256_fmadd_ps(weights[j], xv, acc[j][b]);
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
