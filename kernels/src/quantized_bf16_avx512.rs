//! MLX affine-quantized weights (4 and 8 bits) times bfloat16 activations, where the CPU has
//! AVX-512 BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids): the route of
//! [`super::dot::product`] for quantized weights and activations in bfloat16, the dtype of the
//! checkpoints users download (`mlx_lm convert -q`).
//!
//! Each group is summed as MLX's Metal kernels sum it, Σ (s·q + b)·x = s · Σ q·x + b · Σ x, and
//! `vdpbf16ps` computes Σ q·x 32 products per instruction: an integer of up to 8 bits and a
//! bfloat16 activation are both exact in bfloat16, and their product is exact in float32, so
//! each step is a float32 addition as in the other routes, in another order. The loops dequantizing
//! into float32 ([`crate::quantized_avx512`]) spend a conversion and a multiply-add per weight
//! before the product, which held a 4-bit product of one row below the machine's read rate and
//! one of sixteen rows at half the bfloat16 loops' multiply-adds per second (Zen 4).
//!
//! Making the bfloat16 weights:
//! - 4 bits: each 16-bit word of W holds four nibbles. Shifted right by 0, 4, 8 or 12, a word's
//!   low bits index a table of the bfloat16 values of 0 to 15 (`vpermw`, which reads five bits:
//!   the table holds the sixteen values twice), so one 64-byte load gives 128 weights in seven
//!   instructions. A 32-bit lane l pairs elements 8l + p and 8l + p + 4 of its block in vector p,
//!   and x is arranged to match once per call. (The bits of 1 + q/16 would take a shift and a
//!   mask per vector, and the Σ x they add cancels only to float32's precision, which moved the
//!   4-bit parity fixture's logits by two bfloat16 steps.)
//! - 8 bits: widened to 32-bit integers, converted to float32 and packed to bfloat16 (exactly:
//!   integers below 256 need 8 significant bits).
//!
//! Each 64-byte block of a row is one sum per output and row of x, in lanes whose elements
//! share a group (4 bits: lane l holds elements 8l to 8l + 7; 8 bits: lanes 0–7 the block's first
//! 32 elements, lanes 8–15 the rest), multiplied by its lanes' scales into the output's
//! accumulator. The bias terms, Σ_g b_g · Σ x_g, join the same accumulator sixteen groups a
//! vector before its lanes are summed. Each output is summed this way whatever the tile it falls
//! in or the number of rows, so a row gives the same result alone, in a verify window or in a
//! batch.

use std::arch::x86_64::*;

use crate::lanes::{prefetch_lines, store_sums};
use crate::weight::Quantized;
use crate::widen_avx2::prefetch_params;

/// Packed bytes per block: one 512-bit load.
const BLOCK_BYTES: usize = 64;
/// Register tiles of up to 4 x rows × 4 W rows: 16 accumulators, a block's sum per x row, and
/// for the W row at hand its weight vectors and scales. Tiles of six x rows (24 accumulators)
/// spilled registers: a 512-token prefill of the 1.3B 4-bit bench model ran at 65 against 93
/// tok/s (Zen 4, three runs each).
const X_BLOCK: usize = 4;
const W_BLOCK: usize = 4;
/// Bytes of arranged x rows per panel, and the most rows: a panel stays in L2 (1 MB on Zen 4,
/// 2 MB on Sapphire Rapids) while the blocks of W rows pass over it.
const PANEL_BYTES: usize = 256 << 10;
const MAX_PANEL: usize = 96;
/// How many blocks of W rows ahead their scales and biases are asked for: each block widens
/// them before its tiles run, and without the request it waits on memory.
const PARAMS_AHEAD: usize = 4;

pub fn available() -> bool {
    crate::lanes::available() && crate::simd::has!("avx512bw") && crate::simd::has!("avx512bf16")
}

/// Whether these loops take a weight of `bits` and `group`: every lane's elements in one group.
pub fn takes(bits: u32, group: usize) -> bool {
    (bits == 4 || bits == 8) && group.is_multiple_of(32)
}

/// `vpermw` reads the low five bits of each 16-bit index, a nibble and one bit of the next, so
/// entry i is the bfloat16 bits of i mod 16.
const NIBBLES: [u16; 32] = {
    let mut table = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        table[i] = ((i % 16) as f32).to_bits().wrapping_shr(16) as u16;
        i += 1;
    }
    table
};

/// Elements per block.
const fn block_elements(bits: u32) -> usize {
    BLOCK_BYTES * 8 / bits as usize
}

/// The element of its block that lane `lane` of a block's sum starts at (see the module's notes).
const fn lane_start(bits: u32, lane: usize) -> usize {
    if bits == 4 {
        8 * lane
    } else {
        32 * (lane / 8) + 2 * (lane % 8)
    }
}

/// Row `row` of x (bfloat16 values held as float32) as the bfloat16 bits the loops multiply,
/// block by block in the weights' order, zeros past k.
fn arrange(row: &[f32], bits: u32, out: &mut [u16]) {
    let bf16 = |i: usize| row.get(i).map_or(0, |v| (v.to_bits() >> 16) as u16);
    let per_block = block_elements(bits);
    for (b, block) in out.chunks_exact_mut(per_block).enumerate() {
        let base = b * per_block;
        if bits == 4 {
            // Vector p pairs elements 8l + p and 8l + p + 4 in 32-bit lane l.
            for p in 0..4 {
                for l in 0..16 {
                    block[p * 32 + 2 * l] = bf16(base + 8 * l + p);
                    block[p * 32 + 2 * l + 1] = bf16(base + 8 * l + p + 4);
                }
            }
        } else {
            // Vector 0 holds elements 0–15 and 32–47, vector 1 elements 16–31 and 48–63.
            for (at, from) in [(0, 0), (16, 32), (32, 16), (48, 48)] {
                for e in 0..16 {
                    block[at + e] = bf16(base + from + e);
                }
            }
        }
    }
}

/// y[m, o] for o in `outputs` and every row m of x [rows, k], whose values are bfloat16; y is
/// [rows, n].
///
/// # Safety
/// The CPU must have the features of [`available`], and `takes(w.bits, w.group)` must hold, with
/// k a multiple of the group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
pub unsafe fn product(
    x: &[f32],
    rows: usize,
    k: usize,
    w: Quantized,
    outputs: std::ops::Range<usize>,
    n: usize,
    y: &mut [f32],
) {
    let per_block = block_elements(w.bits);
    let stride = k.next_multiple_of(per_block);
    let groups = k / w.group;
    // Σ x per row and group, in element order, each row padded with zeros to whole vectors.
    let sums_stride = groups.next_multiple_of(16);
    let mut xb = vec![0u16; rows * stride];
    let mut sums = vec![0f32; rows * sums_stride];
    for m in 0..rows {
        let row = &x[m * k..(m + 1) * k];
        arrange(row, w.bits, &mut xb[m * stride..(m + 1) * stride]);
        for (sum, g) in sums[m * sums_stride..].iter_mut().zip(row.chunks_exact(w.group)) {
            *sum = g.iter().sum();
        }
    }
    // Each W row's scales and biases as floats, a block of W rows at a time (contiguous in
    // memory), and sixteen more for whole-vector loads.
    let mut scales = vec![0f32; W_BLOCK * groups + 16];
    let mut biases = vec![0f32; W_BLOCK * groups + 16];
    let lane_group: [i32; 16] = std::array::from_fn(|l| (lane_start(w.bits, l) / w.group) as i32);
    let lane_group = _mm512_loadu_si512(lane_group.as_ptr() as *const _);
    // Panels of x's rows that stay in L2 while every block of W rows passes over them.
    let panel = (PANEL_BYTES / (2 * stride)).clamp(1, MAX_PANEL).next_multiple_of(X_BLOCK);
    for first in (0..rows).step_by(panel) {
        let last = rows.min(first + panel);
        let mut o = outputs.start;
        while o < outputs.end {
            let width = W_BLOCK.min(outputs.end - o);
            let later = (o + PARAMS_AHEAD * W_BLOCK).min(outputs.end);
            prefetch_params::<_MM_HINT_T1>(&w, k, later..(later + width).min(outputs.end));
            crate::widen_avx2::widen_params(w.scales, o * groups, &mut scales[..width * groups]);
            crate::widen_avx2::widen_params(w.biases, o * groups, &mut biases[..width * groups]);
            let ahead = width.min(outputs.end - o - width);
            let mut m0 = first;
            while m0 < last {
                let block = X_BLOCK.min(last - m0);
                let at = Tile {
                    x: &xb,
                    stride,
                    sums: &sums,
                    sums_stride,
                    w,
                    k,
                    scales: &scales,
                    biases: &biases,
                    groups,
                    lane_group,
                    m0,
                    o,
                    n,
                };
                // The first tile of each block of W rows asks for the next block's lines.
                let ahead = if m0 == first { ahead } else { 0 };
                macro_rules! shapes {
                    ($($b:literal, $j:literal);*) => {
                        match (w.bits == 4, block, width) {
                            $((false, $b, $j) => at.run::<$b, $j, 8>(ahead, y),
                              (true, $b, $j) => at.run::<$b, $j, 4>(ahead, y),)*
                            _ => unreachable!("blocks of at most {X_BLOCK} x rows and {W_BLOCK} W rows"),
                        }
                    };
                }
                shapes!(4, 4; 3, 4; 2, 4; 1, 4; 4, 3; 3, 3; 2, 3; 1, 3; 4, 2; 3, 2; 2, 2; 1, 2; 4, 1; 3, 1; 2, 1; 1, 1);
                m0 += block;
            }
            o += width;
        }
    }
}

/// Where a register tile works: x as [`product`] arranged it (`stride` apart) with its group
/// sums, W's rows `o..` with their block's scales and biases (`groups` per row), from x row
/// `m0`; y is [rows, n].
struct Tile<'a> {
    x: &'a [u16],
    stride: usize,
    sums: &'a [f32],
    sums_stride: usize,
    w: Quantized<'a>,
    k: usize,
    scales: &'a [f32],
    biases: &'a [f32],
    groups: usize,
    /// Lane l of a block's sum belongs to group `lane_group[l]` counted from the block's first.
    lane_group: __m512i,
    m0: usize,
    o: usize,
    n: usize,
}

impl Tile<'_> {
    /// y[m0 + b, o + j] for b < XB, j < WB, each output in its own accumulator.
    #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    unsafe fn run<const XB: usize, const WB: usize, const BITS: u32>(&self, ahead: usize, y: &mut [f32]) {
        let Tile { x, stride, sums, sums_stride, w, k, scales, biases, groups, lane_group, m0, o, n } = *self;
        let row_bytes = k * BITS as usize / 8;
        let per_block = block_elements(BITS);
        let bytes = w.packed.as_ptr() as *const u8;
        let next = bytes.wrapping_add((o + WB) * row_bytes);
        let mut acc = [[_mm512_setzero_ps(); XB]; WB];
        // (Explicit loops throughout: closures would not inherit the target features.)
        let mut start = 0;
        while start < k {
            let at = start * BITS as usize / 8;
            prefetch_lines(next, row_bytes, ahead, at);
            let first_group = start / w.group;
            let whole = k - start >= per_block;
            for j in 0..WB {
                let row = bytes.add((o + j) * row_bytes + at);
                let scale = scales.as_ptr().add(j * groups + first_group);
                let scale = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(scale));
                let weights = if BITS == 4 { nibbles(row, k - start) } else { bytes_of(row, whole) };
                for b in 0..XB {
                    let xs = x.as_ptr().add((m0 + b) * stride + start);
                    let mut sum = _mm512_setzero_ps();
                    for (v, weight) in weights.iter().enumerate().take(if BITS == 4 { 4 } else { 2 }) {
                        let xv =
                            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(xs.add(32 * v) as *const _));
                        sum = _mm512_dpbf16_ps(sum, xv, *weight);
                    }
                    acc[j][b] = _mm512_fmadd_ps(sum, scale, acc[j][b]);
                }
            }
            start += per_block;
        }
        // The bias terms, sixteen groups a vector (zeros past the last group on both sides).
        for g in (0..groups).step_by(16) {
            let mask = if groups - g >= 16 { 0xFFFF } else { (1u16 << (groups - g)) - 1 };
            for j in 0..WB {
                let bias = _mm512_maskz_loadu_ps(mask, biases.as_ptr().add(j * groups + g));
                for b in 0..XB {
                    let sum = _mm512_loadu_ps(sums.as_ptr().add((m0 + b) * sums_stride + g));
                    acc[j][b] = _mm512_fmadd_ps(bias, sum, acc[j][b]);
                }
            }
        }
        store_sums(acc, y, m0, o, n);
    }
}

/// The four bfloat16 vectors of a 4-bit block from `row` (`rest` elements left in the row: a
/// last partial block reads only its own words, the rest zeros).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
unsafe fn nibbles(row: *const u8, rest: usize) -> [__m512bh; 4] {
    let words = if rest >= 128 {
        _mm512_loadu_si512(row as *const _)
    } else {
        _mm512_maskz_loadu_epi32(((1u32 << (rest / 8)) - 1) as __mmask16, row as *const i32)
    };
    let table = _mm512_loadu_si512(NIBBLES.as_ptr() as *const _);
    let made = [
        _mm512_permutexvar_epi16(words, table),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), table),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(words), table),
        _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(words), table),
    ];
    made.map(|v| std::mem::transmute::<__m512i, __m512bh>(v))
}

/// The two bfloat16 vectors of an 8-bit block from `row`: bytes 0–15 and 32–47, then 16–31 and
/// 48–63 (zeros for the second half of a last block of 32 elements).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
unsafe fn bytes_of(row: *const u8, whole: bool) -> [__m512bh; 4] {
    let (upper0, upper1) =
        if whole { (floats(row, 32), floats(row, 48)) } else { (_mm512_setzero_ps(), _mm512_setzero_ps()) };
    let unused = std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512());
    [_mm512_cvtne2ps_pbh(upper0, floats(row, 0)), _mm512_cvtne2ps_pbh(upper1, floats(row, 16)), unused, unused]
}

/// Sixteen bytes from `row + at` as floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
unsafe fn floats(row: *const u8, at: usize) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(at) as *const __m128i)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block's bfloat16 weights are its integers, each paired with the x
    /// elements `arrange` puts beside them: the sum of a block's products against an x of ones at
    /// one element is that element's weight.
    #[test]
    fn each_weight_meets_its_own_element() {
        if !available() {
            return;
        }
        for bits in [4u32, 8] {
            let per_block = block_elements(bits);
            let k = per_block;
            // Element e's weight: 1 + (e mod 15) for 4 bits, 1 + (7e mod 255) for 8 (never zero, so
            // that its lane shows).
            let q = |e: usize| if bits == 4 { 1 + (e % 15) as u32 } else { 1 + (e * 7 % 255) as u32 };
            let mut packed = vec![0u32; k * bits as usize / 32];
            for e in 0..k {
                let per_word = 32 / bits as usize;
                packed[e / per_word] |= q(e) << (bits as usize * (e % per_word));
            }
            for e in 0..k {
                let mut row = vec![0f32; k];
                row[e] = 1.0;
                let mut xb = vec![0u16; k];
                arrange(&row, bits, &mut xb);
                // SAFETY: the CPU has the features (checked above); the loads read one block.
                let total = unsafe {
                    let weights = if bits == 4 {
                        nibbles(packed.as_ptr() as *const u8, k).to_vec()
                    } else {
                        bytes_of(packed.as_ptr() as *const u8, true)[..2].to_vec()
                    };
                    let mut sum = _mm512_setzero_ps();
                    for (v, weight) in weights.iter().enumerate() {
                        let xv = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                            xb.as_ptr().add(32 * v) as *const _
                        ));
                        sum = _mm512_dpbf16_ps(sum, xv, *weight);
                    }
                    let lanes: [f32; 16] = std::mem::transmute(sum);
                    // The element lands in the lane its group's scale is taken from.
                    let lane = lanes.iter().position(|&v| v != 0.0).unwrap();
                    assert_eq!(lane_start(bits, lane) / 32, e / 32, "{bits} bits, element {e} in lane {lane}");
                    if bits == 4 {
                        assert_eq!(lane, e / 8, "element {e}");
                    }
                    lanes.iter().sum::<f32>()
                };
                let expected = q(e) as f32;
                assert_eq!(total, expected, "{bits} bits, element {e}");
            }
        }
    }
}
