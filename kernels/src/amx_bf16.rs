//! bfloat16 products for weights repacked for the tile unit of Intel's AMX (Sapphire Rapids and
//! later), held as [`Tiles`]. One `tdpbf16ps` multiplies up to 16 rows of x by 32 inputs of 16
//! weight rows in the same time whatever the rows' count, so a verify window of five rows costs
//! little more than a one-token step, where the AVX-512 BF16 loops spend a multiply-add per row
//! on every weight. No crate offers AMX products, and MLX's CPU backend does not use the unit.
//!
//! The tiles: A (tmm4, tmm5 in turn) is 32 inputs of each row of x; B (tmm6, tmm7 in turn) 32
//! inputs of 16 weight rows in the pair layout `tdpbf16ps` reads, which is why the weight is
//! repacked once ([`Tiles::pack`]): each B tile is then 1 KB in a row. C (tmm0–tmm3) holds the
//! float32 sums of four blocks of 16 outputs, so that four chains of dependent products overlap.
//!
//! One row takes AVX-512 FMAs over the same tiles instead (`fma_rows`), summed as the unit
//! sums, bit for bit: a tile load costs the unit more than twice the product it feeds, even
//! from L1, so a one-token step through the unit would be slower than through the AVX-512 BF16
//! loops, and through the FMAs it is not.
//!
//! Each output is summed over its inputs 32 at a time in order, a block's even and odd inputs
//! apart (`fma_rows` says how), and its result for one row and output does not depend on the
//! other rows or outputs of its tiles: a row's result is the same alone or in a window. Inputs
//! are padded with zeros to whole blocks on both sides, so zeros appended to both operands
//! change no sum.
//!
//! Linux hands the tile registers to a process only on request (`arch_prctl`), made once here.
//! `HOST_AMX=off` leaves the tiles to the AVX-512 BF16 loops of `tiles_avx512`, as on a CPU
//! without the unit.

/// Inputs per tile row: 64 bytes of bfloat16.
pub(super) const DEPTH: usize = 32;
/// Outputs per B tile.
pub(super) const BLOCK: usize = 16;
/// Rows of x per pass: a C tile has 16 rows.
#[cfg(target_arch = "x86_64")]
pub(super) const X_ROWS: usize = 16;
/// C tiles in flight.
pub(super) const BLOCKS_AT_ONCE: usize = 4;

/// Outputs per group: the B tiles of one pass, one per C tile.
pub const GROUP: usize = BLOCK * BLOCKS_AT_ONCE;
/// How far ahead of its loads [`fma_block`] asks for the weight's lines: two input blocks of a
/// group. Without the requests a row waits on the weight's lines; asked for much farther ahead
/// (32 KB), they no longer stay in L1 until they are read, and the row is slower still.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 2 * BLOCKS_AT_ONCE * BLOCK * DEPTH * 2;

/// A bfloat16 weight [n, k] laid out for the tile unit: per block of 16 outputs and 32 inputs,
/// 16 rows of input pairs, each holding its pair for the 16 outputs; zeros past n and k. The
/// tiles lie in the order a product reads them (per group of four blocks, per input block, the
/// four blocks' tiles), so that the whole weight is read as one stream, front to back.
pub struct Tiles {
    data: Vec<u16>,
    pub n: usize,
    pub k: usize,
}

impl Tiles {
    /// Repacks w [n, k] (bfloat16 bits, row-major).
    pub fn pack(w: &[u16], n: usize, k: usize) -> Tiles {
        let depth_blocks = k.div_ceil(DEPTH);
        let mut data = vec![0u16; n.div_ceil(GROUP) * depth_blocks * GROUP * DEPTH];
        for (o, row) in w.chunks_exact(k).take(n).enumerate() {
            for (i, &v) in row.iter().enumerate() {
                data[Self::place(o, i, depth_blocks)] = v;
            }
        }
        Tiles { data, n, k }
    }

    /// The weight back as bfloat16 bits [n, k], row-major.
    pub fn unpack(&self) -> Vec<u16> {
        let mut w = Vec::with_capacity(self.n * self.k);
        for o in 0..self.n {
            self.row(o, &mut w);
        }
        w
    }

    /// Appends weight row `o` (bfloat16 bits, k of them) to `to`.
    pub fn row(&self, o: usize, to: &mut Vec<u16>) {
        let depth_blocks = self.k.div_ceil(DEPTH);
        to.extend((0..self.k).map(|i| self.data[Self::place(o, i, depth_blocks)]));
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.data.len() * 2
    }

    /// The tile of output block `ob` and input block `kb`.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn tile(&self, ob: usize, kb: usize) -> *const u16 {
        self.data[Self::at(ob, kb, self.k.div_ceil(DEPTH))..].as_ptr()
    }

    /// Where weight [o, i] lies: in its tile, row `i / 2` of its block of inputs, then column
    /// `o` of its block of outputs, then `i`'s place in its pair.
    fn place(o: usize, i: usize, depth_blocks: usize) -> usize {
        let (kb, pair, half) = (i / DEPTH, i % DEPTH / 2, i % 2);
        Self::at(o / BLOCK, kb, depth_blocks) + (pair * BLOCK + o % BLOCK) * 2 + half
    }

    /// Where the tile of output block `ob` and input block `kb` starts.
    fn at(ob: usize, kb: usize, depth_blocks: usize) -> usize {
        let (group, c) = (ob / BLOCKS_AT_ONCE, ob % BLOCKS_AT_ONCE);
        ((group * depth_blocks + kb) * BLOCKS_AT_ONCE + c) * BLOCK * DEPTH
    }
}

/// Whether plain bfloat16 weights are held as [`Tiles`]: where the unit multiplies them
/// ([`available`]), or the AVX-512 loops of `tiles_avx512` do, on a CPU without the unit.
pub fn held() -> bool {
    #[cfg(target_arch = "x86_64")]
    return available() || super::tiles_avx512::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether weights are repacked for the unit: [`supported`], unless `HOST_AMX=off`.
pub fn available() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("HOST_AMX").map_or(true, |v| v != "off")) && supported()
}

/// Whether the CPU has AMX-TILE, AMX-BF16 and AVX-512 F and BW, and Linux granted this process the
/// tiles.
pub fn supported() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_tiles() && request_tiles())
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_tiles() -> bool {
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    leaf7.edx & (1 << 22) != 0
        && leaf7.edx & (1 << 24) != 0
        && crate::simd::allows("amx-tile")
        && crate::simd::has!("avx512f")
        && crate::simd::has!("avx512bw")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_tiles() -> bool {
    false
}

/// Asks Linux for the tile data state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: the call takes two integers and only changes what this process may use.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tiles() -> bool {
    false
}

/// Rows of bfloat16 bits [rows, k] as [`rows_on_unit`] reads them: in place where k is whole
/// input blocks, else copied with each row zero-padded to them; and the rows' stride.
#[cfg(target_arch = "x86_64")]
pub(super) fn padded(xb: &[u16], k: usize) -> (std::borrow::Cow<'_, [u16]>, usize) {
    let stride = k.next_multiple_of(DEPTH);
    if stride == k {
        return (std::borrow::Cow::Borrowed(xb), k);
    }
    let rows = xb.chunks_exact(k).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, stride - k)));
    (std::borrow::Cow::Owned(rows.collect()), stride)
}

/// Rows of x as bfloat16 bits on the unit, 16 at a time: `xb` holds `rows` rows `stride` values
/// apart, each zero-padded to whole input blocks. Outputs `outputs` go to `sink`.
///
/// # Safety
/// [`supported`] must have returned true; `tiles` is a weight [n, k].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn rows_on_unit(
    xb: &[u16],
    stride: usize,
    rows: usize,
    tiles: &Tiles,
    outputs: std::ops::Range<usize>,
    mut sink: impl RowSink,
) {
    use std::arch::asm;
    let depth_blocks = tiles.k.div_ceil(DEPTH);
    assert!(stride >= depth_blocks * DEPTH && xb.len() >= rows * stride, "rows of {stride} for k {}", tiles.k);
    for m0 in (0..rows).step_by(X_ROWS) {
        let block = X_ROWS.min(rows - m0);
        let config = Config::for_rows(block);
        asm!("ldtilecfg [{}]", in(reg) &config as *const Config, options(nostack, readonly));
        for group in outputs.start / GROUP..outputs.end.div_ceil(GROUP) {
            for c in 0..BLOCKS_AT_ONCE {
                zero(c);
            }
            for kb in 0..depth_blocks {
                let a = xb.as_ptr().add(m0 * stride + kb * DEPTH);
                load_rows(kb % 2, a, 2 * stride);
                let b = tiles.data.as_ptr().add(Tiles::at(group * BLOCKS_AT_ONCE, kb, depth_blocks));
                for c in 0..BLOCKS_AT_ONCE {
                    multiply_add(c, kb % 2, c % 2, b.add(c * BLOCK * DEPTH));
                }
            }
            let mut sums = [0f32; X_ROWS * BLOCK];
            for c in 0..BLOCKS_AT_ONCE {
                store(c, sums.as_mut_ptr());
                let first = (group * BLOCKS_AT_ONCE + c) * BLOCK;
                for m in 0..block {
                    let lanes = std::arch::x86_64::_mm512_loadu_ps(sums.as_ptr().add(m * BLOCK));
                    sink.put(m0 + m, lanes, first, &outputs);
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// Where a product writes its sums: a block of 16 outputs of one row at a time, of which only
/// the columns in `outputs`.
#[cfg(target_arch = "x86_64")]
pub(super) trait RowSink {
    /// # Safety
    /// The CPU has AVX-512 F and BW.
    unsafe fn put(
        &mut self,
        row: usize,
        lanes: std::arch::x86_64::__m512,
        first: usize,
        outputs: &std::ops::Range<usize>,
    );
}

/// Float32 rows y [rows, n]: the unit's sums before rounding, which the tests hold to MLX's.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) struct F32Rows<'a> {
    pub y: &'a mut [f32],
    pub n: usize,
}

#[cfg(all(test, target_arch = "x86_64"))]
impl RowSink for F32Rows<'_> {
    #[inline(always)]
    unsafe fn put(
        &mut self,
        row: usize,
        lanes: std::arch::x86_64::__m512,
        first: usize,
        outputs: &std::ops::Range<usize>,
    ) {
        put_block(&mut self.y[row * self.n..(row + 1) * self.n], lanes, first, outputs);
    }
}

/// bfloat16 rows [rows, n] (their bits), the sums rounded as [`crate::arrays::bf16_bits`] rounds them:
/// so a window's products are rounded by the thread that summed them, and a split product's
/// halves need no joining. Both threads of a split write into the same rows, each its own
/// columns, so this holds a pointer rather than a slice.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct Bf16Rows {
    bits: *mut u16,
    rows: usize,
    n: usize,
}

// SAFETY: the threads sharing one write disjoint columns (their `outputs`), and its owner reads
// the rows only after both are done.
#[cfg(target_arch = "x86_64")]
unsafe impl Send for Bf16Rows {}
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for Bf16Rows {}

#[cfg(target_arch = "x86_64")]
impl Bf16Rows {
    pub(super) fn new(bits: &mut [u16], n: usize) -> Bf16Rows {
        Bf16Rows { bits: bits.as_mut_ptr(), rows: bits.len() / n.max(1), n }
    }
}

#[cfg(target_arch = "x86_64")]
impl RowSink for Bf16Rows {
    #[inline(always)]
    unsafe fn put(
        &mut self,
        row: usize,
        lanes: std::arch::x86_64::__m512,
        first: usize,
        outputs: &std::ops::Range<usize>,
    ) {
        use std::arch::x86_64::*;
        if let Some(mask) = columns_mask(first, outputs) {
            assert!(
                row < self.rows && outputs.end <= self.n,
                "row {row}, outputs to {} of {} × {}",
                outputs.end,
                self.rows,
                self.n
            );
            let bits = _mm512_castsi256_si512(crate::arrays::bf16_bits_avx512(lanes));
            // SAFETY: the unmasked lanes are columns of `outputs` in row `row`, inside the rows.
            _mm512_mask_storeu_epi16(self.bits.add(row * self.n + first).cast(), mask as u32, bits);
        }
    }
}

/// Which of the 16 lanes of the block from `first` are columns of `outputs`; `None` if none.
#[inline(always)]
#[cfg(target_arch = "x86_64")]
fn columns_mask(first: usize, outputs: &std::ops::Range<usize>) -> Option<u16> {
    let (start, end) = (first.max(outputs.start), (first + BLOCK).min(outputs.end));
    let below = |i: usize| ((1u32 << (i - first)) - 1) as u16;
    (start < end).then(|| below(end) & !below(start))
}

/// Writes the sums of the block of 16 outputs from `first` into one row of y, those in
/// `outputs` only, by one masked store (a slice copy of up to 16 floats was a call to
/// `memmove` per block and row).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn put_block(
    y_row: &mut [f32],
    lanes: std::arch::x86_64::__m512,
    first: usize,
    outputs: &std::ops::Range<usize>,
) {
    use std::arch::x86_64::*;
    if let Some(mask) = columns_mask(first, outputs) {
        assert!(
            outputs.end.min(first + BLOCK) <= y_row.len(),
            "outputs to {} past a row of {}",
            outputs.end,
            y_row.len()
        );
        // SAFETY: the unmasked lanes are columns of `outputs`, inside the row.
        _mm512_mask_storeu_ps(y_row.as_mut_ptr().add(first), mask, lanes);
    }
}

/// The 64-byte tile configuration (`ldtilecfg`): palette 1, then each tile's bytes per row and
/// rows.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
pub(super) struct Config([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl Config {
    /// C (0–3) and A (4, 5) with one row per row of x, B (6, 7) with 16 rows of input pairs.
    pub(super) fn for_rows(x_rows: usize) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for tile in 0..8 {
            let rows = if tile < 6 { x_rows } else { DEPTH / 2 };
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&64u16.to_le_bytes());
            c[48 + tile] = rows as u8;
        }
        Config(c)
    }
}

/// Clears C tile `c`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn zero(c: usize) {
    use std::arch::asm;
    match c {
        0 => asm!("tilezero tmm0", options(nostack, nomem)),
        1 => asm!("tilezero tmm1", options(nostack, nomem)),
        2 => asm!("tilezero tmm2", options(nostack, nomem)),
        _ => asm!("tilezero tmm3", options(nostack, nomem)),
    }
}

/// C tile `c` += A (tmm4 or tmm5, by `a`) · the B tile at `b`, loaded into tmm6 or tmm7 (by
/// `slot`). Tiles are not renamed: a load into a tile waits until every product reading it has
/// read it, so consecutive products take turns between two B tiles, and consecutive input
/// blocks between two A tiles.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn multiply_add(c: usize, a: usize, slot: usize, b: *const u16) {
    use std::arch::asm;
    let s = 2 * DEPTH;
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tileloadd ", $b, ", [{b} + {s}*1]"),
                concat!("tdpbf16ps ", $c, ", ", $a, ", ", $b),
                b = in(reg) b, s = in(reg) s, options(nostack, readonly)
            )
        };
    }
    match (c, a, slot) {
        (0, 0, 0) => product!("tmm0", "tmm4", "tmm6"),
        (0, 0, _) => product!("tmm0", "tmm4", "tmm7"),
        (0, _, 0) => product!("tmm0", "tmm5", "tmm6"),
        (0, _, _) => product!("tmm0", "tmm5", "tmm7"),
        (1, 0, 0) => product!("tmm1", "tmm4", "tmm6"),
        (1, 0, _) => product!("tmm1", "tmm4", "tmm7"),
        (1, _, 0) => product!("tmm1", "tmm5", "tmm6"),
        (1, _, _) => product!("tmm1", "tmm5", "tmm7"),
        (2, 0, 0) => product!("tmm2", "tmm4", "tmm6"),
        (2, 0, _) => product!("tmm2", "tmm4", "tmm7"),
        (2, _, 0) => product!("tmm2", "tmm5", "tmm6"),
        (2, _, _) => product!("tmm2", "tmm5", "tmm7"),
        (_, 0, 0) => product!("tmm3", "tmm4", "tmm6"),
        (_, 0, _) => product!("tmm3", "tmm4", "tmm7"),
        (_, _, 0) => product!("tmm3", "tmm5", "tmm6"),
        (_, _, _) => product!("tmm3", "tmm5", "tmm7"),
    }
}

/// Loads 32 inputs of each row of x, 64 bytes per row and `stride` bytes apart, into A tile
/// tmm4 or tmm5 (by `a`).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn load_rows(a: usize, x: *const u16, stride: usize) {
    use std::arch::asm;
    match a {
        0 => asm!("tileloadd tmm4, [{x} + {s}*1]", x = in(reg) x, s = in(reg) stride, options(nostack, readonly)),
        _ => asm!("tileloadd tmm5, [{x} + {s}*1]", x = in(reg) x, s = in(reg) stride, options(nostack, readonly)),
    }
}

/// Writes C tile `c` ([rows of x, 16] float32) to `to`, rows 64 bytes apart.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn store(c: usize, to: *mut f32) {
    use std::arch::asm;
    let s = 4 * BLOCK;
    match c {
        0 => asm!("tilestored [{t} + {s}*1], tmm0", t = in(reg) to, s = in(reg) s, options(nostack)),
        1 => asm!("tilestored [{t} + {s}*1], tmm1", t = in(reg) to, s = in(reg) s, options(nostack)),
        2 => asm!("tilestored [{t} + {s}*1], tmm2", t = in(reg) to, s = in(reg) s, options(nostack)),
        _ => asm!("tilestored [{t} + {s}*1], tmm3", t = in(reg) to, s = in(reg) s, options(nostack)),
    }
}

/// y[m, o] = Σ_i w[o, i] · x[m, i] for outputs `outputs` and every row m of x [rows, k] (y is
/// [rows, n], only its `outputs` columns written), through AVX-512 FMAs over the tiles: one
/// bfloat16 row (more go to the unit, `rows_on_unit`), or rows of other values. Summed as
/// `tdpbf16ps` sums (found bit for
/// bit on this unit, as the SDM's pseudocode has it): per block of 32 inputs, the even and the
/// odd inputs' products each summed in order from zero, then their sum added to the output,
/// every step rounded to nearest with denormals read and written as zero (MXCSR's DAZ and FTZ,
/// set for the call). A bfloat16 product is exact in float32, so each FMA rounds as the unit's
/// step does, and a row's result is the same by either route.
///
/// Rows of float32 values go through the same loops: their products are not exact, but each
/// row's sums still do not depend on the others'.
///
/// # Safety
/// [`held`] must have returned true (the FMAs need AVX-512 F, not the unit); `tiles` is a
/// weight [n, k].
#[cfg(target_arch = "x86_64")]
pub unsafe fn fma_rows(x: &[f32], rows: usize, tiles: &Tiles, outputs: std::ops::Range<usize>, y: &mut [f32]) {
    let _flushing = Flushing::set();
    let (n, k) = (tiles.n, tiles.k);
    let stride = k.div_ceil(DEPTH) * DEPTH;
    // Rows of whole input blocks are read in place; others are copied, zero-padded.
    let mut padded = vec![0f32; if stride == k { 0 } else { rows.min(4) * stride }];
    for m0 in (0..rows).step_by(4) {
        let r = 4.min(rows - m0);
        let rows_here = &x[m0 * k..(m0 + r) * k];
        let x = if stride == k {
            rows_here
        } else {
            for (to, row) in padded.chunks_exact_mut(stride).zip(rows_here.chunks_exact(k)) {
                to[..k].copy_from_slice(row);
            }
            &padded
        };
        let y = &mut y[m0 * n..(m0 + r) * n];
        match r {
            1 => fma_block::<1, 4>(x, tiles, outputs.clone(), y),
            2 => fma_block::<2, 2>(x, tiles, outputs.clone(), y),
            3 => fma_block::<3, 1>(x, tiles, outputs.clone(), y),
            _ => fma_block::<4, 1>(x, tiles, outputs.clone(), y),
        }
    }
}

/// MXCSR's DAZ and FTZ, set while this lives: denormals read and written as zero, as the tile
/// unit reads and writes them, so that FMAs round as its steps do.
#[cfg(target_arch = "x86_64")]
pub(super) struct Flushing(u32);

#[cfg(target_arch = "x86_64")]
impl Flushing {
    pub(super) fn set() -> Flushing {
        use std::arch::asm;
        let mut saved = 0u32;
        // SAFETY: reads and writes MXCSR only; the flags set change how denormals round.
        unsafe {
            asm!("stmxcsr [{}]", in(reg) &mut saved as *mut u32, options(nostack));
            let flushing = saved | 0x8040;
            asm!("ldmxcsr [{}]", in(reg) &flushing as *const u32, options(nostack, readonly));
        }
        Flushing(saved)
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Flushing {
    fn drop(&mut self) {
        // SAFETY: restores the MXCSR saved by `set`.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &self.0 as *const u32, options(nostack, readonly)) };
    }
}

/// R rows of x (zero-padded to whole input blocks) times B output blocks at a time: 2·R·B
/// independent chains of FMAs, eight or more to keep both FMA units busy.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_block<const R: usize, const B: usize>(
    x: &[f32],
    tiles: &Tiles,
    outputs: std::ops::Range<usize>,
    y: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (n, k) = (tiles.n, tiles.k);
    let depth_blocks = k.div_ceil(DEPTH);
    let stride = depth_blocks * DEPTH;
    let odd_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    // From a multiple of B blocks: blocks past n up to a whole group hold zeros (`Tiles::pack`),
    // and B divides a group, so every block read is there.
    for first in (outputs.start / BLOCK / B * B..outputs.end.div_ceil(BLOCK)).step_by(B) {
        debug_assert!(first + B <= n.div_ceil(GROUP) * BLOCKS_AT_ONCE, "blocks from {first} past the tiles");
        let mut acc = [[_mm512_setzero_ps(); B]; R];
        for kb in 0..depth_blocks {
            let mut even = [[_mm512_setzero_ps(); B]; R];
            let mut odd = [[_mm512_setzero_ps(); B]; R];
            for pair in 0..DEPTH / 2 {
                for b in 0..B {
                    let tile = tiles.data.as_ptr().add(Tiles::at(first + b, kb, depth_blocks));
                    let w = _mm512_loadu_si512(tile.add(pair * 2 * BLOCK) as *const _);
                    _mm_prefetch::<_MM_HINT_T0>((tile.add(pair * 2 * BLOCK) as *const i8).wrapping_add(PREFETCH_BYTES));
                    let w_even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
                    let w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
                    for r in 0..R {
                        let at = r * stride + kb * DEPTH + 2 * pair;
                        even[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(*x.get_unchecked(at)), w_even, even[r][b]);
                        odd[r][b] = _mm512_fmadd_ps(_mm512_set1_ps(*x.get_unchecked(at + 1)), w_odd, odd[r][b]);
                    }
                }
            }
            for r in 0..R {
                for b in 0..B {
                    acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_add_ps(even[r][b], odd[r][b]));
                }
            }
        }
        for (r, sums) in acc.iter().enumerate() {
            for (b, block) in sums.iter().enumerate() {
                put_block(&mut y[r * n..(r + 1) * n], *block, (first + b) * BLOCK, &outputs);
            }
        }
    }
}
