//! # The drafter plugin contract
//!
//! A drafter is a shared library that the host loads at run time. Host and plugins are built
//! separately, possibly by different people with different compilers, so everything that
//! crosses between them is ABI-stable (`abi_stable`) and said here once.
//!
//! **One MLX runtime.** Host and plugins link the same `libmlx.so`; each keeps its own static
//! copy of mlx-c and mlx-rs. An MLX array is therefore meaningful on both sides, and crosses as
//! a raw mlx-c handle wrapped in a type that says who owns it:
//! [`ArrayRef`] is borrowed for the duration of one call (the callee reads it and never frees
//! it); [`OwnedArray`] is handed over (the receiver frees it, by turning it into an
//! [`mlx_rs::Array`] or by dropping it).
//!
//! **State that does not cross.** Each copy of mlx-rs has its own default stream scope and its
//! own default random key, so streams, seeds and keys are passed explicitly. MLX's function
//! compilation must stay off in every artifact of the process: mlx-rs numbers compiled
//! functions per copy while the compile cache is shared, so a plugin's compiled function could
//! return the host's. The host disables compilation once at start-up, for everyone.
//!
//! Items marked **ABI-frozen** never change layout; new capabilities arrive as new items.

pub mod tensor;

pub use tensor::{ArrayRef, OwnedArray, RawArray};
