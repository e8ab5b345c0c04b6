//! The gated feed-forward block of Gemma (GeGLU) and Qwen (SwiGLU) layers.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use super::linear::Linear;
use super::ops::{geglu, swiglu};
use super::view::WeightsView;
use super::weights::WeightsError;

#[derive(Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// `gate_proj`, `up_proj` [intermediate, hidden] and `down_proj` [hidden, intermediate].
    pub fn load(vb: &WeightsView, hidden: i32, intermediate: i32) -> Result<Mlp, WeightsError> {
        Ok(Mlp {
            gate_proj: vb.linear("gate_proj", intermediate, hidden)?,
            up_proj: vb.linear("up_proj", intermediate, hidden)?,
            down_proj: vb.linear("down_proj", hidden, intermediate)?,
        })
    }

    /// `down(gelu_tanh(gate(x)) · up(x))`, Gemma's.
    pub fn geglu(&self, x: &Array) -> Result<Array, Exception> {
        self.down_proj.forward(&geglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?)
    }

    /// `down(silu(gate(x)) · up(x))`, Qwen's.
    pub fn swiglu(&self, x: &Array) -> Result<Array, Exception> {
        self.down_proj.forward(&swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?)
    }

    pub fn nbytes(&self) -> usize {
        self.gate_proj.nbytes() + self.up_proj.nbytes() + self.down_proj.nbytes()
    }
}
