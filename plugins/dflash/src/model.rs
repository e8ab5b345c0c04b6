//! The DFlash draft network. The target's tapped hidden states are projected (`fc`, then
//! `hidden_norm`) into context rows whose keys and values every layer caches; a block of
//! [pending, mask, mask, …] then attends to that context and to itself in one pass, and the
//! target's head reads the block's positions after the first. Fields follow the checkpoint's
//! tensor names.

use std::path::Path;

use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::Array;
use plugin_api::nn::layout::{add, reshape, slice, swap_axes_1_2};
use plugin_api::nn::ops::{attention_rows, rms_norm, KeyPiece, Mask, RowKeys};
use plugin_api::nn::{Linear, Mlp, Rope, Weights};
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

impl Dflash {
    pub fn load(dir: &Path) -> Result<Dflash, PluginError> {
        let config = DflashConfig::load(dir)?;
        let w = Weights::load_dir(dir)?;
        let vb = w.view();
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let taps = c.target_layer_ids.len() as i32;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format_args!("layers.{i}"));
                let attn = l.pp("self_attn");
                Ok(Layer {
                    self_attn: Attention {
                        q_proj: attn.linear("q_proj", c.num_attention_heads * hd, h)?,
                        k_proj: attn.linear("k_proj", c.num_key_value_heads * hd, h)?,
                        v_proj: attn.linear("v_proj", c.num_key_value_heads * hd, h)?,
                        o_proj: attn.linear("o_proj", h, c.num_attention_heads * hd)?,
                        q_norm: attn.norm("q_norm", hd)?,
                        k_norm: attn.norm("k_norm", hd)?,
                    },
                    mlp: Mlp::load(&l.pp("mlp"), h, c.intermediate_size)?,
                    input_layernorm: l.norm("input_layernorm", h)?,
                    post_attention_layernorm: l.norm("post_attention_layernorm", h)?,
                    window: c.windows[i],
                })
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        Ok(Dflash {
            fc: vb.linear("fc", h, taps * h)?,
            hidden_norm: vb.norm("hidden_norm", h)?,
            norm: vb.norm("norm", h)?,
            layers,
            rope: Rope::Default { dims: hd, base: c.rope_theta },
            weight_bytes: w.nbytes(),
            config,
        })
    }

    /// Appends context rows for tapped hidden states `taps` [1, S, taps·H] of the positions
    /// after those `context` holds.
    pub fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), Exception> {
        self.extend_rows(&mut [context], taps, &[taps.shape()[1] as usize])
    }

    /// Appends to `contexts[b]` the context rows of the first `kept[b]` positions of row b of
    /// `taps` [B, W, taps·H], every row projected in one pass.
    pub fn extend_rows(&self, contexts: &mut [&mut Context], taps: &Array, kept: &[usize]) -> Result<(), Exception> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let (b, s) = (taps.shape()[0], taps.shape()[1]);
        let starts: Vec<i32> = contexts.iter().map(|context| context.len() as i32).collect();
        let projected = rms_norm(&self.fc.forward(taps)?, Some(&self.hidden_norm), eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let heads = |proj: &Linear| reshape(&proj.forward(&projected)?, &[b, s, c.num_key_value_heads, c.head_dim]);
            let k = swap_axes_1_2(&rms_norm(&heads(&a.k_proj)?, Some(&a.k_norm), eps)?)?;
            let k = self.rope.apply_rows(&k, &starts)?;
            let v = swap_axes_1_2(&heads(&a.v_proj)?)?;
            for (row, context) in contexts.iter_mut().enumerate() {
                context.push_row(i, &k, &v, row, kept[row])?;
            }
        }
        Ok(())
    }

    /// The final hidden states [B, L, H] of blocks whose embeddings are `embedded` [B, L, H], row
    /// b's first position right after `contexts[b]`. The rows share every projection and norm;
    /// each attends to its own context, as it would alone.
    pub fn block(&self, contexts: &mut [&mut Context], embedded: &Array) -> Result<Array, Exception> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let (b, l) = (embedded.shape()[0], embedded.shape()[1]);
        let starts: Vec<i32> = contexts.iter().map(|context| context.len() as i32).collect();
        let mut h = embedded.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let r = rms_norm(&h, Some(&layer.input_layernorm), eps)?;
            let heads = |proj: &Linear, count: i32| reshape(&proj.forward(&r)?, &[b, l, count, c.head_dim]);
            let rotated = |proj: &Linear, count: i32, norm: &Array| -> Result<Array, Exception> {
                let x = swap_axes_1_2(&rms_norm(&heads(proj, count)?, Some(norm), eps)?)?;
                self.rope.apply_rows(&x, &starts)
            };
            let q = rotated(&a.q_proj, c.num_attention_heads, &a.q_norm)?;
            let k = rotated(&a.k_proj, c.num_key_value_heads, &a.k_norm)?;
            let v = swap_axes_1_2(&heads(&a.v_proj, c.num_key_value_heads)?)?;
            // Each row's block goes into its context's free slots, read there with the context.
            let masks: Vec<Mask> =
                contexts.iter().map(|context| block_mask(context.len(), l as usize, layer.window)).collect();
            let mut held = Vec::with_capacity(contexts.len());
            for (row, context) in contexts.iter_mut().enumerate() {
                let (k, v) = if b == 1 { (k.clone(), v.clone()) } else { (batch_row(&k, row)?, batch_row(&v, row)?) };
                held.push(context.with_block(i, k, v)?);
            }
            let rows: Vec<RowKeys> = held
                .iter()
                .zip(masks)
                .map(|((keys, values), mask)| RowKeys { pieces: vec![KeyPiece { keys, values, row: 0 }], mask })
                .collect();
            let out = attention_rows(&q, &rows, (c.head_dim as f32).powf(-0.5))?;
            let out = reshape(&swap_axes_1_2(&out)?, &[b, l, c.num_attention_heads * c.head_dim])?;
            h = add(&h, &a.o_proj.forward(&out)?)?;
            let f = rms_norm(&h, Some(&layer.post_attention_layernorm), eps)?;
            h = add(&h, &layer.mlp.swiglu(&f)?)?;
        }
        rms_norm(&h, Some(&self.norm), eps)
    }
}

/// Row `row` of x [B, H, L, D], as [1, H, L, D].
fn batch_row(x: &Array, row: usize) -> Result<Array, Exception> {
    let s = x.shape();
    slice(x, &[row..row + 1, 0..s[1] as usize, 0..s[2] as usize, 0..s[3] as usize])
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
