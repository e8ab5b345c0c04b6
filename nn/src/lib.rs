//! # The model toolkit
//!
//! MLX building blocks shared by the host's target model and the drafters: a weights view over
//! safetensors, (quantized) linear layers and embeddings, RMSNorm, RoPE incl. proportional,
//! attention, the gated MLP, a drafter's per-row context. They follow mlx-lm's numerics, which
//! the oracles check.
//!
//! Nothing here depends on the device: each op asks the [`kernels`] crate first, which answers
//! with its CPU loops where they apply and `None` elsewhere (on a GPU, or with
//! `HOST_KERNELS=mlx`), and then takes MLX's own op. So a drafter computes exactly as the
//! target does, on whatever device MLX runs.

pub mod context;
mod fused;
mod header;
pub mod linear;
pub mod mlp;
pub mod ops;
pub mod rope;
pub mod sync;
pub mod view;
pub mod weights;

pub use context::{row_span, LayerContext, Snapshot};
pub use linear::{Embedding, Linear, Quantization};
pub use mlp::Mlp;
pub use rope::Rope;
pub use view::{Quantized, WeightsView};
pub use weights::{Split, Weights, WeightsError};

/// The kernels, and their modules at the paths drafters have used since the toolkit lived in
/// the plugin contract (`plugin_api::nn::kernels::row_major`, `plugin_api::nn::layout::concat`).
pub use kernels::{self, cpus, helper, layout, tanh, wide};
