//! # The CPU kernels
//!
//! Everything in the drafter host that depends on the machine it runs on lives here, and only
//! here: the SIMD and tile-unit (AMX) loops, the detection of the CPU features that pick them,
//! core affinity, and the operating-system calls the host makes ([`os`]: signals, file modes,
//! processes, the loaded libraries, a plugin's object format). Each such place is gated by
//! `cfg` or by a feature check at run time, with a portable path beside it, so the crate builds
//! on any target Rust and MLX support (`make check-platforms` type-checks macOS and Windows).
//!
//! The model toolkit above it (`nn`) is device-agnostic: each op asks this crate first and
//! takes MLX's own op when the answer is `None` (the layout moves in [`layout`] and the packed
//! weights in [`packed`] fall back to MLX's ops themselves). The loops answer where they cover
//! the case, and only on the CPU route ([`route`]): on a GPU, or with `HOST_KERNELS=mlx`,
//! every op is MLX's.
//!
//! Why by hand: on the CPU, MLX dispatches each op to a worker thread (microseconds each, and a
//! small model's decode step meets hundreds), its bfloat16 and quantized products are generic
//! or scalar code, and OpenBLAS packs a whole weight even for a one-row product. Decoding reads
//! every weight once per step, so these loops stream each weight once in its stored format and
//! fuse the elementwise steps between products, rounding each result as MLX rounds it.

// Routing and the host arrays the loops read.
pub mod arrays;
pub mod route;
pub mod simd;
pub mod wide;

// Products and their weight formats.
pub mod amx_bf16;
pub mod amx_quantized;
#[cfg(target_arch = "x86_64")]
mod blocked_avx2;
pub mod dot;
#[cfg(target_arch = "x86_64")]
mod lanes;
#[cfg(target_arch = "x86_64")]
pub mod narrow_avx2;
pub mod packed;
pub mod product;
#[cfg(target_arch = "x86_64")]
pub mod quantized_avx2;
#[cfg(target_arch = "x86_64")]
pub mod quantized_avx512;
#[cfg(target_arch = "x86_64")]
pub mod quantized_bf16_avx512;
#[cfg(target_arch = "x86_64")]
pub mod quantized_f32_avx2;
#[cfg(target_arch = "x86_64")]
mod tiles_avx2;
#[cfg(target_arch = "x86_64")]
mod tiles_avx512;
#[cfg(target_arch = "x86_64")]
mod tiles_fma512;
pub mod weight;
pub mod weighted_sum;
#[cfg(target_arch = "x86_64")]
mod widen_avx2;

// The ops between products.
pub mod activation;
pub mod argmax;
pub mod attention;
pub mod exp;
pub mod layout;
pub mod norm;
pub mod rope;
pub mod softmax;
pub mod tanh;

// Passes over a vocabulary: the host's sampling, a drafter's head over candidate tokens.
pub mod candidates;
pub mod scan;

// Threads, cores and the operating system.
pub mod cpus;
pub mod helper;
pub mod os;

pub use arrays::{bits16, from_bits16, rounded, row_major, with_floats};
pub use packed::Packed;
pub use product::{dequantized_rows, small_product, tiled_product, Quantization, Tiled};
