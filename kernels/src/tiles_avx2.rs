//! MLX-quantized weights held as [`QuantTiles`] on CPUs with AVX2 and FMA but no AVX-512 (Zen 2
//! and 3, most Intel client parts, or any x86 CPU under `HOST_SIMD=avx2`): every row count of
//! any activation dtype, multiplied by float32 FMAs over tile rows widened to float32.
//!
//! Why tiles here too: over MLX's layout (`quantized_f32_avx2`) a vector's lanes are one weight
//! row's inputs, so every output of every row keeps its own accumulators per group and pays a
//! multiply-add by the group's scale; that bookkeeping held a prefill to about 45 GFLOP/s a core,
//! 0.6× llama.cpp. A tile row holds one input pair of 16 outputs, so here the lanes are outputs:
//! a widened tile row is multiplied into every row of a register tile by one FMA per 8 outputs
//! and input, and a group's scale and bias cost two FMAs per 8 outputs and row. With many rows
//! each group's tiles are widened once into L1 for a pass of rows.
//!
//! Each output of each row is summed the same way whatever the rows' count or the register tile
//! it falls in: per group, from zero, each input pair's even product then its odd one; then
//! total = scale · that + total, then bias · Σ x + total. So a row's result is the same alone,
//! in a verify window and in a batch.
//!
//! A 4-bit weight is widened by a mask and a conversion, without the shift that would bring it
//! down to bit 0: masked in place, q at bit 4·s is q · 2^(4·s) as an integer, exactly. Each pass
//! of x's rows is copied with the matching input scaled by 2^(−4·s) instead
//! ([`place_nibble_inputs`]); a power of two moves no bits (only inputs below 2^−114 lose some,
//! as subnormals, and on every path alike), so each product is x·q. The odd input's nibble is
//! read in place too, from the same words loaded two bytes on. On Intel the variable shift
//! is two operations on the ports that the conversions and FMAs need: without it the 40M bench
//! model's 4-bit decode spends 28% less time in these loops.

use std::arch::x86_64::*;

use crate::amx_bf16::{BLOCK, BLOCKS_AT_ONCE, DEPTH, GROUP};
use crate::amx_quantized::{prefetch_quarter, QuantTiles, PREFETCH_BLOCKS};

/// Rows of x per register tile of one tile's 16 outputs: ten accumulators, four widened
/// vectors and a broadcast input fill the sixteen registers.
const ROWS: usize = 5;
/// Rows of x per pass over a group of outputs: their totals (64 outputs each) stay in L1 while
/// each group's tiles are widened once for all of them.
const PASS_ROWS: usize = 40;
/// Input pairs per tile: its rows.
const PAIRS: usize = DEPTH / 2;

/// Whether products of [`QuantTiles`] take these loops: AVX2, FMA and F16C, no AVX-512 (whose
/// routes take the tiles or MLX's layout) and no tile unit.
pub fn available() -> bool {
    !crate::amx_bf16::available()
        && !crate::lanes::available()
        && crate::simd::has!("avx2")
        && crate::simd::has!("fma")
        && crate::simd::has!("f16c")
}

/// y[m, o] for outputs `outputs` and every row m of x [rows, k] (y is [rows, n], only its
/// `outputs` columns written).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows(x: &[f32], rows: usize, t: &QuantTiles, outputs: std::ops::Range<usize>, y: &mut [f32]) {
    let (n, k, groups) = (t.n, t.k, t.k / t.group);
    assert!(x.len() == rows * k && y.len() == rows * n, "{rows} rows for a weight [{n}, {k}]");
    // Each thread of a split product sums and places x itself: little work, which done once
    // before the split the other thread would wait for.
    let sums = group_sums(x, t.group);
    let mut placed = if t.bits == 4 { vec![0f32; PASS_ROWS.min(rows) * k] } else { Vec::new() };
    let per_group = t.group / DEPTH;
    // A group's widened tiles: per input block and tile, per pair, four vectors (even inputs of
    // outputs 0–7 and 8–15, then odd).
    let mut wide = vec![_mm256_setzero_ps(); per_group * BLOCKS_AT_ONCE * PAIRS * 4];
    let mut totals = vec![[_mm256_setzero_ps(); 2 * BLOCKS_AT_ONCE]; PASS_ROWS];
    for m0 in (0..rows).step_by(PASS_ROWS) {
        let pass = PASS_ROWS.min(rows - m0);
        let (x, sums) = (&x[m0 * k..(m0 + pass) * k], &sums[m0 * groups..]);
        let x = match t.bits {
            4 => place_nibble_inputs(x, &mut placed[..pass * k]),
            _ => x,
        };
        for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
            totals[..pass].fill([_mm256_setzero_ps(); 2 * BLOCKS_AT_ONCE]);
            for g in 0..groups {
                let tile = Tile { t, og, g, x, k, m: 0, sums, groups };
                let totals = &mut totals[..pass];
                // A few rows widen the tiles in registers as they read them, four tiles' (or,
                // for one row of 4-bit weights, two tiles') outputs at once; more read a group's
                // tiles widened once. (LLVM loads a quad's words once for its four rows: with
                // four 4-bit tiles those sixteen vectors go to the stack, and a 40M model's
                // decoding ran 7% slower.)
                match (pass, t.bits) {
                    (1, 4) => register_tile::<1, 2, 4, false>(&tile, &wide, totals),
                    (1, _) => register_tile::<1, 4, 8, false>(&tile, &wide, totals),
                    (2, 4) => register_tile::<2, 2, 4, false>(&tile, &wide, totals),
                    (2, _) => register_tile::<2, 2, 8, false>(&tile, &wide, totals),
                    _ => {
                        match t.bits {
                            4 => widen_group::<4>(t, og, g, &mut wide),
                            _ => widen_group::<8>(t, og, g, &mut wide),
                        }
                        for r0 in (0..pass).step_by(ROWS) {
                            let (tile, totals) = (Tile { m: r0, ..tile }, &mut totals[r0..]);
                            match (pass - r0).min(ROWS) {
                                5 => register_tile::<5, 1, 4, true>(&tile, &wide, totals),
                                4 => register_tile::<4, 1, 4, true>(&tile, &wide, totals),
                                3 => register_tile::<3, 1, 4, true>(&tile, &wide, totals),
                                2 => register_tile::<2, 1, 4, true>(&tile, &wide, totals),
                                _ => register_tile::<1, 1, 4, true>(&tile, &wide, totals),
                            }
                        }
                    }
                }
            }
            for (r, row) in totals[..pass].iter().enumerate() {
                let y = &mut y[(m0 + r) * n..(m0 + r + 1) * n];
                for (v, lanes) in row.iter().enumerate() {
                    put_eight(y, *lanes, og * GROUP + v * 8, &outputs);
                }
            }
        }
    }
}

/// Rows of x for 4-bit tiles, copied into `placed` with each input scaled by the power of two
/// that undoes where [`widen_row`] leaves its weight: 2^(−4·s) for input pair 4·quad + s.
#[inline(always)]
fn place_nibble_inputs<'a>(x: &[f32], placed: &'a mut [f32]) -> &'a [f32] {
    let places: [f32; DEPTH] = std::array::from_fn(|i| f32::from_bits((127 - 4 * ((i as u32 / 2) % 4)) << 23));
    for (to, from) in placed.chunks_exact_mut(DEPTH).zip(x.chunks_exact(DEPTH)) {
        for ((to, from), place) in to.iter_mut().zip(from).zip(places) {
            *to = from * place;
        }
    }
    placed
}

/// Σ x per row and quantization group of x (k a whole number of groups): eight lanes summed in
/// order, then the lanes by one fixed tree.
#[inline(always)]
unsafe fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    let mut sums = Vec::with_capacity(x.len() / group);
    for run in x.chunks_exact(group) {
        let mut lanes = _mm256_setzero_ps();
        for eight in run.chunks_exact(8) {
            lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(eight.as_ptr()));
        }
        let four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps::<1>(lanes));
        let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
        sums.push(_mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two))));
    }
    sums
}

/// What a register tile reads: output group `og`, quantization group `g`, rows of x from `m`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    t: &'a QuantTiles,
    og: usize,
    g: usize,
    x: &'a [f32],
    k: usize,
    m: usize,
    sums: &'a [f32],
    groups: usize,
}

/// `R` rows times `C` tiles' outputs (16 each) of a [`Tile`]'s group: the group's sums from
/// zero, then scale and bias added into the rows' totals. With `BUFFERED` the widened tiles are
/// read from `wide` ([`widen_group`]; then `C` is 1 and the tiles are taken one at a time),
/// otherwise widened here from the packed bytes (`BITS`); either way the same floats.
#[inline(always)]
unsafe fn register_tile<const R: usize, const C: usize, const BITS: usize, const BUFFERED: bool>(
    tile: &Tile,
    wide: &[__m256],
    totals: &mut [[__m256; 2 * BLOCKS_AT_ONCE]],
) {
    let t = tile.t;
    let per_group = t.group / DEPTH;
    for c0 in (0..BLOCKS_AT_ONCE).step_by(C) {
        let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
        for b in 0..per_group {
            let kb = tile.g * per_group + b;
            let tiles = t.packed_tile(tile.og * BLOCKS_AT_ONCE, kb);
            let x = tile.x.as_ptr().add(tile.m * tile.k + kb * DEPTH);
            // Per quad of tile rows, tile by tile, each tile's four rows in turn. LLVM keeps each
            // tile's quad of words for its four rows, so the live values are the accumulators
            // and C tiles' words, which on AVX2's sixteen registers bounds C (see `rows`).
            for quad in 0..PAIRS / 4 {
                for c in 0..C {
                    if !BUFFERED {
                        prefetch_quarter::<BITS>(tiles, c0 + c, quad, PREFETCH_BLOCKS);
                    }
                    for s in 0..4 {
                        let p = 4 * quad + s;
                        let w = if BUFFERED {
                            let at = ((b * BLOCKS_AT_ONCE + c0 + c) * PAIRS + p) * 4;
                            [wide[at], wide[at + 1], wide[at + 2], wide[at + 3]]
                        } else {
                            widen_row::<BITS>(tiles.add((c0 + c) * t.tile_bytes()), quad, s)
                        };
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let even = _mm256_set1_ps(*x.add(r * tile.k + 2 * p));
                            acc[c][0] = _mm256_fmadd_ps(w[0], even, acc[c][0]);
                            acc[c][1] = _mm256_fmadd_ps(w[1], even, acc[c][1]);
                            let odd = _mm256_set1_ps(*x.add(r * tile.k + 2 * p + 1));
                            acc[c][0] = _mm256_fmadd_ps(w[2], odd, acc[c][0]);
                            acc[c][1] = _mm256_fmadd_ps(w[3], odd, acc[c][1]);
                        }
                    }
                }
            }
        }
        for c in 0..C {
            let first = tile.og * GROUP + (c0 + c) * BLOCK;
            let at = t.param_at(first, tile.g);
            let scales = t.scales_at(at);
            let biases = t.biases_at(at);
            for (r, acc) in acc.iter().enumerate() {
                let x_sum = _mm256_set1_ps(*tile.sums.get_unchecked((tile.m + r) * tile.groups + tile.g));
                for h in 0..2 {
                    let (scale, bias) = (widen_params(scales.add(8 * h)), widen_params(biases.add(8 * h)));
                    let total = &mut totals[r][2 * (c0 + c) + h];
                    *total = _mm256_fmadd_ps(bias, x_sum, _mm256_fmadd_ps(scale, acc[c][h], *total));
                }
            }
        }
    }
}

/// Eight bfloat16 bits (scales or biases of eight outputs) as float32.
#[inline(always)]
unsafe fn widen_params(bits: *const u16) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(bits.cast()))))
}

/// Tile row 4·quad + s (an input pair of its block) of the tile at `tile` as float32, each
/// weight where it lies in its lane ([`place_nibble_inputs`]): the even input of outputs 0–7 and
/// 8–15, then the odd input of both.
#[inline(always)]
unsafe fn widen_row<const BITS: usize>(tile: *const u8, quad: usize, s: usize) -> [__m256; 4] {
    if BITS == 4 {
        // Per quad of rows 32 words, word 2·o + parity holding rows 4·quad to 4·quad + 3 in its
        // nibbles: as 32-bit lanes, output o's even nibble sits 4·s bits up; read two bytes on,
        // its odd nibble sits there too (the lane's high word, the next output's, masked off).
        let (words, mask) = (tile.add(quad * 64), _mm256_set1_epi32(0xF << (4 * s)));
        [
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_loadu_si256(words.cast()), mask)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_loadu_si256(words.add(32).cast()), mask)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_loadu_si256(words.add(2).cast()), mask)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_loadu_si256(words.add(34).cast()), mask)),
        ]
    } else {
        // 32 bytes: output o's even input, then its odd one.
        let byte = _mm256_set1_epi32(0xFF);
        let low = _mm256_cvtepu16_epi32(_mm_loadu_si128(tile.add((4 * quad + s) * 32).cast()));
        let high = _mm256_cvtepu16_epi32(_mm_loadu_si128(tile.add((4 * quad + s) * 32 + 16).cast()));
        [
            _mm256_cvtepi32_ps(_mm256_and_si256(low, byte)),
            _mm256_cvtepi32_ps(_mm256_and_si256(high, byte)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(low)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<8>(high)),
        ]
    }
}

/// Quantization group `g`'s tiles of output group `og` widened into `wide`, as
/// [`register_tile`] reads them.
#[inline(always)]
unsafe fn widen_group<const BITS: usize>(t: &QuantTiles, og: usize, g: usize, wide: &mut [__m256]) {
    let per_group = t.group / DEPTH;
    let mut to = wide.iter_mut();
    for kb in g * per_group..(g + 1) * per_group {
        let tiles = t.packed_tile(og * BLOCKS_AT_ONCE, kb);
        for c in 0..BLOCKS_AT_ONCE {
            for quad in 0..PAIRS / 4 {
                for s in 0..4 {
                    for v in widen_row::<BITS>(tiles.add(c * t.tile_bytes()), quad, s) {
                        *to.next().expect("a group's tiles") = v;
                    }
                }
            }
        }
    }
}

/// Writes eight sums for outputs from `first` into a row of y, those in `outputs` only.
#[inline(always)]
unsafe fn put_eight(y: &mut [f32], lanes: __m256, first: usize, outputs: &std::ops::Range<usize>) {
    let mut eight = [0f32; 8];
    _mm256_storeu_ps(eight.as_mut_ptr(), lanes);
    let (start, end) = (first.max(outputs.start), (first + 8).min(outputs.end));
    if start < end {
        y[start..end].copy_from_slice(&eight[start - first..end - first]);
    }
}
