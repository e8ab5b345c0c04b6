//! Half-precision weights times more rows of x than [`crate::narrow_avx2`] takes (prefill,
//! batched verify windows), on AVX2 with FMA: blocked so that the register tiles read both
//! operands from L1.
//!
//! The unblocked loops widen two rows of W and then pass every row of x over them: each row of
//! x is read from L3 or memory once per two outputs, and a tile waits on those reads for half
//! its time. Here a panel of [`PANEL_W`] rows of W is widened [`CHUNK`] elements at a time into
//! a buffer that stays in L1, and every tile of rows of x multiplies that chunk by every tile of
//! the panel's rows while the chunk of x is in L1 too.
//!
//! Each output is still summed as the other AVX2 loops sum it (element i into lane i mod 8 of one
//! accumulator, in element order, the lanes added last by the same tree): between chunks a
//! tile's accumulators wait in a buffer, unchanged. So a row's result does not depend on the
//! number of rows or on this blocking, and a verify window equals its rows decoded one by one.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::weight::Weight;
use crate::widen_avx2::{halves, horizontal_sum};

/// Elements of a row per chunk: a panel's chunk (`PANEL_W` rows) and a tile's rows of x fit L1
/// together.
const CHUNK: usize = 512;
/// Rows of W per panel, a whole number of tiles.
const PANEL_W: usize = 12;
/// Rows of x per panel: their accumulators (eight floats per output of the panel) wait in L2
/// between chunks.
const PANEL_X: usize = 128;
/// Register tiles of up to 4 rows of x × 3 rows of W: twelve accumulators, three weight vectors
/// and one x vector fill the sixteen registers.
const X_BLOCK: usize = 4;
const W_BLOCK: usize = 3;

/// y[m, o] for o in `outputs` and every row m of x [rows, k]; y is [rows, n]: for each panel of
/// x's rows and of W's rows, for each chunk, every register tile.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, W is bfloat16 or float16 and k a multiple of 8
/// ([`crate::narrow_avx2::takes`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn product(x: &[f32], rows: usize, k: usize, w: Weight, outputs: Range<usize>, n: usize, y: &mut [f32]) {
    let mut panel = Panel([0.0; PANEL_W * CHUNK]);
    // One accumulator per output of a panel of x's rows by one of W's, for as many rows of x as
    // a panel takes here: a window of a few rows zeroes little.
    let mut waiting = vec![_mm256_setzero_ps(); PANEL_X.min(rows) * PANEL_W];
    for first_x in (0..rows).step_by(PANEL_X) {
        let xs = first_x..(first_x + PANEL_X).min(rows);
        for first_w in outputs.clone().step_by(PANEL_W) {
            let ws = first_w..(first_w + PANEL_W).min(outputs.end);
            for start in (0..k).step_by(CHUNK) {
                let elements = start..(start + CHUNK).min(k);
                widen(w, k, ws.clone(), elements.clone(), &mut panel);
                let at = Chunk { x, k, n, panel: &panel, elements, ws: ws.clone(), xs: xs.clone() };
                let mut m0 = xs.start;
                while m0 < xs.end {
                    let xb = X_BLOCK.min(xs.end - m0);
                    let mut o0 = ws.start;
                    while o0 < ws.end {
                        let wb = W_BLOCK.min(ws.end - o0);
                        macro_rules! shapes {
                            ($(($b:literal, $j:literal)),*) => {
                                match (xb, wb) {
                                    $(($b, $j) => at.run::<$b, $j>(m0, o0, &mut waiting, y),)*
                                    _ => unreachable!("tiles of at most {X_BLOCK} × {W_BLOCK}"),
                                }
                            };
                        }
                        shapes!(
                            (4, 3),
                            (4, 2),
                            (4, 1),
                            (3, 3),
                            (3, 2),
                            (3, 1),
                            (2, 3),
                            (2, 2),
                            (2, 1),
                            (1, 3),
                            (1, 2),
                            (1, 1)
                        );
                        o0 += wb;
                    }
                    m0 += xb;
                }
            }
        }
    }
}

/// Elements `elements` of W's rows `ws` as floats, into the panel, [`CHUNK`] floats apart.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen(w: Weight, k: usize, ws: Range<usize>, elements: Range<usize>, panel: &mut Panel) {
    for (j, o) in ws.enumerate() {
        halves(w, o * k + elements.start, &mut panel.0[j * CHUNK..j * CHUNK + elements.len()]);
    }
}

/// A panel's rows, a chunk of each, aligned to cache lines: a vector load from a row never
/// straddles two lines (a load that does costs two), as it may from an allocator's buffer.
#[repr(C, align(64))]
struct Panel([f32; PANEL_W * CHUNK]);

/// One chunk of one panel: x [.., k]; W's rows `ws` widened, elements `elements`, in `panel`;
/// the panel of x's rows `xs`; y is [.., n].
struct Chunk<'a> {
    x: &'a [f32],
    k: usize,
    n: usize,
    panel: &'a Panel,
    elements: Range<usize>,
    ws: Range<usize>,
    xs: Range<usize>,
}

impl Chunk<'_> {
    /// The chunk's terms of y[m0 + b, o0 + j] for b < XB, j < WB, added to the accumulators
    /// `waiting` holds since the last chunk (one per output of the panels; from zero at the
    /// first chunk); at the last chunk their lanes are added into y.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const XB: usize, const WB: usize>(
        &self,
        m0: usize,
        o0: usize,
        waiting: &mut [__m256],
        y: &mut [f32],
    ) {
        let Chunk { x, k, n, panel, ref elements, ref ws, ref xs } = *self;
        let at = |b: usize, j: usize| (m0 + b - xs.start) * PANEL_W + o0 + j - ws.start;
        let mut acc = [[_mm256_setzero_ps(); XB]; WB];
        if elements.start > 0 {
            for j in 0..WB {
                for b in 0..XB {
                    acc[j][b] = waiting[at(b, j)];
                }
            }
        }
        let rows: [*const f32; XB] = std::array::from_fn(|b| x.as_ptr().add((m0 + b) * k + elements.start));
        let w = panel.0.as_ptr().add((o0 - ws.start) * CHUNK);
        for i in (0..elements.len()).step_by(8) {
            let wv: [__m256; WB] = std::array::from_fn(|j| _mm256_loadu_ps(w.add(j * CHUNK + i)));
            for b in 0..XB {
                let xv = _mm256_loadu_ps(rows[b].add(i));
                for j in 0..WB {
                    acc[j][b] = _mm256_fmadd_ps(wv[j], xv, acc[j][b]);
                }
            }
        }
        for j in 0..WB {
            for b in 0..XB {
                if elements.end == k {
                    y[(m0 + b) * n + o0 + j] = horizontal_sum(acc[j][b]);
                } else {
                    waiting[at(b, j)] = acc[j][b];
                }
            }
        }
    }
}
