//! Weights held as tiles ([`Tiles`], [`QuantTiles`]) on CPUs with AVX-512 but without the tile
//! unit (Zen 4, Cooper Lake, a Sapphire Rapids with `HOST_AMX=off`; Skylake-SP, Cascade Lake
//! and Ice Lake, which lack AVX-512 BF16): every bfloat16 row count, one row or a prefill,
//! multiplied by `vdpbf16ps` over the tile rows, quantized ones widened to bfloat16 first. On
//! Intel's cores a prefill's passes take the same sums by float32 FMAs instead
//! ([`crate::tiles_fma512`]), which issue there at twice `vdpbf16ps`'s rate; CPUs without the
//! instruction take those FMAs for every row count.
//!
//! Why these loops: the AVX-512 BF16 loops over MLX's own layout (`dot`,
//! `quantized_bf16_avx512`) put a weight row's inputs across the vector's lanes, so each output
//! of each row ends in a sum of lanes, and a quantized group's scale and bias are applied per
//! output and row. A prefill is then bound by that bookkeeping at about half of what
//! `vdpbf16ps` could do. A tile row holds the input pair of 16 outputs instead, the pair layout
//! `vdpbf16ps` reads: one instruction adds an input pair's products to 16 outputs of one row,
//! with x's pair broadcast, and nothing is left to reduce. A (widened) tile row serves every row
//! of a register tile, and a group's scale and bias are applied once per 16 outputs, row and
//! group.
//!
//! Each output of each row is summed the same way whatever the rows' count: the input pairs in
//! order into one float32 lane from zero (`vdpbf16ps` adds a pair's odd product, then its even
//! one, rounding after each and reading and writing denormals as zero), over all inputs for
//! bfloat16 weights; for quantized ones per group, then scale and bias applied as every tiled
//! route applies them. So a row's result is
//! the same alone, in a verify window and in a batch. It is not the tile unit's (which sums a
//! block's even and odd inputs apart), and this route never runs beside the unit: it serves
//! only where the unit does not.

use std::arch::x86_64::*;

use crate::amx_bf16::{RowSink, Tiles, BLOCK, BLOCKS_AT_ONCE, DEPTH, GROUP};
use crate::amx_quantized::{
    apply_group, four_rows, group_params, prefetch_ahead, prefetch_quarter, QuantTiles, PREFETCH_BLOCKS,
    TILED_PREFETCH_BLOCKS,
};
use crate::tiles_fma512;

/// Rows of x per register tile: six rows of four blocks of 16 outputs are 24 accumulators,
/// beside four widened tile rows and a broadcast input pair.
const ROWS: usize = 6;
/// Rows of x per pass over the outputs: their inputs stay in L2 while each group of outputs'
/// tiles passes over them; for quantized weights their totals (float32, 64 outputs each) stay
/// in L1 while each group's tiles are widened once for all of them.
const PASS_ROWS: usize = 48;

type Range = std::ops::Range<usize>;

/// Whether products of [`Tiles`] and [`QuantTiles`] take these loops: the CPU has AVX-512 F,
/// BW, VL and DQ (BF16 or not), and the tile unit is not in use.
pub fn available() -> bool {
    !crate::amx_bf16::available() && crate::lanes::available() && crate::simd::has!("avx512bw")
}

/// Rows of x as bfloat16 bits times a bfloat16 weight's tiles: `xb` holds `rows` rows `stride`
/// values apart, each zero-padded to whole input blocks. Outputs `outputs` go to `sink`.
///
/// # Safety
/// [`available`] must have returned true (or the CPU have what it checks).
pub(super) unsafe fn bf16_rows(
    xb: &[u16],
    stride: usize,
    rows: usize,
    t: &Tiles,
    outputs: std::ops::Range<usize>,
    sink: impl RowSink,
) {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    unsafe fn with_dpbf16(xb: &[u16], stride: usize, rows: usize, t: &Tiles, o: Range, sink: impl RowSink) {
        bf16_rows_by::<true>(xb, stride, rows, t, o, sink)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn on_fmas(xb: &[u16], stride: usize, rows: usize, t: &Tiles, o: Range, sink: impl RowSink) {
        bf16_rows_by::<false>(xb, stride, rows, t, o, sink)
    }
    match dpbf16() {
        true => with_dpbf16(xb, stride, rows, t, outputs, sink),
        false => on_fmas(xb, stride, rows, t, outputs, sink),
    }
}

/// Whether the CPU has `vdpbf16ps` (AVX-512 BF16); without it every row count takes the FMAs
/// of [`tiles_fma512`], which sum as it does.
fn dpbf16() -> bool {
    crate::simd::has!("avx512bf16")
}

/// Whether a pass of `pass` rows takes the FMAs of [`tiles_fma512`]: every pass without
/// `vdpbf16ps` (`DP`), a prefill's on Intel, where they outrun it.
fn pass_on_fmas<const DP: bool>(pass: usize) -> bool {
    !DP || (pass > ROWS && tiles_fma512::outrun_dpbf16())
}

/// [`bf16_rows`], with `vdpbf16ps` (`DP`) or on FMAs alone.
#[inline(always)]
unsafe fn bf16_rows_by<const DP: bool>(
    xb: &[u16],
    stride: usize,
    rows: usize,
    t: &Tiles,
    outputs: Range,
    mut sink: impl RowSink,
) {
    let depth_blocks = t.k.div_ceil(DEPTH);
    assert!(stride >= depth_blocks * DEPTH && xb.len() >= rows * stride, "rows of {stride} for k {}", t.k);
    let _flushing = pass_on_fmas::<DP>(rows).then(crate::amx_bf16::Flushing::set);
    let (mut x, mut wide) = (Vec::new(), Vec::new());
    let mut totals = vec![[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; PASS_ROWS];
    // Passes of rows whose x stays in L2 while each group of outputs' tiles passes over them.
    for m0 in (0..rows).step_by(PASS_ROWS) {
        let pass = PASS_ROWS.min(rows - m0);
        if pass_on_fmas::<DP>(pass) {
            tiles_fma512::widen_inputs(&xb[m0 * stride..(m0 + pass) * stride], &mut x);
            for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
                if pass > ROWS {
                    totals[..pass].fill([_mm512_setzero_ps(); BLOCKS_AT_ONCE]);
                    for kb in 0..depth_blocks {
                        tiles_fma512::bf16_block(t, (og, kb), (&x, stride), &mut wide, &mut totals[..pass]);
                    }
                    put_totals(&totals[..pass], m0, og, &outputs, &mut sink);
                    continue;
                }
                for r0 in (0..pass).step_by(tiles_fma512::ROWS) {
                    let (x, at, sink) = (x.as_ptr().add(r0 * stride), m0 + r0, &mut sink);
                    use tiles_fma512::bf16_few_rows as few;
                    match (pass - r0).min(tiles_fma512::ROWS) {
                        4 => put_totals(&few::<4>(t, og, depth_blocks, x, stride), at, og, &outputs, sink),
                        3 => put_totals(&few::<3>(t, og, depth_blocks, x, stride), at, og, &outputs, sink),
                        2 => put_totals(&few::<2>(t, og, depth_blocks, x, stride), at, og, &outputs, sink),
                        _ => put_totals(&few::<1>(t, og, depth_blocks, x, stride), at, og, &outputs, sink),
                    }
                }
            }
            continue;
        }
        assert!(DP, "every pass takes the FMAs without vdpbf16ps");
        for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
            for r0 in (m0..m0 + pass).step_by(ROWS) {
                let x = xb.as_ptr().add(r0 * stride);
                let sums = match (m0 + pass - r0).min(ROWS) {
                    6 => bf16_tile::<6>(t, og, depth_blocks, x, stride),
                    5 => bf16_tile::<5>(t, og, depth_blocks, x, stride),
                    4 => bf16_tile::<4>(t, og, depth_blocks, x, stride),
                    3 => bf16_tile::<3>(t, og, depth_blocks, x, stride),
                    2 => bf16_tile::<2>(t, og, depth_blocks, x, stride),
                    _ => bf16_tile::<1>(t, og, depth_blocks, x, stride),
                };
                put_totals(&sums[..(m0 + pass - r0).min(ROWS)], r0, og, &outputs, &mut sink);
            }
        }
    }
}

/// `R` rows (from `x`, `stride` apart) times output group `og`'s tiles, every input block:
/// each output's sum over all of its inputs, the slots past `R` zero.
#[inline(always)]
unsafe fn bf16_tile<const R: usize>(
    t: &Tiles,
    og: usize,
    depth_blocks: usize,
    x: *const u16,
    stride: usize,
) -> [[__m512; BLOCKS_AT_ONCE]; ROWS] {
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; ROWS];
    let tile_values = BLOCK * DEPTH;
    for kb in 0..depth_blocks {
        let tiles = t.tile(og * BLOCKS_AT_ONCE, kb);
        for p in 0..DEPTH / 2 {
            let mut w = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); BLOCKS_AT_ONCE];
            for (c, w) in w.iter_mut().enumerate() {
                let row = tiles.add(c * tile_values + p * 2 * BLOCK);
                // The same row of the same tile PREFETCH_BLOCKS blocks ahead.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(PREFETCH_BLOCKS * BLOCKS_AT_ONCE * tile_values).cast());
                *w = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row.cast()));
            }
            for (r, acc) in acc.iter_mut().take(R).enumerate() {
                let pair = x.add(r * stride + kb * DEPTH + 2 * p).cast::<i32>().read_unaligned();
                let pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                for c in 0..BLOCKS_AT_ONCE {
                    acc[c] = _mm512_dpbf16_ps(acc[c], w[c], pair);
                }
            }
        }
    }
    acc
}

/// Rows of x as bfloat16 bits (`xb`, [rows, k]) with their group sums
/// (`amx_quantized::group_sums_of_bits`); outputs `outputs` go to `sink`.
///
/// # Safety
/// [`available`] must have returned true (or the CPU have what it checks).
pub(super) unsafe fn rows(xb: &[u16], rows: usize, sums: &[f32], t: &QuantTiles, outputs: Range, sink: impl RowSink) {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]
    unsafe fn with_dpbf16(xb: &[u16], rows: usize, sums: &[f32], t: &QuantTiles, o: Range, sink: impl RowSink) {
        rows_by::<true>(xb, rows, sums, t, o, sink)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn on_fmas(xb: &[u16], rows: usize, sums: &[f32], t: &QuantTiles, o: Range, sink: impl RowSink) {
        rows_by::<false>(xb, rows, sums, t, o, sink)
    }
    match dpbf16() {
        true => with_dpbf16(xb, rows, sums, t, outputs, sink),
        false => on_fmas(xb, rows, sums, t, outputs, sink),
    }
}

/// [`rows`], with `vdpbf16ps` (`DP`) or on FMAs alone.
#[inline(always)]
unsafe fn rows_by<const DP: bool>(
    xb: &[u16],
    rows: usize,
    sums: &[f32],
    t: &QuantTiles,
    outputs: Range,
    mut sink: impl RowSink,
) {
    let (k, groups) = (t.k, t.k / t.group);
    assert!(xb.len() == rows * k && sums.len() == rows * groups, "{rows} rows for a weight of k {k}");
    let _flushing = crate::amx_bf16::Flushing::set();
    // A group's widened tiles: per input block, the four blocks' tiles of 16 pair rows.
    let mut wide = vec![_mm512_setzero_si512(); t.group / DEPTH * BLOCKS_AT_ONCE * DEPTH / 2];
    let mut totals = vec![[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; PASS_ROWS];
    let (mut x, mut wide_values) = (Vec::new(), Vec::new());
    for m0 in (0..rows).step_by(PASS_ROWS) {
        let pass = PASS_ROWS.min(rows - m0);
        if pass_on_fmas::<DP>(pass) {
            tiles_fma512::widen_inputs(&xb[m0 * k..(m0 + pass) * k], &mut x);
            let pass_rows = (&x[..], &sums[m0 * groups..]);
            for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
                totals[..pass].fill([_mm512_setzero_ps(); BLOCKS_AT_ONCE]);
                if pass > ROWS {
                    for g in 0..groups {
                        tiles_fma512::quantized_group(t, og, g, pass_rows, &mut wide_values, &mut totals[..pass]);
                    }
                } else {
                    for r0 in (0..pass).step_by(tiles_fma512::ROWS) {
                        let totals = &mut totals[r0..pass];
                        use tiles_fma512::quantized_few_rows as few;
                        match (totals.len().min(tiles_fma512::ROWS), t.bits) {
                            (4, 4) => few::<4, 4>(t, og, pass_rows, r0, totals),
                            (3, 4) => few::<3, 4>(t, og, pass_rows, r0, totals),
                            (2, 4) => few::<2, 4>(t, og, pass_rows, r0, totals),
                            (_, 4) => few::<1, 4>(t, og, pass_rows, r0, totals),
                            (4, _) => few::<4, 8>(t, og, pass_rows, r0, totals),
                            (3, _) => few::<3, 8>(t, og, pass_rows, r0, totals),
                            (2, _) => few::<2, 8>(t, og, pass_rows, r0, totals),
                            (_, _) => few::<1, 8>(t, og, pass_rows, r0, totals),
                        }
                    }
                }
                put_totals(&totals[..pass], m0, og, &outputs, &mut sink);
            }
            continue;
        }
        assert!(DP, "every pass takes the FMAs without vdpbf16ps");
        for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
            totals[..pass].fill([_mm512_setzero_ps(); BLOCKS_AT_ONCE]);
            if pass <= ROWS {
                // One register tile of rows (a decode step, a verify window): the tiles widened
                // in registers as they are read.
                let tile = Tile { m: m0, g: 0, groups, group: t.group, k, xb, sums };
                let totals = &mut totals[..pass];
                match (pass, t.bits) {
                    (6, 4) => few_rows::<6, 4>(t, og, &tile, totals),
                    (5, 4) => few_rows::<5, 4>(t, og, &tile, totals),
                    (4, 4) => few_rows::<4, 4>(t, og, &tile, totals),
                    (3, 4) => few_rows::<3, 4>(t, og, &tile, totals),
                    (2, 4) => few_rows::<2, 4>(t, og, &tile, totals),
                    (_, 4) => few_rows::<1, 4>(t, og, &tile, totals),
                    (6, _) => few_rows::<6, 8>(t, og, &tile, totals),
                    (5, _) => few_rows::<5, 8>(t, og, &tile, totals),
                    (4, _) => few_rows::<4, 8>(t, og, &tile, totals),
                    (3, _) => few_rows::<3, 8>(t, og, &tile, totals),
                    (2, _) => few_rows::<2, 8>(t, og, &tile, totals),
                    (_, _) => few_rows::<1, 8>(t, og, &tile, totals),
                }
                put_totals(&totals[..pass], m0, og, &outputs, &mut sink);
                continue;
            }
            for g in 0..groups {
                match t.bits {
                    4 => widen_group::<4>(t, og, g, &mut wide),
                    _ => widen_group::<8>(t, og, g, &mut wide),
                }
                let params = group_params_of(t, og, g);
                for r0 in (0..pass).step_by(ROWS) {
                    let tile = Tile { m: m0 + r0, g, groups, group: t.group, k, xb, sums };
                    let totals = &mut totals[r0..];
                    match (pass - r0).min(ROWS) {
                        6 => register_tile::<6>(&wide, &tile, &params, totals),
                        5 => register_tile::<5>(&wide, &tile, &params, totals),
                        4 => register_tile::<4>(&wide, &tile, &params, totals),
                        3 => register_tile::<3>(&wide, &tile, &params, totals),
                        2 => register_tile::<2>(&wide, &tile, &params, totals),
                        _ => register_tile::<1>(&wide, &tile, &params, totals),
                    }
                }
            }
            put_totals(&totals[..pass], m0, og, &outputs, &mut sink);
        }
    }
}

/// Rows from `m0` of output group `og`'s totals into `sink`.
#[inline(always)]
unsafe fn put_totals(
    totals: &[[__m512; BLOCKS_AT_ONCE]],
    m0: usize,
    og: usize,
    outputs: &std::ops::Range<usize>,
    sink: &mut impl RowSink,
) {
    for (r, row) in totals.iter().enumerate() {
        for (c, block) in row.iter().enumerate() {
            sink.put(m0 + r, *block, og * GROUP + c * BLOCK, outputs);
        }
    }
}

/// `R` rows (at most [`ROWS`]) times output group `og`, every quantization group, into their
/// zeroed totals: the tiles widened in registers as they are read, and summed as
/// [`register_tile`] sums them.
#[inline(always)]
unsafe fn few_rows<const R: usize, const BITS: usize>(
    t: &QuantTiles,
    og: usize,
    tile: &Tile,
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let per_group = t.group / DEPTH;
    for g in 0..tile.groups {
        let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
        for kb in g * per_group..(g + 1) * per_group {
            let tiles = t.packed_tile(og * BLOCKS_AT_ONCE, kb);
            let x = tile.xb.as_ptr().add(tile.m * tile.k + kb * DEPTH);
            for quad in 0..DEPTH / 8 {
                for c in 0..BLOCKS_AT_ONCE {
                    prefetch_quarter::<BITS>(tiles, c, quad, PREFETCH_BLOCKS);
                    let rows = four_rows::<BITS>(tiles.add(c * t.tile_bytes()), quad);
                    for (s, w) in rows.into_iter().enumerate() {
                        let w = std::mem::transmute::<__m512i, __m512bh>(w);
                        for (r, acc) in acc.iter_mut().enumerate() {
                            let pair = x.add(r * tile.k + 2 * (4 * quad + s)).cast::<i32>().read_unaligned();
                            let pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                            acc[c] = _mm512_dpbf16_ps(acc[c], w, pair);
                        }
                    }
                }
            }
        }
        let params = group_params_of(t, og, g);
        for (r, acc) in acc.iter().enumerate() {
            let x_sum = *tile.sums.get_unchecked((tile.m + r) * tile.groups + g);
            for c in 0..BLOCKS_AT_ONCE {
                totals[r][c] = apply_group(totals[r][c], acc[c], params[c], x_sum);
            }
        }
    }
}

/// The scales and biases of output group `og`'s four blocks, quantization group `g`.
#[inline(always)]
pub(super) unsafe fn group_params_of(t: &QuantTiles, og: usize, g: usize) -> [(__m512, __m512); BLOCKS_AT_ONCE] {
    // (A loop, not `array::from_fn`: a closure that calls intrinsics is compiled without the
    // caller's target features, and calls each intrinsic out of line.)
    let mut params = [(_mm512_setzero_ps(), _mm512_setzero_ps()); BLOCKS_AT_ONCE];
    for (c, p) in params.iter_mut().enumerate() {
        *p = group_params(t, og * GROUP + c * BLOCK, g);
    }
    params
}

/// Where a register tile's rows start: rows from `m`, quantization groups from `g`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    m: usize,
    g: usize,
    groups: usize,
    /// Inputs per quantization group.
    group: usize,
    k: usize,
    xb: &'a [u16],
    sums: &'a [f32],
}

/// The four tiles of each input block of quantization group `g`, output group `og`, widened
/// into `wide` (per block, per tile, its 16 pair rows), the blocks ahead asked for into L2 as the
/// unit's route asks for them.
#[inline(always)]
unsafe fn widen_group<const BITS: usize>(t: &QuantTiles, og: usize, g: usize, wide: &mut [__m512i]) {
    let per_group = t.group / DEPTH;
    let mut to = wide.iter_mut();
    for kb in g * per_group..(g + 1) * per_group {
        let tiles = t.packed_tile(og * BLOCKS_AT_ONCE, kb);
        prefetch_ahead::<BITS, _MM_HINT_T1>(tiles, TILED_PREFETCH_BLOCKS);
        for c in 0..BLOCKS_AT_ONCE {
            let tile = tiles.add(c * t.tile_bytes());
            for quad in 0..DEPTH / 8 {
                for row in four_rows::<BITS>(tile, quad) {
                    *to.next().expect("a group's tiles") = row;
                }
            }
        }
    }
}

/// `R` rows of a [`Tile`] times its group's widened tiles: the group's sums from zero, then
/// scale and bias added into the rows' totals.
#[inline(always)]
unsafe fn register_tile<const R: usize>(
    wide: &[__m512i],
    tile: &Tile,
    params: &[(__m512, __m512); BLOCKS_AT_ONCE],
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
    let pairs_per_block = DEPTH / 2;
    let x = tile.xb.as_ptr().add(tile.m * tile.k + tile.g * tile.group);
    for (b, block) in wide.chunks_exact(BLOCKS_AT_ONCE * pairs_per_block).enumerate() {
        for p in 0..pairs_per_block {
            let mut w = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); BLOCKS_AT_ONCE];
            for (c, w) in w.iter_mut().enumerate() {
                *w = std::mem::transmute::<__m512i, __m512bh>(block[c * pairs_per_block + p]);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = x.add(r * tile.k + b * DEPTH + 2 * p).cast::<i32>().read_unaligned();
                let pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair));
                for c in 0..BLOCKS_AT_ONCE {
                    acc[c] = _mm512_dpbf16_ps(acc[c], w[c], pair);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let x_sum = *tile.sums.get_unchecked((tile.m + r) * tile.groups + tile.g);
        for c in 0..BLOCKS_AT_ONCE {
            totals[r][c] = apply_group(totals[r][c], acc[c], params[c], x_sum);
        }
    }
}
