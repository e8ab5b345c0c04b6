//! MLX building blocks shared by the host's target model and the drafters: a weights view over
//! safetensors, (quantized) linear layers and embeddings, RMSNorm, RoPE incl. proportional,
//! attention, the gated MLP. They follow mlx-lm's numerics, which the oracles check.

pub mod context;
pub mod cpus;
mod header;
pub mod helper;
pub mod kernels;
pub mod layout;
pub mod linear;
pub mod mlp;
pub mod ops;
pub mod rope;
pub mod tanh;
pub mod view;
pub mod weights;
pub mod wide;

pub use context::{row_span, LayerContext};
pub use linear::{Embedding, Linear, Quantization};
pub use mlp::Mlp;
pub use rope::Rope;
pub use view::{Quantized, WeightsView};
pub use weights::{Split, Weights, WeightsError};
