//! The register tiles of [`crate::tiles_avx512`] as float32 FMAs: for every row count on CPUs
//! with AVX-512 but without `vdpbf16ps` (Skylake-SP, Cascade Lake, Ice Lake, Tiger Lake), and
//! for a prefill's passes on Intel cores that have it, which issue `vdpbf16ps` once every two
//! cycles and 512-bit FMAs twice a cycle: 16 multiply-adds a cycle against 32. (On the Sapphire
//! Rapids the project is measured on, 1.64 G `vdpbf16ps` a second on a core against 6.5 G FMAs.)
//! Other CPUs with the instruction (AMD's Zen 4) keep it: its rate there was not measured, nor
//! whether its sums match these.
//!
//! The sums are `vdpbf16ps`'s bit for bit: it adds an input pair's odd product, then its even
//! one, into the float32 lane, each as an FMA would (a product of two bfloat16 values is exact
//! in float32) with denormals read and written as zero. So these FMAs take the odd input first,
//! under MXCSR's DAZ and FTZ, and a row's result stays the same alone, in a window and in a
//! prefill, whichever of the two a CPU takes for each.

use std::arch::x86_64::*;

use crate::amx_bf16::{Tiles, BLOCK, BLOCKS_AT_ONCE, DEPTH};
use crate::amx_quantized::{
    apply_group, four_row_values, prefetch_ahead, prefetch_quarter, QuantTiles, PREFETCH_BLOCKS, TILED_PREFETCH_BLOCKS,
};

/// Rows of x per register tile: four rows of four blocks of 16 outputs are 16 accumulators,
/// beside a pair row's eight float32 vectors (four tiles, even and odd) and two broadcast
/// inputs. Six rows would leave accumulators on the stack.
pub(super) const ROWS: usize = 4;

/// Input pairs per tile: its rows.
const PAIRS: usize = DEPTH / 2;

/// Whether these loops outrun `vdpbf16ps` for a prefill's passes here: on Intel's cores.
pub(super) fn outrun_dpbf16() -> bool {
    crate::simd::intel()
}

/// Rows of bfloat16 bits as float32, for the broadcasts of a pass.
pub(super) fn widen_inputs(xb: &[u16], x: &mut Vec<f32>) {
    x.clear();
    x.extend(xb.iter().map(|&b| f32::from_bits((b as u32) << 16)));
}

/// Input block `kb` of output group `og`'s bfloat16 tiles times every row of a pass (`x`, rows
/// `stride` apart as float32), added to the rows' running sums `totals` (each output's sum over
/// its inputs in order, so block by block is the same as all at once). The block's four tiles
/// are split into their even and odd inputs' weights in `wide` once, in L1, for all the rows.
///
/// # Safety
/// The CPU has AVX-512 F; MXCSR flushes denormals (`amx_bf16::Flushing`).
#[inline(always)]
pub(super) unsafe fn bf16_block(
    t: &Tiles,
    (og, kb): (usize, usize),
    (x, stride): (&[f32], usize),
    wide: &mut Vec<__m512>,
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let tiles = t.tile(og * BLOCKS_AT_ONCE, kb);
    let block_bytes = BLOCKS_AT_ONCE * BLOCK * DEPTH * 2;
    let ahead = tiles.cast::<u8>().wrapping_add(TILED_PREFETCH_BLOCKS * block_bytes);
    for line in (0..block_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast());
    }
    let odd_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    wide.clear();
    for c in 0..BLOCKS_AT_ONCE {
        for p in 0..PAIRS {
            let w = _mm512_loadu_si512(tiles.add((c * PAIRS + p) * 2 * BLOCK).cast());
            wide.push(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)));
            wide.push(_mm512_castsi512_ps(_mm512_and_si512(w, odd_mask)));
        }
    }
    for r0 in (0..totals.len()).step_by(ROWS) {
        let (x, totals) = (x.as_ptr().add(r0 * stride + kb * DEPTH), &mut totals[r0..]);
        match totals.len().min(ROWS) {
            4 => block_tile::<4>(wide, x, stride, totals),
            3 => block_tile::<3>(wide, x, stride, totals),
            2 => block_tile::<2>(wide, x, stride, totals),
            _ => block_tile::<1>(wide, x, stride, totals),
        }
    }
}

/// `R` rows of x (from `x`, `stride` apart) times one input block's widened tiles, continuing
/// the rows' running sums in `totals`.
#[inline(always)]
unsafe fn block_tile<const R: usize>(
    wide: &[__m512],
    x: *const f32,
    stride: usize,
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
    acc.copy_from_slice(&totals[..R]);
    for p in 0..PAIRS {
        let (even, odd) = pair_row(wide, p);
        pair_into(&mut acc, &even, &odd, x.add(2 * p), stride);
    }
    totals[..R].copy_from_slice(&acc);
}

/// Pair row `p` of an input block's four widened tiles: their even inputs' weights, and their
/// odd ones'.
#[inline(always)]
fn pair_row(wide: &[__m512], p: usize) -> ([__m512; BLOCKS_AT_ONCE], [__m512; BLOCKS_AT_ONCE]) {
    let (mut even, mut odd) = ([wide[0]; BLOCKS_AT_ONCE], [wide[0]; BLOCKS_AT_ONCE]);
    for c in 0..BLOCKS_AT_ONCE {
        even[c] = wide[(c * PAIRS + p) * 2];
        odd[c] = wide[(c * PAIRS + p) * 2 + 1];
    }
    (even, odd)
}

/// One input pair's weights (`even`, `odd`: four tiles' 16 outputs each) times `R` rows' pair
/// at `x` (rows `stride` apart), into the rows' sums: odd product first, as `vdpbf16ps`.
#[inline(always)]
unsafe fn pair_into<const R: usize>(
    acc: &mut [[__m512; BLOCKS_AT_ONCE]; R],
    even: &[__m512; BLOCKS_AT_ONCE],
    odd: &[__m512; BLOCKS_AT_ONCE],
    x: *const f32,
    stride: usize,
) {
    for (r, acc) in acc.iter_mut().enumerate() {
        let at = x.add(r * stride);
        for c in 0..BLOCKS_AT_ONCE {
            acc[c] = odd_then_even(acc[c], (even[c], odd[c]), at);
        }
    }
}

/// `sum` plus the products of one input pair's weights (16 outputs' even and odd inputs) and
/// the pair at `x`: the odd product first, as `vdpbf16ps`.
#[inline(always)]
unsafe fn odd_then_even(sum: __m512, (even, odd): (__m512, __m512), x: *const f32) -> __m512 {
    _mm512_fmadd_ps(even, _mm512_set1_ps(*x), _mm512_fmadd_ps(odd, _mm512_set1_ps(*x.add(1)), sum))
}

/// `R` rows (at most [`ROWS`]) of x (float32, from `x`, `stride` apart) times output group
/// `og`'s bfloat16 tiles, every input block, each tile row split into its even and odd inputs'
/// weights in registers as it is read: each output's sum over all of its inputs, as
/// [`bf16_block`] continues it block by block.
#[inline(always)]
pub(super) unsafe fn bf16_few_rows<const R: usize>(
    t: &Tiles,
    og: usize,
    depth_blocks: usize,
    x: *const f32,
    stride: usize,
) -> [[__m512; BLOCKS_AT_ONCE]; R] {
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
    let odd_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let tile_values = BLOCK * DEPTH;
    for kb in 0..depth_blocks {
        let tiles = t.tile(og * BLOCKS_AT_ONCE, kb);
        for p in 0..PAIRS {
            let (mut even, mut odd) = ([_mm512_setzero_ps(); BLOCKS_AT_ONCE], [_mm512_setzero_ps(); BLOCKS_AT_ONCE]);
            for c in 0..BLOCKS_AT_ONCE {
                let row = tiles.add(c * tile_values + p * 2 * BLOCK);
                // The same row of the same tile PREFETCH_BLOCKS blocks ahead.
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(PREFETCH_BLOCKS * BLOCKS_AT_ONCE * tile_values).cast());
                let w = _mm512_loadu_si512(row.cast());
                even[c] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                odd[c] = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
            }
            pair_into(&mut acc, &even, &odd, x.add(kb * DEPTH + 2 * p), stride);
        }
    }
    acc
}

/// `R` rows (at most [`ROWS`]) of a pass from row `m` (`x`, [rows, k] as float32, with the
/// rows' group sums `sums`) times output group `og`, every quantization group, into their
/// totals: the tiles widened in registers as they are read, and summed as [`register_tile`]
/// sums them.
#[inline(always)]
pub(super) unsafe fn quantized_few_rows<const R: usize, const BITS: usize>(
    t: &QuantTiles,
    og: usize,
    (x, sums): (&[f32], &[f32]),
    m: usize,
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let (groups, per_group) = (t.k / t.group, t.group / DEPTH);
    let x = x.as_ptr().add(m * t.k);
    for g in 0..groups {
        let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
        for kb in g * per_group..(g + 1) * per_group {
            let tiles = t.packed_tile(og * BLOCKS_AT_ONCE, kb);
            for quad in 0..PAIRS / 4 {
                for c in 0..BLOCKS_AT_ONCE {
                    prefetch_quarter::<BITS>(tiles, c, quad, PREFETCH_BLOCKS);
                    let rows = four_row_values::<BITS>(tiles.add(c * t.tile_bytes()), quad);
                    for (s, weights) in rows.into_iter().enumerate() {
                        let at = kb * DEPTH + 2 * (4 * quad + s);
                        for (r, acc) in acc.iter_mut().enumerate() {
                            acc[c] = odd_then_even(acc[c], weights, x.add(r * t.k + at));
                        }
                    }
                }
            }
        }
        let params = super::tiles_avx512::group_params_of(t, og, g);
        for (r, acc) in acc.iter().enumerate() {
            let x_sum = *sums.get_unchecked((m + r) * groups + g);
            for c in 0..BLOCKS_AT_ONCE {
                totals[r][c] = apply_group(totals[r][c], acc[c], params[c], x_sum);
            }
        }
    }
}

/// Quantization group `g` of output group `og`: its tiles widened to float32 into `wide`, then
/// times every row of a pass (`x`, [rows, k] as float32, with the rows' group sums `sums`),
/// added with scale and bias into the rows' `totals`.
///
/// # Safety
/// The CPU has AVX-512 F and BW; MXCSR flushes denormals (`amx_bf16::Flushing`).
#[inline(always)]
pub(super) unsafe fn quantized_group(
    t: &QuantTiles,
    og: usize,
    g: usize,
    (x, sums): (&[f32], &[f32]),
    wide: &mut Vec<__m512>,
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    match t.bits {
        4 => widen_group::<4>(t, og, g, wide),
        _ => widen_group::<8>(t, og, g, wide),
    }
    let params = super::tiles_avx512::group_params_of(t, og, g);
    for r0 in (0..totals.len()).step_by(ROWS) {
        let totals = &mut totals[r0..];
        match totals.len().min(ROWS) {
            4 => register_tile::<4>(wide, t, (g, r0), (x, sums), &params, totals),
            3 => register_tile::<3>(wide, t, (g, r0), (x, sums), &params, totals),
            2 => register_tile::<2>(wide, t, (g, r0), (x, sums), &params, totals),
            _ => register_tile::<1>(wide, t, (g, r0), (x, sums), &params, totals),
        }
    }
}

/// The four tiles of each input block of quantization group `g`, output group `og`, as float32
/// in `wide`: per block, per tile and pair row, its even inputs' weights, then its odd ones'.
#[inline(always)]
unsafe fn widen_group<const BITS: usize>(t: &QuantTiles, og: usize, g: usize, wide: &mut Vec<__m512>) {
    wide.clear();
    let per_group = t.group / DEPTH;
    for kb in g * per_group..(g + 1) * per_group {
        let tiles = t.packed_tile(og * BLOCKS_AT_ONCE, kb);
        prefetch_ahead::<BITS, _MM_HINT_T1>(tiles, TILED_PREFETCH_BLOCKS);
        for c in 0..BLOCKS_AT_ONCE {
            let tile = tiles.add(c * t.tile_bytes());
            for quad in 0..PAIRS / 4 {
                for (even, odd) in four_row_values::<BITS>(tile, quad) {
                    wide.push(even);
                    wide.push(odd);
                }
            }
        }
    }
}

/// Rows `m` to `m + R` of a pass (`x`, [rows, k] as float32, with the rows' group sums `sums`)
/// times quantization group `g`'s widened tiles: the group's sums from zero, then scale and bias
/// added into the rows' totals.
#[inline(always)]
unsafe fn register_tile<const R: usize>(
    wide: &[__m512],
    t: &QuantTiles,
    (g, m): (usize, usize),
    (x, sums): (&[f32], &[f32]),
    params: &[(__m512, __m512); BLOCKS_AT_ONCE],
    totals: &mut [[__m512; BLOCKS_AT_ONCE]],
) {
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; R];
    let groups = t.k / t.group;
    let x = x.as_ptr().add(m * t.k + g * t.group);
    for (b, block) in wide.chunks_exact(BLOCKS_AT_ONCE * PAIRS * 2).enumerate() {
        for p in 0..PAIRS {
            let (even, odd) = pair_row(block, p);
            pair_into(&mut acc, &even, &odd, x.add(b * DEPTH + 2 * p), t.k);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let x_sum = *sums.get_unchecked((m + r) * groups + g);
        for c in 0..BLOCKS_AT_ONCE {
            totals[r][c] = apply_group(totals[r][c], acc[c], params[c], x_sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random bfloat16 bits of every magnitude: exponents over a wide range, and one value in
    /// sixteen a denormal or zero.
    fn bf16_bits(state: &mut u64) -> u16 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        let (sign, mantissa) = ((*state >> 8) as u16 & 0x8000, (*state >> 20) as u16 & 0x7F);
        match *state % 16 {
            0 => sign | mantissa,
            _ => sign | (((*state >> 32) % 60 + 97) as u16) << 7 | mantissa,
        }
    }

    /// [`pair_into`]'s FMAs ([`odd_then_even`], which every loop here takes) give
    /// `vdpbf16ps`'s sums bit for bit over values of every magnitude, denormals among them, on
    /// running sums of every magnitude, on the CPUs where the loops take them for `vdpbf16ps`
    /// (Intel's with AVX-512 BF16).
    #[test]
    fn fmas_sum_an_input_pair_as_vdpbf16ps() {
        if !(outrun_dpbf16() && crate::simd::has!("avx512f") && crate::simd::has!("avx512bf16")) {
            eprintln!("no Intel CPU with AVX-512 BF16: not tested here");
            return;
        }
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn both(w: &[u16; 32], x: [u16; 2], acc: &[f32; 16]) -> ([f32; 16], [f32; 16]) {
            let _flushing = crate::amx_bf16::Flushing::set();
            let wv = _mm512_loadu_si512(w.as_ptr().cast());
            let pair = _mm512_set1_epi32((x[0] as u32 | (x[1] as u32) << 16) as i32);
            let start = _mm512_loadu_ps(acc.as_ptr());
            let as_bf16 = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
            let dp = _mm512_dpbf16_ps(start, as_bf16(wv), as_bf16(pair));
            let even = [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(wv)); BLOCKS_AT_ONCE];
            let odd =
                [_mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32(0xFFFF_0000u32 as i32))); BLOCKS_AT_ONCE];
            let xs = x.map(|b| f32::from_bits((b as u32) << 16));
            let mut sums = [[start; BLOCKS_AT_ONCE]; 1];
            pair_into(&mut sums, &even, &odd, xs.as_ptr(), 2);
            let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(a.as_mut_ptr(), dp);
            _mm512_storeu_ps(b.as_mut_ptr(), sums[0][BLOCKS_AT_ONCE - 1]);
            (a, b)
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for case in 0..20_000 {
            let w: [u16; 32] = std::array::from_fn(|_| bf16_bits(&mut state));
            let x = [bf16_bits(&mut state), bf16_bits(&mut state)];
            let acc: [f32; 16] = std::array::from_fn(|_| {
                let (high, low) = (bf16_bits(&mut state) as u32, bf16_bits(&mut state) as u32);
                f32::from_bits(high << 16 | low)
            });
            // SAFETY: the CPU has AVX-512 F and BF16 (checked above).
            let (dp, fmas) = unsafe { both(&w, x, &acc) };
            assert_eq!(dp.map(f32::to_bits), fmas.map(f32::to_bits), "case {case}: w {w:?}, x {x:?}, sums {acc:?}");
        }
    }
}
