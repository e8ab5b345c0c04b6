//! `y = x · Wᵀ`, reading each weight once: the inner loops, per weight format.
//!
//! Written by hand because neither MLX nor a BLAS does this well on the CPU: OpenBLAS packs the
//! whole weight for every product, even of one row, and MLX's bfloat16 and quantized CPU
//! kernels are generic or scalar code. Decoding reads every weight once per step, so the
//! step's time is the time to stream the weights from memory; these loops convert each loaded
//! row of W once into a buffer that stays in L1 and use it for every row of x. Each row of x is
//! summed in the same order whatever the number of rows.
//!
//! Weights held as tiles ([`crate::packed`]: plain bfloat16 ones on a CPU with AMX or AVX-512,
//! quantized ones with bfloat16 scales there too and on CPUs with AVX2 but no AVX-512) never
//! come here.
//!
//! Routes, chosen at run time by the CPU's features (narrowed by `HOST_SIMD`, [`crate::simd`]):
//! - quantized weights with `HOST_QUANTIZED_ACTIVATIONS=int8`, on any CPU with AVX2
//!   ([`crate::quantized_avx2`]): integer products on activations rounded to 8 bits;
//! - bfloat16 weights times bfloat16 activations, where the CPU has AVX-512 BF16 (Zen 4,
//!   Cooper Lake, Sapphire Rapids): `vdpbf16ps` multiplies pairs of bfloat16 values straight
//!   from memory into float32 sums. The AVX2 loops spend several instructions per eight weights
//!   widening them, which bounds a bfloat16 product at about half the machine's read rate even
//!   for one row; without the widening the loads are the limit. Each product of two bfloat16
//!   values is exact in float32, so every step is a float32 multiply-add as in the other routes,
//!   in another order.
//! - quantized weights times bfloat16 activations where the CPU has AVX-512 BF16
//!   ([`crate::quantized_bf16_avx512`]): per group, scale · Σ q·x + bias · Σ x, the integers made
//!   bfloat16 in registers and multiplied 32 at a time by `vdpbf16ps`;
//! - other quantized products (scales of another dtype) where the CPU has AVX-512
//!   ([`crate::quantized_avx512`]): dequantized in registers straight from their packed bytes;
//! - quantized weights on other CPUs with AVX2 ([`crate::quantized_f32_avx2`]): per group,
//!   scale · Σ q·x + bias · Σ x;
//! - AVX2 with FMA for everything else where the CPU has it; up to six rows of half-precision
//!   weights widened in registers ([`crate::narrow_avx2`]), more in blocks that keep a tile's
//!   operands in L1 ([`crate::blocked_avx2`]), both summed as these loops sum.
//! - a portable loop elsewhere.
//!
//! A route depends only on the CPU, the weight's format and the dtype x was widened from, never
//! on how many rows share the product, so a row's result is the same alone or in a window.

use mlx_rs::Dtype;

pub use crate::weight::{Params, Quantized, Weight};

/// Where a sum's terms go depends on their index modulo this (the AVX-512 BF16 loops' 32
/// elements per vector; the AVX2 loops' 8 divides it). Terms laid out from an index that is a
/// multiple of it are summed alike, so keys placed by position modulo it give a query the same
/// attention whatever the slots before them held (see the host's KV cache).
pub const SUM_PERIOD: usize = 32;

/// The most float32 rows one call handles for weights MLX reads faster at many rows (through
/// BLAS); half-precision weights or activations take these loops at any row count (see
/// `kernels`).
pub const MAX_ROWS: usize = 16;

/// Computes y[m, o] for outputs `outputs` (a range of rows of W) and every row m of x [rows, k];
/// y is [rows, n] and only its `outputs` columns are written. `x_dtype` is the dtype x's values
/// were widened from (bfloat16 values take the AVX-512 BF16 loops where the CPU has them).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn product(
    x: &[f32],
    x_dtype: Dtype,
    rows: usize,
    k: usize,
    w: Weight,
    outputs: std::ops::Range<usize>,
    n: usize,
    y: &mut [f32],
) {
    debug_assert!(x.len() == rows * k && y.len() == rows * n);
    #[cfg(target_arch = "x86_64")]
    {
        if let (Weight::Bf16(w), Dtype::Bfloat16) = (w, x_dtype) {
            if avx512_bf16::available() {
                // SAFETY: the CPU has AVX-512 F, BW and BF16 (checked by `available`).
                unsafe { avx512_bf16::product(x, rows, k, w, outputs, n, y) };
                return;
            }
        }
        if let Weight::F32(w) = w {
            if avx512_f32::available() {
                // SAFETY: the CPU has AVX-512 F, VL and DQ (checked by `available`).
                unsafe { avx512_f32::product(x, rows, k, w, outputs, n, y) };
                return;
            }
        }
        if let Weight::Quantized(w) = w {
            if activations_quantized(&w, k) {
                // SAFETY: the CPU has AVX2, FMA and F16C, and the loops take this format (checked).
                unsafe { super::quantized_avx2::product(x, rows, k, w, outputs, n, y) };
                return;
            }
            let bf16_rows = x_dtype == Dtype::Bfloat16;
            if bf16_rows
                && super::quantized_bf16_avx512::takes(w.bits, w.group)
                && super::quantized_bf16_avx512::available()
            {
                // SAFETY: the CPU has the features and the loops take this format (checked).
                unsafe { super::quantized_bf16_avx512::product(x, rows, k, w, outputs, n, y) };
                return;
            }
            if super::quantized_avx512::takes(w.bits, w.group) && super::quantized_avx512::available() {
                // SAFETY: the CPU has the features and the loops take this format (checked).
                unsafe { super::quantized_avx512::product(x, rows, k, w, outputs, n, y) };
                return;
            }
            if super::quantized_f32_avx2::takes(&w) && super::quantized_f32_avx2::available() {
                // SAFETY: the CPU has AVX2, FMA and F16C, and the loops take this format (checked).
                unsafe { super::quantized_f32_avx2::product(x, rows, k, w, outputs, n, y) };
                return;
            }
        }
        let features = crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c");
        if features {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { avx2::product(x, rows, k, w, outputs, n, y) };
            return;
        }
    }
    portable::product(x, rows, k, w, outputs, n, y)
}

/// Whether quantized products of `w` (rows of `k`) take the integer loops, which round the
/// activations to 8 bits ([`crate::quantized_avx2`]): asked for with
/// `HOST_QUANTIZED_ACTIVATIONS=int8`, on any x86 CPU with AVX2 (with AVX-512 too: the user
/// asked; weights repacked for AMX keep the tile unit). Otherwise quantized products sum in
/// float32, on the activations as they are.
pub fn activations_quantized(w: &Quantized, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::quantized_avx2::takes(w, k) && super::quantized_avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, k);
        false
    }
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
                Weight::Quantized(w) => {
                    for (i, r) in row.iter_mut().enumerate() {
                        let g = o * (k / w.group) + i / w.group;
                        *r = w.scales.get(g) * w.q(o, k, i) as f32 + w.biases.get(g);
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
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    use super::*;
    use crate::widen_avx2::{horizontal_sum, prefetch_rows, u4x8, u8x8};

    /// The most rows of x and of W one register tile handles: up to 4 × 2 accumulators (3 × 4
    /// for float32 rows read in place, 1 × 4 for a single row of x, where more rows of W give
    /// the FMA units independent chains) stay in registers; each loaded weight vector serves
    /// every row of x in the tile, each loaded x vector every row of W.
    const X_BLOCK: usize = 4;
    const W_BLOCK: usize = 4;

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
            Weight::Quantized(w) => w.group.is_multiple_of(8) && (w.bits == 4 || w.bits == 8),
            _ => true,
        };
        if !supported {
            return portable::product(x, rows, k, w, outputs, n, y);
        }
        if crate::narrow_avx2::takes(w, k) {
            // Half-precision rows of whole vectors: up to six rows of x widened in registers,
            // more through the blocked loops, which keep both operands of a tile in L1.
            // SAFETY: this function's features are those loops', and rows and format are checked.
            return if (1..=crate::narrow_avx2::MAX_ROWS).contains(&rows) {
                crate::narrow_avx2::product(x, rows, k, w, outputs, n, y)
            } else {
                crate::blocked_avx2::product(x, rows, k, w, outputs, n, y)
            };
        }
        // Four W rows for a single x row while their converted floats stay well inside L1, and
        // for float32 rows read in place at any row count: four rows streamed at once keep the
        // memory busier than two, which counts most at a few x rows, where the weight's stream
        // is the limit. Their tiles take three x rows (twelve accumulators and four weight
        // vectors fill the sixteen registers), two from nine rows on, where tiles of three x
        // rows read the weight slower than tiles of two.
        let in_place = matches!(w, Weight::F32(_)) && k.is_multiple_of(8);
        let w_block = if (rows == 1 && k <= 1024) || in_place { 4 } else { 2 };
        let x_block = match (w_block, rows) {
            (4, ..=8) => 3,
            (4, _) => 2,
            _ => X_BLOCK,
        };
        // Rows of W in another format (or of a length that is not a whole number of vectors)
        // are converted to floats once, into a buffer that stays in L1 and is padded with zeros
        // to whole vectors, and read from there by every block of x rows.
        let stride = k.next_multiple_of(8);
        let mut converted = vec![0f32; W_BLOCK * stride];
        let mut o = outputs.start;
        while o < outputs.end {
            let width = w_block.min(outputs.end - o);
            // Rows read in place ask for the next block's a line at a time (`Tile::ahead`; they
            // follow this block's); converted ones are read whole by the conversion, so the
            // block is asked for whole.
            let next = o + width..(o + 2 * width).min(outputs.end);
            let rows_of_w = match w {
                Weight::F32(w) if in_place => &w[o * k..(o + width) * k],
                _ => {
                    prefetch_rows(w, k, next.clone());
                    for j in 0..width {
                        convert_row(w, o + j, k, &mut converted[j * stride..j * stride + k]);
                    }
                    &converted[..width * stride]
                }
            };
            let mut m0 = 0;
            while m0 < rows {
                let block = x_block.min(rows - m0);
                let at = Tile { x, k, w: rows_of_w, m0, o, n, ahead: if in_place && m0 == 0 { next.len() } else { 0 } };
                match (block, width) {
                    (3, 4) => at.run::<3, 4>(y),
                    (3, 3) => at.run::<3, 3>(y),
                    (2, 4) => at.run::<2, 4>(y),
                    (2, 3) => at.run::<2, 3>(y),
                    (4, 2) => at.run::<4, 2>(y),
                    (3, 2) => at.run::<3, 2>(y),
                    (2, 2) => at.run::<2, 2>(y),
                    (1, 4) => at.run::<1, 4>(y),
                    (1, 3) => at.run::<1, 3>(y),
                    (1, 2) => at.run::<1, 2>(y),
                    (4, 1) => at.run::<4, 1>(y),
                    (3, 1) => at.run::<3, 1>(y),
                    (2, 1) => at.run::<2, 1>(y),
                    (1, 1) => at.run::<1, 1>(y),
                    _ => unreachable!("blocks of at most {X_BLOCK} x rows and {W_BLOCK} W rows"),
                }
                m0 += block;
            }
            o += width;
        }
    }

    /// Row r of W as floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn convert_row(w: Weight, r: usize, k: usize, out: &mut [f32]) {
        let dst = out.as_mut_ptr();
        match w {
            Weight::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            Weight::Bf16(_) | Weight::F16(_) => crate::widen_avx2::halves(w, r * k, out),
            Weight::Quantized(Quantized { packed, scales, biases, bits, group }) => {
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

    /// Where a register tile works: x [rows, k], the W rows `w` (float32, each padded with zeros
    /// to whole vectors) that are outputs `o..`, from x row `m0`; y is [rows, n].
    struct Tile<'a> {
        x: &'a [f32],
        k: usize,
        w: &'a [f32],
        m0: usize,
        o: usize,
        n: usize,
        /// Rows after `w`'s (in place, `k` floats apart) asked for a line at a time as the loop
        /// passes the same place in its own.
        ahead: usize,
    }

    impl Tile<'_> {
        /// y[m0 + b, o + j] = Σ_i w[j, i] · x[m0 + b, i] for b < XB, j < WB. The block sizes are
        /// constants so that the accumulators stay in registers.
        ///
        /// Element i of a row always goes to lane i mod 8 and the lanes are summed last, so a sum
        /// does not change when zeros are appended to both operands: an attention over keys
        /// padded with masked (zero-probability) slots gives what it gives over the keys alone.
        /// Nor does it depend on the block sizes: each output has its own accumulator.
        #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn run<const XB: usize, const WB: usize>(&self, y: &mut [f32]) {
            let Tile { x, k, w, m0, o, n, ahead } = *self;
            let stride = k.next_multiple_of(8);
            let (whole, tail) = (k / 8 * 8, k % 8);
            let mut acc = [[_mm256_setzero_ps(); XB]; WB];
            let next = w.as_ptr().wrapping_add(WB * stride);
            let mut i = 0;
            while i < whole {
                if ahead > 0 && i % 16 == 0 {
                    crate::lanes::prefetch_lines(next, stride, ahead, i);
                }
                let xs: [*const f32; XB] = std::array::from_fn(|b| x.as_ptr().add((m0 + b) * k + i));
                accumulate::<XB, WB>(&mut acc, w.as_ptr().add(i), stride, xs);
                i += 8;
            }
            if tail > 0 {
                // The last partial vector of each x row, padded with zeros.
                let mut padded = [[0f32; 8]; XB];
                for b in 0..XB {
                    padded[b][..tail].copy_from_slice(&x[(m0 + b) * k + whole..(m0 + b + 1) * k]);
                }
                let xs: [*const f32; XB] = std::array::from_fn(|b| padded[b].as_ptr());
                accumulate::<XB, WB>(&mut acc, w.as_ptr().add(whole), stride, xs);
            }
            for j in 0..WB {
                for b in 0..XB {
                    y[(m0 + b) * n + o + j] = horizontal_sum(acc[j][b]);
                }
            }
        }
    }

    /// One vector of every (x row, W row) pair: `w` points at the first W row's vector, the
    /// others `stride` floats apart; `xs[b]` at x row b's.
    #[inline(always)]
    unsafe fn accumulate<const XB: usize, const WB: usize>(
        acc: &mut [[__m256; XB]; WB],
        w: *const f32,
        stride: usize,
        xs: [*const f32; XB],
    ) {
        let wv: [__m256; WB] = std::array::from_fn(|j| _mm256_loadu_ps(w.add(j * stride)));
        for b in 0..XB {
            let xv = _mm256_loadu_ps(xs[b]);
            for j in 0..WB {
                acc[j][b] = _mm256_fmadd_ps(wv[j], xv, acc[j][b]);
            }
        }
    }
}

/// A register tile of the AVX-512 loops, placed at x row `m0` and W row `o` when built:
/// `run::<XB, WB>` multiplies XB rows of x by WB rows of W into y, and asks for the line of
/// each of the `ahead` W rows after its own that lies where it reads its own rows' lines.
///
/// Spreading those requests over the loop, one line per row and step, keeps the weight's
/// stream going while the tile computes. Asking for the next block's rows whole before each
/// tile, as the AVX2 loops do, leaves the stream idle between those bursts: a float32 weight
/// streamed from L3 is then read markedly slower, by one row alone and more so by a window of
/// several.
#[cfg(target_arch = "x86_64")]
trait RegisterTile {
    /// # Safety
    /// The CPU has the loops' features; the tile's rows lie inside x, W and y (the rows it asks
    /// for need not: a prefetch never faults).
    unsafe fn run<const XB: usize, const WB: usize>(&self, ahead: usize, y: &mut [f32]);
}

/// Register tiles of up to `x_block` (at most 6) × `w_block` (at most 4) rows over every row of
/// x and W's rows `outputs`, the next block of W rows asked for while one is multiplied (by
/// the first tile of each block). `tile(m0, o)` places a tile.
///
/// # Safety
/// As [`RegisterTile::run`].
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn each_tile<T: RegisterTile>(
    rows: usize,
    outputs: std::ops::Range<usize>,
    (x_block, w_block): (usize, usize),
    tile: impl Fn(usize, usize) -> T,
    y: &mut [f32],
) {
    let mut o = outputs.start;
    while o < outputs.end {
        let width = w_block.min(outputs.end - o);
        let mut ahead = width.min(outputs.end - o - width);
        let mut m0 = 0;
        while m0 < rows {
            let block = x_block.min(rows - m0);
            let at = tile(m0, o);
            match (block, width) {
                (6, 4) => at.run::<6, 4>(ahead, y),
                (5, 4) => at.run::<5, 4>(ahead, y),
                (4, 4) => at.run::<4, 4>(ahead, y),
                (3, 4) => at.run::<3, 4>(ahead, y),
                (2, 4) => at.run::<2, 4>(ahead, y),
                (1, 4) => at.run::<1, 4>(ahead, y),
                (6, 3) => at.run::<6, 3>(ahead, y),
                (5, 3) => at.run::<5, 3>(ahead, y),
                (4, 3) => at.run::<4, 3>(ahead, y),
                (3, 3) => at.run::<3, 3>(ahead, y),
                (2, 3) => at.run::<2, 3>(ahead, y),
                (1, 3) => at.run::<1, 3>(ahead, y),
                (6, 2) => at.run::<6, 2>(ahead, y),
                (5, 2) => at.run::<5, 2>(ahead, y),
                (4, 2) => at.run::<4, 2>(ahead, y),
                (3, 2) => at.run::<3, 2>(ahead, y),
                (2, 2) => at.run::<2, 2>(ahead, y),
                (1, 2) => at.run::<1, 2>(ahead, y),
                (6, 1) => at.run::<6, 1>(ahead, y),
                (5, 1) => at.run::<5, 1>(ahead, y),
                (4, 1) => at.run::<4, 1>(ahead, y),
                (3, 1) => at.run::<3, 1>(ahead, y),
                (2, 1) => at.run::<2, 1>(ahead, y),
                (1, 1) => at.run::<1, 1>(ahead, y),
                _ => unreachable!("blocks of at most 6 x rows and 4 W rows, not {block} × {width}"),
            }
            m0 += block;
            ahead = 0;
        }
        o += width;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_f32 {
    use std::arch::x86_64::*;

    /// float32 values per 512-bit vector.
    const LANES: usize = 16;
    /// Register tiles of up to 6 x rows × 4 W rows: 24 accumulators, four weight vectors and one
    /// x vector in the 32 vector registers. A 5-token verify window is one tile deep, each
    /// weight loaded once into a register for all five rows, where the AVX2 loops (eight lanes,
    /// tiles of three x rows) loaded it twice and took twice the multiply-adds.
    const X_BLOCK: usize = 6;
    const W_BLOCK: usize = 4;

    pub fn available() -> bool {
        crate::lanes::available()
    }

    /// [`super::product`] for float32 W, read in place; the last partial vector of every row,
    /// of W and of x alike, through a mask (zeros past k).
    #[target_feature(enable = "avx512f,avx512vl,avx512dq")]
    pub unsafe fn product(
        x: &[f32],
        rows: usize,
        k: usize,
        w: &[f32],
        outputs: std::ops::Range<usize>,
        n: usize,
        y: &mut [f32],
    ) {
        super::each_tile(rows, outputs, (X_BLOCK, W_BLOCK), |m0, o| Tile { x, w, k, m0, o, n }, y);
    }

    /// Where a register tile works: x's rows and W's rows `o..` (both k apart), from x row
    /// `m0`; y is [rows, n].
    struct Tile<'a> {
        x: &'a [f32],
        w: &'a [f32],
        k: usize,
        m0: usize,
        o: usize,
        n: usize,
    }

    impl super::RegisterTile for Tile<'_> {
        /// y[m0 + b, o + j] = Σ_i w[o + j, i] · x[m0 + b, i] for b < XB, j < WB, each output in
        /// its own accumulator. Element i goes to lane i mod 16 and the lanes are summed last
        /// by one tree ([`crate::lanes::store_sums`]), so a sum does not change when
        /// zeros are appended to both operands, nor with the tile its row shares.
        #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
        #[target_feature(enable = "avx512f,avx512vl,avx512dq")]
        unsafe fn run<const XB: usize, const WB: usize>(&self, ahead: usize, y: &mut [f32]) {
            let Tile { x, w, k, m0, o, n } = *self;
            let mut acc = [[_mm512_setzero_ps(); XB]; WB];
            let mut wv = [_mm512_setzero_ps(); WB];
            let next = w.as_ptr().wrapping_add((o + WB) * k);
            let mut i = 0;
            while i < k {
                crate::lanes::prefetch_lines(next, k, ahead, i);
                let rest = k - i;
                let mask: __mmask16 = if rest >= LANES { 0xFFFF } else { (1 << rest) - 1 };
                for j in 0..WB {
                    wv[j] = _mm512_maskz_loadu_ps(mask, w.as_ptr().add((o + j) * k + i));
                }
                for b in 0..XB {
                    let xv = _mm512_maskz_loadu_ps(mask, x.as_ptr().add((m0 + b) * k + i));
                    for j in 0..WB {
                        acc[j][b] = _mm512_fmadd_ps(wv[j], xv, acc[j][b]);
                    }
                }
                i += LANES;
            }
            crate::lanes::store_sums(acc, y, m0, o, n);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_bf16 {
    use std::arch::x86_64::*;

    /// bfloat16 values per 512-bit vector.
    const LANES: usize = 32;
    /// Register tiles of up to 4 x rows × 4 W rows: 16 accumulators, four weight vectors and
    /// one x vector stay in the 32 vector registers.
    const X_BLOCK: usize = 4;
    const W_BLOCK: usize = 4;

    pub fn available() -> bool {
        crate::lanes::available() && crate::simd::has!("avx512bw") && crate::simd::has!("avx512bf16")
    }

    /// [`super::product`] for bfloat16 W (bit patterns) and x holding bfloat16 values. x is
    /// narrowed back to its bfloat16 bits (exactly) once per call, each row padded with zeros to
    /// whole vectors; W's rows are read in place, the last partial vector through a mask.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    pub unsafe fn product(
        x: &[f32],
        rows: usize,
        k: usize,
        w: &[u16],
        outputs: std::ops::Range<usize>,
        n: usize,
        y: &mut [f32],
    ) {
        let stride = k.next_multiple_of(LANES);
        let mut xb = vec![0u16; rows * stride];
        for m in 0..rows {
            for (to, v) in xb[m * stride..m * stride + k].iter_mut().zip(&x[m * k..(m + 1) * k]) {
                *to = (v.to_bits() >> 16) as u16;
            }
        }
        let tile = |m0, o| Tile { x: &xb, stride, w, k, m0, o, n };
        super::each_tile(rows, outputs, (X_BLOCK, W_BLOCK), tile, y);
    }

    /// Where a register tile works: x's bfloat16 rows (`stride` apart, zero-padded), W's rows
    /// `o..` (k apart), from x row `m0`; y is [rows, n].
    struct Tile<'a> {
        x: &'a [u16],
        stride: usize,
        w: &'a [u16],
        k: usize,
        m0: usize,
        o: usize,
        n: usize,
    }

    impl super::RegisterTile for Tile<'_> {
        /// y[m0 + b, o + j] = Σ_i w[o + j, i] · x[m0 + b, i] for b < XB, j < WB, each output in
        /// its own accumulator. Elements 2l and 2l + 1 of every vector go to lane l, and the
        /// lanes are summed last, so zeros appended to both operands leave a sum as it was.
        #[allow(clippy::needless_range_loop, reason = "register tiles read best by index")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
        unsafe fn run<const XB: usize, const WB: usize>(&self, ahead: usize, y: &mut [f32]) {
            let Tile { x, stride, w, k, m0, o, n } = *self;
            let mut acc = [[_mm512_setzero_ps(); XB]; WB];
            let next = w.as_ptr().wrapping_add((o + WB) * k);
            let mut i = 0;
            while i < k {
                crate::lanes::prefetch_lines(next, k, ahead, i);
                let rest = k - i;
                let wv: [__m512bh; WB] = std::array::from_fn(|j| {
                    let at = w.as_ptr().add((o + j) * k + i);
                    let bits = if rest >= LANES {
                        _mm512_loadu_si512(at as *const _)
                    } else {
                        _mm512_maskz_loadu_epi16((1u32 << rest) - 1, at as *const i16)
                    };
                    std::mem::transmute::<__m512i, __m512bh>(bits)
                });
                for b in 0..XB {
                    let xv = _mm512_loadu_si512(x.as_ptr().add((m0 + b) * stride + i) as *const _);
                    let xv = std::mem::transmute::<__m512i, __m512bh>(xv);
                    for j in 0..WB {
                        acc[j][b] = _mm512_dpbf16_ps(acc[j][b], xv, wv[j]);
                    }
                }
                i += LANES;
            }
            crate::lanes::store_sums(acc, y, m0, o, n);
        }
    }
}
