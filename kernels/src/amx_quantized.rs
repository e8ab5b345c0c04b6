//! MLX affine-quantized weights (4 and 8 bits, bfloat16 scales and biases, as mlx-lm converts
//! bfloat16 checkpoints) on Intel's AMX tile unit, held as [`QuantTiles`]. A verify window of
//! bfloat16 rows then costs little more than a one-token step, where the AVX-512 loops
//! (`quantized_avx512`) spend a float32 multiply-add per weight and row.
//!
//! The unit multiplies bfloat16 values, and a dequantized weight (scale · q + bias) is not one,
//! but its integer q is (0 to 255 are exact in bfloat16). So each group's sum is split as MLX's
//! Metal kernels split it: Σ x·w = scale · Σ x·q + bias · Σ x. The unit sums x·q over a group's
//! inputs, each product exact in float32; the scale and bias are applied per group after it, in
//! float32, with Σ x summed once per row and call (`group_sums`).
//!
//! The packed integers are reordered once ([`QuantTiles::pack`]) into tiles of 16 outputs and
//! 32 inputs, which lie in the order a product reads them, as [`super::amx_bf16::Tiles`] do,
//! and take the bytes MLX's arrays took. The unit reads bfloat16, so a tile is widened into an
//! L1 buffer just before it is loaded, whatever the rows' count; a tile row is the 16 outputs'
//! input pairs, 32 values, and the layout is chosen for that widening:
//! - 8 bits: a tile row's 32 bytes in order (two per output), widened by conversions through
//!   float32: five vector operations per row.
//! - 4 bits: four tile rows share 64 bytes, as 32 words whose four nibbles are the four rows'
//!   values at the word's place. `vpermw` looks a word's low bits up in a table of the bfloat16
//!   values of 0 to 15, so a row takes one shift and one lookup. MLX's order (two inputs of one
//!   output per byte) took a widening, a shift and a mask more per row, and the lookup ports
//!   bound a window's products.
//!
//! One row takes AVX-512 FMAs over the same bytes instead, summed as the unit sums (see
//! [`super::amx_bf16`]'s `fma_rows`): a row's result is the same alone or in a window, bit for
//! bit. Rows of float32 values take the FMAs too, one at a time: their products are not exact,
//! but no row's result depends on another's.
//!
//! On a CPU without the unit (or with `HOST_AMX=off`) the same tiles serve the `vdpbf16ps`
//! loops of `tiles_avx512` at every bfloat16 row count where the CPU has AVX-512 BF16, widened
//! as here, and the float32 FMAs of `tiles_avx2` at every row count where it has AVX2 alone.

#[cfg(target_arch = "x86_64")]
use super::amx_bf16::{put_block, RowSink, X_ROWS};
use super::amx_bf16::{BLOCK, BLOCKS_AT_ONCE, DEPTH, GROUP};

/// An MLX-quantized weight [n, k] reordered for the tile unit, with its scales and biases.
pub struct QuantTiles {
    /// Per group of [`GROUP`] outputs, per block of 32 inputs, the group's four tiles of 16
    /// outputs; in a tile, per input pair, the 16 outputs' pairs. Zeros past n.
    packed: Vec<u8>,
    /// bfloat16 bits per group of [`GROUP`] outputs, per quantization group, the outputs'
    /// scales (biases) side by side. Zeros past n.
    scales: Vec<u16>,
    biases: Vec<u16>,
    pub n: usize,
    pub k: usize,
    pub bits: u32,
    pub group: usize,
}

impl QuantTiles {
    /// Whether tiles hold weights of this format: 4 or 8 bits, groups of whole input blocks.
    pub fn takes(bits: u32, group: usize) -> bool {
        matches!(bits, 4 | 8) && group.is_multiple_of(DEPTH)
    }

    /// Reorders MLX's packed rows [n, k·bits/32] (32-bit words, low bits first) and their
    /// bfloat16 scales and biases [n, k / group]. [`takes`](Self::takes) must hold and k be a
    /// whole number of groups.
    pub fn pack(packed: &[u32], scales: &[u16], biases: &[u16], n: usize, k: usize, bits: u32, group: usize) -> Self {
        assert!(Self::takes(bits, group) && k.is_multiple_of(group), "{bits} bits, groups of {group}, k {k}");
        let row_bytes = k * bits as usize / 8;
        assert!(packed.len() * 4 == n * row_bytes && scales.len() == n * (k / group) && biases.len() == scales.len());
        // SAFETY: the words' bytes, in memory order (low bits first on x86-64, as MLX packs).
        let bytes = unsafe { std::slice::from_raw_parts(packed.as_ptr().cast::<u8>(), packed.len() * 4) };
        let mut t = QuantTiles {
            // (A line past the last tile: `tiles_avx2` reads a quad's odd words two bytes on,
            // which for the last quad reaches two bytes past it, masked off.)
            packed: vec![0; n.div_ceil(GROUP) * GROUP * row_bytes + 64],
            scales: vec![0; n.div_ceil(GROUP) * GROUP * (k / group)],
            biases: vec![0; n.div_ceil(GROUP) * GROUP * (k / group)],
            n,
            k,
            bits,
            group,
        };
        // Tile by tile, each written front to back: an index computed per value took a quarter
        // of the load of a 4-bit model.
        let tile_bytes = t.tile_bytes();
        let mut to = t.packed.chunks_exact_mut(tile_bytes);
        for og in 0..n.div_ceil(GROUP) {
            for kb in 0..k / DEPTH {
                for ob in og * BLOCKS_AT_ONCE..(og + 1) * BLOCKS_AT_ONCE {
                    let tile = to.next().expect("tiles sized for the weight");
                    // Each output's 32 inputs of this block, as MLX packs them.
                    let block_bytes = DEPTH * bits as usize / 8;
                    let rows = (ob * BLOCK..n.min((ob + 1) * BLOCK))
                        .map(|o| &bytes[o * row_bytes + kb * block_bytes..][..block_bytes]);
                    for (o, from) in rows.enumerate() {
                        match bits {
                            4 => put_nibbles(tile, o, from),
                            _ => {
                                for row in 0..DEPTH / 2 {
                                    tile[row * 2 * BLOCK + 2 * o..][..2].copy_from_slice(&from[2 * row..][..2]);
                                }
                            }
                        }
                    }
                }
            }
        }
        for o in 0..n {
            for g in 0..k / group {
                let at = t.param_at(o, g);
                t.scales[at] = scales[o * (k / group) + g];
                t.biases[at] = biases[o * (k / group) + g];
            }
        }
        t
    }

    /// MLX's packed rows, scales and biases back, as [`pack`](Self::pack) took them.
    pub fn unpack(&self) -> (Vec<u32>, Vec<u16>, Vec<u16>) {
        let groups = self.k / self.group;
        let mut bytes = Vec::with_capacity(self.n * self.k * self.bits as usize / 8);
        let (mut scales, mut biases) = (Vec::with_capacity(self.n * groups), Vec::with_capacity(self.n * groups));
        for o in 0..self.n {
            for i in (0..self.k).step_by(2) {
                let (even, odd) = (self.q(o, i) as u8, self.q(o, i + 1) as u8);
                match self.bits {
                    4 => bytes.push(even | odd << 4),
                    _ => bytes.extend([even, odd]),
                }
            }
            scales.extend((0..groups).map(|g| self.scales[self.param_at(o, g)]));
            biases.extend((0..groups).map(|g| self.biases[self.param_at(o, g)]));
        }
        let words = bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        (words, scales, biases)
    }

    /// The integer q, scale and bias (as float32) of weight [o, i].
    pub fn weight_parts(&self, o: usize, i: usize) -> (u32, f32, f32) {
        let at = self.param_at(o, i / self.group);
        let widen = |bits: u16| f32::from_bits((bits as u32) << 16);
        (self.q(o, i), widen(self.scales[at]), widen(self.biases[at]))
    }

    /// The integer q of weight [o, i].
    fn q(&self, o: usize, i: usize) -> u32 {
        let (row, parity) = (i % DEPTH / 2, i % 2);
        let tile = self.tile_at(o / BLOCK, i / DEPTH);
        let word = 2 * (o % BLOCK) + parity;
        match self.bits {
            4 => {
                let (quad, nibble) = (row / 4, row % 4);
                let byte = self.packed[tile + quad * QUAD + 2 * word + nibble / 2] as u32;
                (byte >> (4 * (nibble % 2))) & 0xF
            }
            _ => self.packed[tile + row * 2 * BLOCK + word] as u32,
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.packed.len() + 2 * (self.scales.len() + self.biases.len())
    }

    /// Bytes of one tile: 16 outputs × 32 inputs.
    pub(super) fn tile_bytes(&self) -> usize {
        BLOCK * DEPTH * self.bits as usize / 8
    }

    /// Where the tile of output block `ob` and input block `kb` starts.
    fn tile_at(&self, ob: usize, kb: usize) -> usize {
        let (group, c) = (ob / BLOCKS_AT_ONCE, ob % BLOCKS_AT_ONCE);
        ((group * (self.k / DEPTH) + kb) * BLOCKS_AT_ONCE + c) * self.tile_bytes()
    }

    /// The packed bytes of the tile of output block `ob` and input block `kb`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn packed_tile(&self, ob: usize, kb: usize) -> *const u8 {
        self.packed[self.tile_at(ob, kb)..].as_ptr()
    }

    /// The scales (biases) from `at` on ([`param_at`](Self::param_at)), as bfloat16 bits.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn scales_at(&self, at: usize) -> *const u16 {
        self.scales[at..].as_ptr()
    }

    /// The biases from `at` on, as [`scales_at`](Self::scales_at).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn biases_at(&self, at: usize) -> *const u16 {
        self.biases[at..].as_ptr()
    }

    /// Where output `o`'s scale (bias) of quantization group `g` lies.
    pub(super) fn param_at(&self, o: usize, g: usize) -> usize {
        ((o / GROUP) * (self.k / self.group) + g) * GROUP + o % GROUP
    }
}

/// Bytes of a 4-bit tile's quad: the 32 words that hold four tile rows.
const QUAD: usize = 64;

/// Writes output `o`'s 32 inputs of a block (`from`: 16 bytes, MLX's order, the even input in
/// the low nibble) into a 4-bit tile: input 2·(4·quad + s) + parity goes to nibble s of word
/// 2·o + parity of the quad.
fn put_nibbles(tile: &mut [u8], o: usize, from: &[u8]) {
    for quad in 0..DEPTH / 8 {
        for parity in 0..2 {
            let word =
                (0..4).fold(0u16, |word, s| word | ((from[4 * quad + s] >> (4 * parity)) as u16 & 0xF) << (4 * s));
            tile[quad * QUAD + 2 * (2 * o + parity)..][..2].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// Whether MLX-quantized weights are held as [`QuantTiles`]: where the unit multiplies them
/// ([`available`]), or, on a CPU without the unit, the AVX-512 loops of `tiles_avx512` or the
/// AVX2 ones of `tiles_avx2` do.
///
/// Where 8-bit activations are asked for (`HOST_QUANTIZED_ACTIVATIONS=int8`) and the unit is
/// not in use, weights keep MLX's layout for the integer loops (`quantized_avx2`).
pub fn held() -> bool {
    #[cfg(target_arch = "x86_64")]
    return available()
        || ((super::tiles_avx512::available() || super::tiles_avx2::available())
            && !super::quantized_avx2::available());
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the unit multiplies [`QuantTiles`]: its [`super::amx_bf16::available`], and
/// AVX-512 BW and BF16 for the widening.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::amx_bf16::available() && crate::simd::has!("avx512bw") && crate::simd::has!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// y[m, o] = Σ_i w[o, i] · x[m, i] for outputs `outputs` and every row m of x [rows, k] (y is
/// [rows, n], only its `outputs` columns written), through AVX-512 FMAs over the tiles' bytes,
/// a row at a time: one bfloat16 row (more go to the unit, `rows_on_unit`), which they sum as
/// the unit does, or rows of other values.
///
/// # Safety
/// The CPU must have AVX-512 F and BW (as where the unit or `tiles_avx512` holds the tiles; not
/// the unit itself).
#[cfg(target_arch = "x86_64")]
pub unsafe fn fma_rows(x: &[f32], rows: usize, t: &QuantTiles, outputs: std::ops::Range<usize>, y: &mut [f32]) {
    let (n, k, groups) = (t.n, t.k, t.k / t.group);
    debug_assert!(x.len() == rows * k && y.len() == rows * n);
    let _flushing = super::amx_bf16::Flushing::set();
    let sums = group_sums(x, t.group);
    for m in 0..rows {
        let (x, sums, y) = (&x[m * k..(m + 1) * k], &sums[m * groups..(m + 1) * groups], &mut y[m * n..(m + 1) * n]);
        match t.bits {
            4 => fma_row::<4>(x, sums, t, outputs.clone(), y),
            _ => fma_row::<8>(x, sums, t, outputs.clone(), y),
        }
    }
}

/// Rows of x as bfloat16 bits (`xb`, [rows, k]) on the unit, 16 at a time, with their
/// [`group_sums`]; outputs `outputs` go to `sink`.
///
/// # Safety
/// [`available`] must have returned true.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(super) unsafe fn rows_on_unit(
    xb: &[u16],
    rows: usize,
    sums: &[f32],
    t: &QuantTiles,
    outputs: std::ops::Range<usize>,
    mut sink: impl RowSink,
) {
    let (k, groups) = (t.k, t.k / t.group);
    assert!(xb.len() == rows * k && sums.len() == rows * groups, "{rows} rows for a weight of k {k}");
    let _flushing = super::amx_bf16::Flushing::set();
    for m0 in (0..rows).step_by(X_ROWS) {
        let block = X_ROWS.min(rows - m0);
        match t.bits {
            4 => tiled::<4>(xb, m0, block, sums, t, outputs.clone(), &mut sink),
            _ => tiled::<8>(xb, m0, block, sums, t, outputs.clone(), &mut sink),
        }
    }
}

/// Σ x over each quantization group of each row of x [rows, k] (k a whole number of groups), as
/// [rows, k / group]: sixteen
/// lanes summed in order, then the lanes by one fixed tree, so that a row's sums are the same
/// whichever route and window it takes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_sums(x: &[f32], group: usize) -> Vec<f32> {
    use std::arch::x86_64::*;
    let mut sums = Vec::with_capacity(x.len() / group);
    for run in x.chunks_exact(group) {
        let mut lanes = _mm512_setzero_ps();
        for sixteen in run.chunks_exact(16) {
            lanes = _mm512_add_ps(lanes, _mm512_loadu_ps(sixteen.as_ptr()));
        }
        sums.push(_mm512_reduce_add_ps(lanes));
    }
    sums
}

/// [`group_sums`] of rows given as bfloat16 bits: the same sums of the same values, denormals
/// read and written as zero as they are inside [`fma_rows`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn group_sums_of_bits(xb: &[u16], group: usize) -> Vec<f32> {
    use std::arch::x86_64::*;
    let _flushing = super::amx_bf16::Flushing::set();
    let mut sums = Vec::with_capacity(xb.len() / group);
    for run in xb.chunks_exact(group) {
        let mut lanes = _mm512_setzero_ps();
        for sixteen in run.chunks_exact(16) {
            let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(sixteen.as_ptr().cast()));
            lanes = _mm512_add_ps(lanes, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)));
        }
        sums.push(_mm512_reduce_add_ps(lanes));
    }
    sums
}

/// Tile rows 4·quad to 4·quad + 3 of the tile at `tile` as the bfloat16 bits the unit reads:
/// per row 32 words, output o's even input in word 2·o, its odd input in word 2·o + 1.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn four_rows<const BITS: usize>(tile: *const u8, quad: usize) -> [std::arch::x86_64::__m512i; 4] {
    use std::arch::x86_64::*;
    if BITS == 4 {
        // vpermw reads a word's low five bits: the row's nibble and one bit above it, which
        // the table, written twice, ignores.
        let words = _mm512_loadu_si512(tile.add(quad * QUAD).cast());
        let table = _mm512_load_si512(NIBBLES.0.as_ptr().cast());
        [
            _mm512_permutexvar_epi16(words, table),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), table),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(words), table),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(words), table),
        ]
    } else {
        // (No closures here: one that calls intrinsics is compiled without the caller's target
        // features, and then calls each intrinsic out of line.)
        let mut rows = [_mm512_setzero_si512(); 4];
        for (s, row) in rows.iter_mut().enumerate() {
            // Bytes 0–15 are outputs 0–7's pairs, 16–31 outputs 8–15's, in order.
            let at = tile.add((4 * quad + s) * 2 * BLOCK);
            let first = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at.cast())));
            let second = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at.add(16).cast())));
            *row = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(second, first));
        }
        rows
    }
}

/// The rows of [`four_rows`] as float32: per row the 16 outputs' even inputs, and their odd
/// ones. 4-bit values take the lookup and a shift or a mask; 8-bit ones a mask or a shift and
/// a conversion, two operations fewer than through bfloat16.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn four_row_values<const BITS: usize>(
    tile: *const u8,
    quad: usize,
) -> [(std::arch::x86_64::__m512, std::arch::x86_64::__m512); 4] {
    use std::arch::x86_64::*;
    let mut values = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 4];
    if BITS == 4 {
        let odd_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for (value, w) in values.iter_mut().zip(four_rows::<4>(tile, quad)) {
            *value =
                (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)), _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask)));
        }
    } else {
        let low = _mm512_set1_epi32(0xFF);
        for (s, value) in values.iter_mut().enumerate() {
            let q = _mm512_cvtepu16_epi32(_mm256_loadu_si256(tile.add((4 * quad + s) * 2 * BLOCK).cast()));
            *value = (_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), _mm512_cvtepi32_ps(_mm512_srli_epi32::<8>(q)));
        }
    }
    values
}

/// One row of x through AVX-512 FMAs over the tiles' bytes, summed as the unit sums: per block
/// of 32 inputs the even and the odd inputs' products each summed in order from zero, their sum
/// added to the group's; then scale · that + bias · Σ x added to the output, group by group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fma_row<const BITS: usize>(
    x: &[f32],
    sums: &[f32],
    t: &QuantTiles,
    outputs: std::ops::Range<usize>,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let per_group = t.group / DEPTH;
    let tile_bytes = t.tile_bytes();
    for og in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
        let mut acc = [_mm512_setzero_ps(); BLOCKS_AT_ONCE];
        for (g, &x_sum) in sums.iter().enumerate() {
            let mut group_sum = [_mm512_setzero_ps(); BLOCKS_AT_ONCE];
            for kb in g * per_group..(g + 1) * per_group {
                let tiles = t.packed.as_ptr().add(t.tile_at(og * BLOCKS_AT_ONCE, kb));
                let (mut even, mut odd) =
                    ([_mm512_setzero_ps(); BLOCKS_AT_ONCE], [_mm512_setzero_ps(); BLOCKS_AT_ONCE]);
                for quad in 0..DEPTH / 8 {
                    for c in 0..BLOCKS_AT_ONCE {
                        prefetch_quarter::<BITS>(tiles, c, quad, PREFETCH_BLOCKS);
                        let rows = four_row_values::<BITS>(tiles.add(c * tile_bytes), quad);
                        for (s, (w_even, w_odd)) in rows.into_iter().enumerate() {
                            let at = kb * DEPTH + 2 * (4 * quad + s);
                            even[c] = _mm512_fmadd_ps(_mm512_set1_ps(*x.get_unchecked(at)), w_even, even[c]);
                            odd[c] = _mm512_fmadd_ps(_mm512_set1_ps(*x.get_unchecked(at + 1)), w_odd, odd[c]);
                        }
                    }
                }
                for c in 0..BLOCKS_AT_ONCE {
                    group_sum[c] = _mm512_add_ps(group_sum[c], _mm512_add_ps(even[c], odd[c]));
                }
            }
            for c in 0..BLOCKS_AT_ONCE {
                acc[c] = apply_group(acc[c], group_sum[c], group_params(t, og * GROUP + c * BLOCK, g), x_sum);
            }
        }
        for (c, block) in acc.iter().enumerate() {
            put_block(y, *block, og * GROUP + c * BLOCK, &outputs);
        }
    }
}

/// How many input blocks (a group of outputs' four tiles) ahead of their reads the loops that
/// read tiles a row or a few at a time (these FMAs, `tiles_avx512`, `tiles_avx2`) ask for the
/// tiles' lines, into L1.
#[cfg(target_arch = "x86_64")]
pub(super) const PREFETCH_BLOCKS: usize = 2;

/// How many input blocks after the next one the unit's route asks for, into L2: weights that
/// come from memory (a model of a billion parameters) arrive in time for a window's products
/// only when asked for this far ahead, not two blocks into L1 as a row's FMAs ask; weights that
/// already sit in L3 lose next to nothing by it.
#[cfg(target_arch = "x86_64")]
pub(super) const TILED_PREFETCH_BLOCKS: usize = 6;

/// Asks for every line of the input block `blocks` after the one at `tiles`, with `HINT`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_ahead<const BITS: usize, const HINT: i32>(tiles: *const u8, blocks: usize) {
    use std::arch::x86_64::*;
    let block = BLOCKS_AT_ONCE * BLOCK * DEPTH * BITS / 8;
    let ahead = tiles.wrapping_add(blocks * block);
    for line in (0..block).step_by(64) {
        _mm_prefetch::<HINT>(ahead.wrapping_add(line).cast());
    }
}

/// Asks for the lines of quarter `quad` of tile `c` in the input block `blocks` after the one
/// at `tiles`, into L1. Called as the same quarter of this block's tile is read, it spreads a
/// block's requests over the loop that reads it: asked for a whole block at once
/// ([`prefetch_ahead`]), the bursts held a memory-bound 8-bit step on `vdpbf16ps` to about 85%
/// of the rate.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn prefetch_quarter<const BITS: usize>(tiles: *const u8, c: usize, quad: usize, blocks: usize) {
    use std::arch::x86_64::*;
    // A compile-time count of lines: a loop of unknown length here keeps the callers' loops over
    // tiles from being unrolled, and then their accumulators, indexed by tile, live in memory.
    let tile_bytes = BLOCK * DEPTH * BITS / 8;
    let quarter = tile_bytes / 4;
    let ahead = tiles.wrapping_add((blocks * BLOCKS_AT_ONCE + c) * tile_bytes + quad * quarter);
    for line in (0..quarter).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
    }
}

/// The scales and biases (float32) of the 16 outputs from `first`, quantization group `g`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn group_params(
    t: &QuantTiles,
    first: usize,
    g: usize,
) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
    use std::arch::x86_64::*;
    let at = t.param_at(first, g);
    // (No closure: see `four_rows`.)
    let scales = _mm512_cvtepu16_epi32(_mm256_loadu_si256(t.scales.as_ptr().add(at).cast()));
    let biases = _mm512_cvtepu16_epi32(_mm256_loadu_si256(t.biases.as_ptr().add(at).cast()));
    (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(scales)), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(biases)))
}

/// acc + scale · group_sum + bias · x_sum, with a group's [`group_params`]: how every route
/// applies them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn apply_group(
    acc: std::arch::x86_64::__m512,
    group_sum: std::arch::x86_64::__m512,
    (scale, bias): (std::arch::x86_64::__m512, std::arch::x86_64::__m512),
    x_sum: f32,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    _mm512_fmadd_ps(bias, _mm512_set1_ps(x_sum), _mm512_fmadd_ps(scale, group_sum, acc))
}

/// Up to 16 bfloat16 rows of x on the unit: per group of 64 outputs and quantization group, the
/// four C tiles sum x·q over the group's input blocks, each B tile widened to bfloat16 in `wide`
/// just before it is loaded; then the C tiles are stored and scale and bias applied as
/// [`fma_row`] applies them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tiled<const BITS: usize>(
    xb: &[u16],
    m0: usize,
    rows: usize,
    sums: &[f32],
    t: &QuantTiles,
    outputs: std::ops::Range<usize>,
    sink: &mut impl RowSink,
) {
    use super::amx_bf16::{load_rows, multiply_add, store, zero, Config};
    use std::arch::asm;
    use std::arch::x86_64::*;
    #[repr(C, align(64))]
    struct Wide([u16; 2 * BLOCKS_AT_ONCE * BLOCK * DEPTH]);
    let (k, per_group, groups) = (t.k, t.group / DEPTH, t.k / t.group);
    let depth_blocks = k / DEPTH;
    // Rows m0 to m0 + rows; k is whole input blocks.
    let xb = &xb[m0 * k..(m0 + rows) * k];
    let sums = &sums[m0 * groups..(m0 + rows) * groups];
    // Two buffers of an input block's four tiles: the next block is widened while the unit
    // reads this one, so that its loads do not wait for the stores just made. Every tile is
    // widened before the unit loads it, so the buffers need no zeroing.
    let mut wide = std::mem::MaybeUninit::<Wide>::uninit();
    let wide = wide.as_mut_ptr().cast::<u16>();
    let buffer = |step: usize, c: usize| ((step % 2) * BLOCKS_AT_ONCE + c) * BLOCK * DEPTH;
    // A C tile's rows, stored before they are read.
    let mut c_tile = std::mem::MaybeUninit::<[f32; X_ROWS * BLOCK]>::uninit();
    let c_tile = c_tile.as_mut_ptr().cast::<f32>();
    let mut acc = [[_mm512_setzero_ps(); BLOCKS_AT_ONCE]; X_ROWS];
    // The groups' input blocks lie one after another, in the order they are read: each step
    // widens the next block, the next group's first after a group's last.
    let groups_of_outputs = outputs.start / GROUP..outputs.end.div_ceil(GROUP);
    if groups_of_outputs.is_empty() {
        return;
    }
    let config = Config::for_rows(rows);
    asm!("ldtilecfg [{}]", in(reg) &config as *const Config, options(nostack, readonly));
    let first = t.packed.as_ptr().add(t.tile_at(groups_of_outputs.start * BLOCKS_AT_ONCE, 0));
    let block = |step: usize| first.add(step * BLOCKS_AT_ONCE * t.tile_bytes());
    let steps = groups_of_outputs.len() * depth_blocks;
    widen_block::<BITS>(block(0), wide.add(buffer(0, 0)));
    for (i, og) in groups_of_outputs.enumerate() {
        for acc in acc.iter_mut().take(rows) {
            *acc = [_mm512_setzero_ps(); BLOCKS_AT_ONCE];
        }
        for g in 0..groups {
            for c in 0..BLOCKS_AT_ONCE {
                zero(c);
            }
            for kb in g * per_group..(g + 1) * per_group {
                let step = i * depth_blocks + kb;
                load_rows(step % 2, xb.as_ptr().add(kb * DEPTH), 2 * k);
                let next = step + 1 < steps;
                if next {
                    prefetch_ahead::<BITS, _MM_HINT_T1>(block(step + 1), TILED_PREFETCH_BLOCKS);
                }
                for c in 0..BLOCKS_AT_ONCE {
                    multiply_add(c, step % 2, c % 2, wide.add(buffer(step, c)));
                    if next {
                        let from = block(step + 1).add(c * t.tile_bytes());
                        widen_tile::<BITS>(from, wide.add(buffer(step + 1, c)));
                    }
                }
            }
            for c in 0..BLOCKS_AT_ONCE {
                store(c, c_tile);
                let params = group_params(t, og * GROUP + c * BLOCK, g);
                for (m, acc) in acc.iter_mut().take(rows).enumerate() {
                    let group_sum = _mm512_loadu_ps(c_tile.add(m * BLOCK));
                    acc[c] = apply_group(acc[c], group_sum, params, *sums.get_unchecked(m * groups + g));
                }
            }
        }
        for (m, acc) in acc.iter().take(rows).enumerate() {
            for (c, block) in acc.iter().enumerate() {
                sink.put(m0 + m, *block, og * GROUP + c * BLOCK, &outputs);
            }
        }
    }
    asm!("tilerelease", options(nostack, nomem));
}

/// The four tiles of an input block (at `from`, one after another) widened into `to`, 1 KB each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen_block<const BITS: usize>(from: *const u8, to: *mut u16) {
    for c in 0..BLOCKS_AT_ONCE {
        widen_tile::<BITS>(from.add(c * BLOCK * DEPTH * BITS / 8), to.add(c * BLOCK * DEPTH));
    }
}

/// A tile's packed integers (at `from`) as the bfloat16 values the unit reads (`to`, 1 KB):
/// each row's 32 integers, output by output, even input first.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn widen_tile<const BITS: usize>(from: *const u8, to: *mut u16) {
    use std::arch::x86_64::*;
    for quad in 0..DEPTH / 8 {
        for (s, row) in four_rows::<BITS>(from, quad).into_iter().enumerate() {
            _mm512_store_si512(to.add((4 * quad + s) * 2 * BLOCK).cast(), row);
        }
    }
}

/// The bfloat16 bits of 0 to 15, twice (a 32-word table for `vpermw`).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Nibbles([u16; 32]);
#[cfg(target_arch = "x86_64")]
static NIBBLES: Nibbles = Nibbles([
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
    0x4160, 0x4170, 0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170,
]);
