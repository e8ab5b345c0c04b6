//! MLX affine-quantized weights (4 and 8 bits) times float32 rows, on AVX-512: the route of
//! [`super::dot::product`] for quantized weights not held as tiles (scales of another dtype
//! than bfloat16) where the CPU has it, except for bfloat16 activations on CPUs with AVX-512
//! BF16 ([`crate::quantized_bf16_avx512`]).
//!
//! Each weight is dequantized as MLX does (w = scale · q + bias, one multiply-add in float32)
//! straight from its packed bytes into a register and multiplied into every row of x in the
//! tile; nothing is written back to memory. The AVX2 loops instead convert each row of W into an
//! L1 buffer and read it back, about twice the operations per weight, which bounds them at about
//! half the machine's read rate on one row.
//!
//! Sixteen weights make one vector: 8-bit weights are sixteen bytes, widened in place. 4-bit
//! weights are read thirty-two at a time (sixteen bytes): the low nibbles are the even elements
//! and the high nibbles the odd ones, so x is split once per call into the same even and odd
//! halves of every 32 elements, and each half multiplies its own vector of weights.
//!
//! For 4-bit weights, each group's sixteen values made once and looked up by nibble (`vpermps`)
//! is no faster, on Zen 4 or on a Xeon with AMX.

use std::arch::x86_64::*;

use super::lanes::store_sums;
use crate::weight::{Quantized, Weight};

/// Register tiles of up to 4 x rows × 4 W rows: sixteen accumulators, and for each W row its
/// scale, bias and weight vector.
const X_BLOCK: usize = 4;
const W_BLOCK: usize = 4;
/// Five or six rows (a verify window) share one tile of 3 W rows instead: each weight is then
/// dequantized once for all of them, not once for the first four and again for the rest.
/// Eighteen accumulators and nine vectors for scales, biases and weights fit the registers.
const WIDE_ROWS: std::ops::RangeInclusive<usize> = 5..=6;
const WIDE_W_BLOCK: usize = 3;

pub fn available() -> bool {
    super::lanes::available()
}

/// Whether these loops take a weight of `bits` and `group`: whole vectors never straddle groups.
pub fn takes(bits: u32, group: usize) -> bool {
    (bits == 4 || bits == 8) && group.is_multiple_of(32)
}

/// y[m, o] for o in `outputs` and every row m of x [rows, k]; y is [rows, n].
///
/// # Safety
/// The CPU must have the features of [`available`], and `takes(w.bits, w.group)` must hold.
#[target_feature(enable = "avx512f,avx512vl,avx512dq")]
pub unsafe fn product(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Quantized,
    outputs: std::ops::Range<usize>,
    n: usize,
    y: &mut [f32],
) {
    // 4-bit: x's elements in the order the nibbles come out of sixteen bytes.
    let split;
    let x = if w.bits == 4 {
        split = crate::weight::even_then_odd(x, 32);
        &split[..]
    } else {
        x
    };
    let wide = WIDE_ROWS.contains(&rows);
    let mut o = outputs.start;
    while o < outputs.end {
        let width = if wide { WIDE_W_BLOCK } else { W_BLOCK }.min(outputs.end - o);
        // As the other loops do: the next block of W rows is asked for while this one is used.
        crate::widen_avx2::prefetch_rows(Weight::Quantized(w), k, o + width..(o + 2 * width).min(outputs.end));
        let mut m0 = 0;
        while m0 < rows {
            let block = if wide { rows } else { X_BLOCK.min(rows - m0) };
            let at = Tile { x, k, w, m0, o, n };
            macro_rules! shapes {
                ($($b:literal, $j:literal);*) => {
                    match (w.bits == 4, block, width) {
                        $((false, $b, $j) => at.run::<$b, $j, 8>(y), (true, $b, $j) => at.run::<$b, $j, 4>(y),)*
                        _ => unreachable!("blocks of at most {X_BLOCK} x rows and {W_BLOCK} W rows, or {WIDE_ROWS:?} and {WIDE_W_BLOCK}"),
                    }
                };
            }
            shapes!(4, 4; 3, 4; 2, 4; 1, 4; 4, 3; 3, 3; 2, 3; 1, 3; 4, 2; 3, 2; 2, 2; 1, 2; 4, 1; 3, 1; 2, 1; 1, 1;
                    6, 3; 5, 3; 6, 2; 5, 2; 6, 1; 5, 1);
            m0 += block;
        }
        o += width;
    }
}

/// Where a register tile works: x (as [`product`] arranged it), W's rows `o..`, from x row m0.
struct Tile<'a> {
    x: &'a [f32],
    k: usize,
    w: Quantized<'a>,
    m0: usize,
    o: usize,
    n: usize,
}

impl Tile<'_> {
    /// y[m0 + b, o + j] for b < XB, j < WB, each output in its own accumulator; element i of a
    /// run of 16 (8-bit) or of each half of a run of 32 (4-bit) goes to lane i, and the lanes
    /// are summed last.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx512f,avx512vl,avx512dq")]
    unsafe fn run<const XB: usize, const WB: usize, const BITS: usize>(&self, y: &mut [f32]) {
        let Tile { x, k, w, m0, o, n } = *self;
        let row_bytes = k * BITS / 8;
        let bytes = w.packed.as_ptr() as *const u8;
        let groups = k / w.group;
        let mut acc = [[_mm512_setzero_ps(); XB]; WB];
        // (Explicit loops throughout: closures would not inherit the target features.)
        let (mut scale, mut bias) = ([_mm512_setzero_ps(); WB], [_mm512_setzero_ps(); WB]);
        let mut packed = [_mm512_setzero_si512(); WB];
        let (mut first, mut second) = ([_mm512_setzero_ps(); WB], [_mm512_setzero_ps(); WB]);
        for g in 0..groups {
            for j in 0..WB {
                scale[j] = _mm512_set1_ps(w.scales.get((o + j) * groups + g));
                bias[j] = _mm512_set1_ps(w.biases.get((o + j) * groups + g));
            }
            // Sixteen bytes at a time: sixteen 8-bit weights or thirty-two 4-bit ones.
            let mut i = g * w.group;
            while i < (g + 1) * w.group {
                for j in 0..WB {
                    let at = bytes.add((o + j) * row_bytes + i * BITS / 8);
                    packed[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i));
                }
                if BITS == 8 {
                    for j in 0..WB {
                        first[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(packed[j]), scale[j], bias[j]);
                    }
                    for b in 0..XB {
                        let xv = _mm512_loadu_ps(x.as_ptr().add((m0 + b) * k + i));
                        for j in 0..WB {
                            acc[j][b] = _mm512_fmadd_ps(first[j], xv, acc[j][b]);
                        }
                    }
                    i += 16;
                } else {
                    // Low nibbles: the even elements; high: the odd ones.
                    let low = _mm512_set1_epi32(0xF);
                    for j in 0..WB {
                        let even = _mm512_cvtepi32_ps(_mm512_and_si512(packed[j], low));
                        let odd = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(packed[j]));
                        first[j] = _mm512_fmadd_ps(even, scale[j], bias[j]);
                        second[j] = _mm512_fmadd_ps(odd, scale[j], bias[j]);
                    }
                    for b in 0..XB {
                        let xe = _mm512_loadu_ps(x.as_ptr().add((m0 + b) * k + i));
                        let xo = _mm512_loadu_ps(x.as_ptr().add((m0 + b) * k + i + 16));
                        for j in 0..WB {
                            acc[j][b] = _mm512_fmadd_ps(first[j], xe, acc[j][b]);
                            acc[j][b] = _mm512_fmadd_ps(second[j], xo, acc[j][b]);
                        }
                    }
                    i += 32;
                }
            }
        }
        store_sums(acc, y, m0, o, n);
    }
}
