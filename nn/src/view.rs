//! A prefix into a checkpoint's tensors, as candle's `VarBuilder::pp`: a module loads its own
//! tensor names through the view it is given and hands its children `view.pp("child")`, so
//! the prefix travels with the module and every error names the full tensor.

use std::fmt::Display;

use mlx_rs::Array;

use super::linear::{Embedding, Linear, Quantization};
use super::weights::{Weights, WeightsError};

/// Which modules are quantized, by module path (e.g. `layers.0.mlp.up_proj`).
pub type Quantized<'a> = &'a dyn Fn(&str) -> Option<Quantization>;

#[derive(Clone)]
pub struct WeightsView<'a> {
    weights: &'a Weights,
    prefix: String,
    quantized: Option<Quantized<'a>>,
}

impl Weights {
    /// All tensors, unprefixed and unquantized.
    pub fn view(&self) -> WeightsView<'_> {
        WeightsView { weights: self, prefix: String::new(), quantized: None }
    }

    /// All tensors, with `quantized` saying which modules carry MLX scales and biases.
    pub fn view_quantized<'a>(&'a self, quantized: Quantized<'a>) -> WeightsView<'a> {
        WeightsView { weights: self, prefix: String::new(), quantized: Some(quantized) }
    }
}

impl<'a> WeightsView<'a> {
    /// The full name of `name` under this view.
    pub fn path(&self, name: impl Display) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// The view of a child module.
    pub fn pp(&self, name: impl Display) -> WeightsView<'a> {
        WeightsView { weights: self.weights, prefix: self.path(name), quantized: self.quantized }
    }

    /// The linear layer `name` ([out, in]; quantized where the view says so).
    pub fn linear(&self, name: &str, out_dims: i32, in_dims: i32) -> Result<Linear, WeightsError> {
        let path = self.path(name);
        Linear::load(self.weights, &path, out_dims, in_dims, self.quantization(&path))
    }

    pub fn embedding(&self, name: &str, vocab: i32, dims: i32) -> Result<Embedding, WeightsError> {
        let path = self.path(name);
        Embedding::load(self.weights, &path, vocab, dims, self.quantization(&path))
    }

    /// The weight of norm `name`: `{name}.weight` of shape `[dims]`.
    pub fn norm(&self, name: &str, dims: i32) -> Result<Array, WeightsError> {
        self.weights.shaped(&self.path(format!("{name}.weight")), &[dims])
    }

    pub fn tensor(&self, name: &str, shape: &[i32]) -> Result<Array, WeightsError> {
        self.weights.shaped(&self.path(name), shape)
    }

    /// An integer tensor (token ids, an ordering).
    pub fn indices(&self, name: &str, shape: &[i32]) -> Result<Array, WeightsError> {
        self.weights.indices(&self.path(name), shape)
    }

    pub fn optional(&self, name: &str) -> Result<Option<Array>, WeightsError> {
        self.weights.optional(&self.path(name))
    }

    fn quantization(&self, path: &str) -> Option<Quantization> {
        self.quantized.and_then(|q| q(path))
    }
}
