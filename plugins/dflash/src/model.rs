//! The DFlash draft network. The target's tapped hidden states are projected (`fc`, then
//! `hidden_norm`) into context rows whose keys and values every layer caches; a block of
//! [pending, mask, mask, …] then attends to that context and to itself in one pass, and the
//! target's head reads the block's positions after the first. Fields follow the checkpoint's
//! tensor names.

use std::path::Path;

use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::Array;
use plugin_api::nn::ops::{attention, rms_norm, Mask};
use plugin_api::nn::{Linear, Rope, Weights, WeightsError};
use plugin_api::PluginError;

use crate::config::DflashConfig;

pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Array,
    pub k_norm: Array,
}

pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

pub struct Layer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Array,
    pub post_attention_layernorm: Array,
    window: Option<usize>,
}

pub struct Dflash {
    pub config: DflashConfig,
    pub fc: Linear,
    pub hidden_norm: Array,
    pub layers: Vec<Layer>,
    pub norm: Array,
    rope: Rope,
    pub weight_bytes: usize,
}

pub use plugin_api::nn::LayerContext as Context;

fn artifact_error(e: WeightsError) -> PluginError {
    PluginError::invalid_artifact(e.to_string())
}

impl Dflash {
    pub fn load(dir: &Path) -> Result<Dflash, PluginError> {
        let config = DflashConfig::load(dir)?;
        let w = Weights::load_dir(dir).map_err(artifact_error)?;
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let lin = |name: &str, out: i32, inp: i32| Linear::load(&w, name, out, inp, None).map_err(artifact_error);
        let norm = |name: &str, dims: i32| w.shaped(&format!("{name}.weight"), &[dims]).map_err(artifact_error);
        let taps = c.target_layer_ids.len() as i32;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("layers.{i}");
                Ok(Layer {
                    self_attn: Attention {
                        q_proj: lin(&format!("{p}.self_attn.q_proj"), c.num_attention_heads * hd, h)?,
                        k_proj: lin(&format!("{p}.self_attn.k_proj"), c.num_key_value_heads * hd, h)?,
                        v_proj: lin(&format!("{p}.self_attn.v_proj"), c.num_key_value_heads * hd, h)?,
                        o_proj: lin(&format!("{p}.self_attn.o_proj"), h, c.num_attention_heads * hd)?,
                        q_norm: norm(&format!("{p}.self_attn.q_norm"), hd)?,
                        k_norm: norm(&format!("{p}.self_attn.k_norm"), hd)?,
                    },
                    mlp: Mlp {
                        gate_proj: lin(&format!("{p}.mlp.gate_proj"), c.intermediate_size, h)?,
                        up_proj: lin(&format!("{p}.mlp.up_proj"), c.intermediate_size, h)?,
                        down_proj: lin(&format!("{p}.mlp.down_proj"), h, c.intermediate_size)?,
                    },
                    input_layernorm: norm(&format!("{p}.input_layernorm"), h)?,
                    post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"), h)?,
                    window: c.windows[i],
                })
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        Ok(Dflash {
            fc: lin("fc", h, taps * h)?,
            hidden_norm: norm("hidden_norm", h)?,
            norm: norm("norm", h)?,
            layers,
            rope: Rope::Default { dims: hd, base: c.rope_theta },
            weight_bytes: w.nbytes(),
            config,
        })
    }

    /// Appends context rows for tapped hidden states `taps` [1, S, taps·H] of the positions
    /// after those `context` holds.
    pub fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), Exception> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let start = context.len() as i32;
        let s = taps.shape()[1];
        let projected = rms_norm(&self.fc.forward(taps)?, Some(&self.hidden_norm), eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let k = a.k_proj.forward(&projected)?.reshape(&[1, s, c.num_key_value_heads, c.head_dim])?;
            let k = self.rope.apply(&rms_norm(&k, Some(&a.k_norm), eps)?.transpose_axes(&[0, 2, 1, 3])?, start)?;
            let v = a
                .v_proj
                .forward(&projected)?
                .reshape(&[1, s, c.num_key_value_heads, c.head_dim])?
                .transpose_axes(&[0, 2, 1, 3])?;
            context.push(i, k, v)?;
        }
        Ok(())
    }

    /// The final hidden states [1, L, H] of a block whose embeddings are `embedded` [1, L, H],
    /// its first row at the position right after the context.
    pub fn block(&self, context: &Context, embedded: &Array) -> Result<Array, Exception> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let n = context.len();
        let l = embedded.shape()[1];
        let mut h = embedded.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let r = rms_norm(&h, Some(&layer.input_layernorm), eps)?;
            let heads = |proj: &Linear, count: i32| proj.forward(&r)?.reshape(&[1, l, count, c.head_dim]);
            let q = self.rope.apply(
                &rms_norm(&heads(&a.q_proj, c.num_attention_heads)?, Some(&a.q_norm), eps)?
                    .transpose_axes(&[0, 2, 1, 3])?,
                n as i32,
            )?;
            let k = self.rope.apply(
                &rms_norm(&heads(&a.k_proj, c.num_key_value_heads)?, Some(&a.k_norm), eps)?
                    .transpose_axes(&[0, 2, 1, 3])?,
                n as i32,
            )?;
            let v = heads(&a.v_proj, c.num_key_value_heads)?.transpose_axes(&[0, 2, 1, 3])?;
            let (keys, values) = context.with_block(i, k, v)?;
            let mask = block_mask(n, l as usize, layer.window);
            let out = attention(&q, &keys, &values, (c.head_dim as f32).powf(-0.5), &mask)?;
            let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[1, l, c.num_attention_heads * c.head_dim])?;
            h = h.add(a.o_proj.forward(&out)?)?;
            let f = rms_norm(&h, Some(&layer.post_attention_layernorm), eps)?;
            let gate = layer.mlp.gate_proj.forward(&f)?;
            let silu = gate.multiply(plugin_api::mlx_rs::ops::sigmoid(&gate)?)?;
            h = h.add(layer.mlp.down_proj.forward(&silu.multiply(layer.mlp.up_proj.forward(&f)?)?)?)?;
        }
        rms_norm(&h, Some(&self.norm), eps)
    }
}

/// Which keys (N context rows, then the L block rows) each block row reads. Full layers: all
/// of them. Sliding layers of window W: block row i (position N + i) reads context positions
/// above N + i − W and block rows up to itself.
fn block_mask(n: usize, l: usize, window: Option<usize>) -> Mask {
    let Some(w) = window else { return Mask::All };
    let mut mask = Vec::with_capacity(l * (n + l));
    for i in 0..l {
        let q = (n + i) as i64;
        mask.extend((0..n).map(|k| q - (k as i64) < w as i64));
        mask.extend((0..l).map(|j| j <= i && i - j < w));
    }
    Mask::Array(Array::from_slice(&mask, &[1, 1, l as i32, (n + l) as i32]))
}
