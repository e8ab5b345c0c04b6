//! bfloat16 products on the tile unit of Intel's AMX (Sapphire Rapids and later), for bfloat16
//! weights held as [`Tiles`]: one `tdpbf16ps` multiplies up to 16 rows of x by 32 inputs of 16
//! weight rows, in about the time one row of x takes. The AVX-512 BF16 loops spend a
//! multiply-add per row of x on every weight, so a verify window of five rows costs them
//! several one-token steps; here it costs little more than one. No crate offers AMX products,
//! and MLX's CPU backend does not use the unit.
//!
//! The tiles: A (tmm4) is 32 inputs of each row of x; B (tmm5–tmm7, in turn) 32 inputs of 16
//! weight rows in the pair layout `tdpbf16ps` reads, which is why the weight is repacked once
//! ([`Tiles::pack`]): each B tile is then 1 KB in a row. Loaded in place instead, a B tile's 16
//! rows lie far apart and each product waits on its load (a one-row product then ran at half
//! the AVX-512 loops' speed, measured). C (tmm0–tmm3) holds the float32 sums of four blocks of
//! 16 outputs, so that four chains of dependent products overlap.
//!
//! Each output is summed over its inputs 32 at a time in order, each block by the instruction,
//! whose result for one row and output does not depend on the other rows or outputs of its
//! tiles: a row's result is the same alone or in a window. Inputs are padded with zeros to
//! whole blocks on both sides, so zeros appended to both operands change no sum.
//!
//! Linux hands the tile registers to a process only on request (`arch_prctl`), made once here.
//!
//! The route is taken only with `HOST_AMX=on`: the repacked weights sit beside MLX's own
//! arrays, twice the bfloat16 weights' memory, and on a model small enough to stay in the
//! CPU's caches (the demo target) a one-token step is slower than with the AVX-512 BF16 loops,
//! while the unit wins on weights read from memory and on every window (see the README's
//! "AMX tiles").

/// Inputs per tile row: 64 bytes of bfloat16.
const DEPTH: usize = 32;
/// Outputs per B tile.
const BLOCK: usize = 16;
/// Rows of x per pass: a C tile has 16 rows.
const X_ROWS: usize = 16;
/// C tiles in flight.
const BLOCKS_AT_ONCE: usize = 4;
/// Input blocks between a tile's prefetch and its load. On the demo target's head (8192 × 256)
/// one row took 61 µs without and 48–49 µs with (the AVX-512 BF16 loops: 48).
const AHEAD: usize = 2;

/// A bfloat16 weight [n, k] laid out for the tile unit: per block of 16 outputs and 32 inputs,
/// 16 rows of input pairs, each holding its pair for the 16 outputs; zeros past n and k.
pub struct Tiles {
    data: Vec<u16>,
    pub n: usize,
    pub k: usize,
}

impl Tiles {
    /// Repacks w [n, k] (bfloat16 bits, row-major).
    pub fn pack(w: &[u16], n: usize, k: usize) -> Tiles {
        let depth_blocks = k.div_ceil(DEPTH);
        let mut data = vec![0u16; n.div_ceil(BLOCK) * depth_blocks * BLOCK * DEPTH];
        for (o, row) in w.chunks_exact(k).take(n).enumerate() {
            for (i, &v) in row.iter().enumerate() {
                let (kb, pair, half) = (i / DEPTH, i % DEPTH / 2, i % 2);
                data[Self::at(o / BLOCK, kb, depth_blocks) + (pair * BLOCK + o % BLOCK) * 2 + half] = v;
            }
        }
        Tiles { data, n, k }
    }

    /// Where the tile of output block `ob` and input block `kb` starts.
    fn at(ob: usize, kb: usize, depth_blocks: usize) -> usize {
        (ob * depth_blocks + kb) * BLOCK * DEPTH
    }
}

/// Whether products take the tiles: `HOST_AMX=on` and [`supported`].
pub fn available() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("HOST_AMX").is_ok_and(|v| v == "on")) && supported()
}

/// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel granted this process the tiles.
pub fn supported() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_tiles() && request_tiles())
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_tiles() -> bool {
    let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
    leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0
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

/// y[m, o] = Σ_i w[o, i] · x[m, i] for outputs `outputs` and every row m of x [rows, k] (float32
/// holding bfloat16 values); y is [rows, n] and only its `outputs` columns are written.
///
/// # Safety
/// [`supported`] must have returned true; `tiles` is a weight [n, k].
#[cfg(target_arch = "x86_64")]
pub unsafe fn product(x: &[f32], rows: usize, tiles: &Tiles, outputs: std::ops::Range<usize>, y: &mut [f32]) {
    use std::arch::asm;
    let (n, k) = (tiles.n, tiles.k);
    let depth_blocks = k.div_ceil(DEPTH);
    let stride = depth_blocks * DEPTH;
    for m0 in (0..rows).step_by(X_ROWS) {
        let block = X_ROWS.min(rows - m0);
        // x's rows as bfloat16 bits (exact: they hold bfloat16 values), zero-padded.
        let mut xb = vec![0u16; block * stride];
        for (m, row) in x[m0 * k..(m0 + block) * k].chunks_exact(k).enumerate() {
            for (to, v) in xb[m * stride..].iter_mut().zip(row) {
                *to = (v.to_bits() >> 16) as u16;
            }
        }
        let config = Config::for_rows(block);
        asm!("ldtilecfg [{}]", in(reg) &config as *const Config, options(nostack, readonly));
        let mut ob = outputs.start / BLOCK;
        while ob * BLOCK < outputs.end {
            let count = BLOCKS_AT_ONCE.min((outputs.end - ob * BLOCK).div_ceil(BLOCK));
            for c in 0..count {
                zero(c);
            }
            for kb in 0..depth_blocks {
                let a = xb.as_ptr().add(kb * DEPTH);
                asm!("tileloadd tmm4, [{a} + {s}*1]", a = in(reg) a, s = in(reg) 2 * stride, options(nostack, readonly));
                for c in 0..count {
                    multiply_add(c, tiles.data.as_ptr().add(Tiles::at(ob + c, kb, depth_blocks)));
                }
                // The tiles AHEAD input blocks on (past the last, the next blocks' first ones)
                // are asked for while these multiply: a tile load waits on its 16 lines.
                let (pob, pkb) =
                    if kb + AHEAD < depth_blocks { (ob, kb + AHEAD) } else { (ob + count, kb + AHEAD - depth_blocks) };
                if pkb < depth_blocks {
                    for tile in pob..(pob + count).min(n.div_ceil(BLOCK)) {
                        prefetch(tiles.data.as_ptr().add(Tiles::at(tile, pkb, depth_blocks)));
                    }
                }
            }
            let mut sums = [0f32; X_ROWS * BLOCK];
            for c in 0..count {
                store(c, sums.as_mut_ptr());
                let first = (ob + c) * BLOCK;
                let columns = first.max(outputs.start)..(first + BLOCK).min(outputs.end);
                for m in 0..block {
                    for o in columns.clone() {
                        y[(m0 + m) * n + o] = sums[m * BLOCK + o - first];
                    }
                }
            }
            ob += count;
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// The 64-byte tile configuration (`ldtilecfg`): palette 1, then each tile's bytes per row and
/// rows.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct Config([u8; 64]);

#[cfg(target_arch = "x86_64")]
impl Config {
    /// C (0–3) and A (4) with one row per row of x, B (5–7) with 16 rows of input pairs.
    fn for_rows(x_rows: usize) -> Config {
        let mut c = [0u8; 64];
        c[0] = 1;
        for tile in 0..8 {
            let rows = if tile < 5 { x_rows } else { DEPTH / 2 };
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&64u16.to_le_bytes());
            c[48 + tile] = rows as u8;
        }
        Config(c)
    }
}

/// Asks for the 1 KB tile at `tile` to be brought into L1.
#[cfg(target_arch = "x86_64")]
unsafe fn prefetch(tile: *const u16) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for line in 0..BLOCK * DEPTH * 2 / 64 {
        _mm_prefetch::<_MM_HINT_T0>((tile as *const i8).add(64 * line));
    }
}

/// Clears C tile `c`.
#[cfg(target_arch = "x86_64")]
unsafe fn zero(c: usize) {
    use std::arch::asm;
    match c {
        0 => asm!("tilezero tmm0", options(nostack, nomem)),
        1 => asm!("tilezero tmm1", options(nostack, nomem)),
        2 => asm!("tilezero tmm2", options(nostack, nomem)),
        _ => asm!("tilezero tmm3", options(nostack, nomem)),
    }
}

/// C tile `c` += A (tmm4) · the B tile at `b`. Consecutive blocks load B into different tiles,
/// so that a load need not wait for the previous block's product to have read its tile.
#[cfg(target_arch = "x86_64")]
unsafe fn multiply_add(c: usize, b: *const u16) {
    use std::arch::asm;
    let s = 2 * DEPTH;
    match c {
        0 => {
            asm!("tileloadd tmm5, [{b} + {s}*1]", "tdpbf16ps tmm0, tmm4, tmm5", b = in(reg) b, s = in(reg) s, options(nostack, readonly))
        }
        1 => {
            asm!("tileloadd tmm6, [{b} + {s}*1]", "tdpbf16ps tmm1, tmm4, tmm6", b = in(reg) b, s = in(reg) s, options(nostack, readonly))
        }
        2 => {
            asm!("tileloadd tmm7, [{b} + {s}*1]", "tdpbf16ps tmm2, tmm4, tmm7", b = in(reg) b, s = in(reg) s, options(nostack, readonly))
        }
        _ => {
            asm!("tileloadd tmm5, [{b} + {s}*1]", "tdpbf16ps tmm3, tmm4, tmm5", b = in(reg) b, s = in(reg) s, options(nostack, readonly))
        }
    }
}

/// Writes C tile `c` ([rows of x, 16] float32) to `to`, rows 64 bytes apart.
#[cfg(target_arch = "x86_64")]
unsafe fn store(c: usize, to: *mut f32) {
    use std::arch::asm;
    let s = 4 * BLOCK;
    match c {
        0 => asm!("tilestored [{t} + {s}*1], tmm0", t = in(reg) to, s = in(reg) s, options(nostack)),
        1 => asm!("tilestored [{t} + {s}*1], tmm1", t = in(reg) to, s = in(reg) s, options(nostack)),
        2 => asm!("tilestored [{t} + {s}*1], tmm2", t = in(reg) to, s = in(reg) s, options(nostack)),
        _ => asm!("tilestored [{t} + {s}*1], tmm3", t = in(reg) to, s = in(reg) s, options(nostack)),
    }
}
