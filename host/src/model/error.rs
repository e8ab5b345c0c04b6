//! Why a target could not be loaded or run.

use std::path::PathBuf;

use plugin_api::nn::WeightsError;

use super::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{dir}: {error}")]
    Weights { dir: PathBuf, error: WeightsError },
    #[error("{dir}: tensor `{name}` {reason}")]
    Tensor { dir: PathBuf, name: String, reason: String },
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
    #[error("tensor parallelism: {0}")]
    Shard(String),
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistributedError),
    #[error("{0}")]
    Internal(String),
}
