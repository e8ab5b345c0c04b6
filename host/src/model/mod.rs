//! The target model: Gemma 4 from Hugging Face-format checkpoints, and its KV caches.

pub mod cache;
pub mod config;
pub mod error;
pub mod gemma4;
pub mod load;
pub mod shard;
pub mod tree;

pub use cache::LayerCache;
pub use config::Gemma4Config;
pub use error::ModelError;
pub use gemma4::{Gemma4, Taps};
pub use load::load;
pub use tree::TreeLayout;
