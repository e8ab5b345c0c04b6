//! The DeepSpec DSpark network: Gemma 4 layers (K=V or a v_proj, proportional RoPE, scale 1.0) over a
//! projected context, a block drafted in one non-causal pass, its own untied head, then the
//! Markov correction chained on the drafted tokens and a confidence per position. Fields
//! follow the checkpoint's tensor names.

use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use plugin_api::draft_tree::{likeliest_paths_with, most_probable, Tree};
use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::{Array, Dtype};
use plugin_api::nn::kernels::{rounded, with_floats};
use plugin_api::nn::layout::{add, concat, reshape, rows, scale, swap_axes_1_2};
use plugin_api::nn::ops::{attention, first_max, rms_norm, scalar, softcap, tempered_softmax_rows, Mask};
use plugin_api::nn::{Embedding, Linear, Mlp, Rope, Weights};
use plugin_api::PluginError;

use crate::config::DeepspecConfig;

/// Candidates per node of a tree: past the third, a position's tokens rarely carry mass a path
/// would need.
const TREE_BRANCHES: usize = 3;

pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    /// Absent with `attention_k_eq_v`: the values are the keys' projection.
    pub v_proj: Option<Linear>,
    pub o_proj: Linear,
    pub q_norm: Array,
    pub k_norm: Array,
}

pub struct Layer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Array,
    pub post_attention_layernorm: Array,
    pub pre_feedforward_layernorm: Array,
    pub post_feedforward_layernorm: Array,
    pub layer_scalar: Option<Array>,
}

pub struct MarkovHead {
    /// [V, r]: an embedding of the previous token.
    pub markov_w1: Embedding,
    /// [V, r]: used as x·Wᵀ.
    pub markov_w2: Linear,
}

pub struct Deepspec {
    pub config: DeepspecConfig,
    pub embed_tokens: Embedding,
    pub fc: Linear,
    pub hidden_norm: Array,
    pub layers: Vec<Layer>,
    pub norm: Array,
    pub lm_head: Linear,
    pub markov_head: MarkovHead,
    /// [1, H + r] and [1].
    pub confidence_head: Option<Linear>,
    pub confidence_bias: Option<Array>,
    rope: Rope,
    pub weight_bytes: usize,
}

pub use plugin_api::nn::LayerContext as Context;

/// A drafted block, as far as it went: tokens, their confidences, and the Markov-corrected
/// logits [tokens, V].
pub struct Block {
    pub tokens: Vec<u32>,
    pub confidences: Vec<f32>,
    pub logits: Array,
    /// Where drafts are drawn: each token's distribution [tokens, V], flat.
    pub probabilities: Vec<f32>,
}

impl Deepspec {
    pub fn load(dir: &Path) -> Result<Deepspec, PluginError> {
        let config = DeepspecConfig::load(dir)?;
        let w = Weights::load_dir(dir)?;
        let c = &config;
        let (h, hd, r) = (c.hidden_size, c.head_dim, c.markov_rank);
        // In an MLX-quantized sibling, a module is quantized when its scales are there.
        let q = |name: &str| c.quantization.filter(|_| w.contains(&format!("{name}.scales")));
        if c.quantization.is_none() && w.names().any(|n| n.ends_with(".scales")) {
            return Err(PluginError::invalid_artifact(format!(
                "{}: quantized weights but no `quantization` block in config.json",
                dir.display()
            )));
        }
        let quantized = |path: &str| q(path);
        let vb = w.view_quantized(&quantized);
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let l = vb.pp(format_args!("layers.{i}"));
                let attn = l.pp("self_attn");
                Ok(Layer {
                    self_attn: Attention {
                        q_proj: attn.linear("q_proj", c.num_attention_heads * hd, h)?,
                        k_proj: attn.linear("k_proj", c.num_key_value_heads * hd, h)?,
                        v_proj: (!c.attention_k_eq_v)
                            .then(|| attn.linear("v_proj", c.num_key_value_heads * hd, h))
                            .transpose()?,
                        o_proj: attn.linear("o_proj", h, c.num_attention_heads * hd)?,
                        q_norm: attn.norm("q_norm", hd)?,
                        k_norm: attn.norm("k_norm", hd)?,
                    },
                    mlp: Mlp::load(&l.pp("mlp"), h, c.intermediate_size)?,
                    input_layernorm: l.norm("input_layernorm", h)?,
                    post_attention_layernorm: l.norm("post_attention_layernorm", h)?,
                    pre_feedforward_layernorm: l.norm("pre_feedforward_layernorm", h)?,
                    post_feedforward_layernorm: l.norm("post_feedforward_layernorm", h)?,
                    layer_scalar: l.optional("layer_scalar")?,
                })
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let rope = Rope::proportional(hd, (hd as f32 * c.partial_rotary_factor) as i32, c.rope_theta, 1.0)?;
        let (confidence_head, confidence_bias) = if c.enable_confidence_head {
            (Some(vb.linear("confidence_head.proj", 1, h + r)?), Some(vb.tensor("confidence_head.proj.bias", &[1])?))
        } else {
            (None, None)
        };
        Ok(Deepspec {
            embed_tokens: vb.embedding("embed_tokens", c.vocab_size, h)?,
            fc: vb.linear("fc", h, c.target_layer_ids.len() as i32 * h)?,
            hidden_norm: vb.norm("hidden_norm", h)?,
            norm: vb.norm("norm", h)?,
            lm_head: vb.linear("lm_head", c.vocab_size, h)?,
            markov_head: MarkovHead {
                markov_w1: w.view().embedding("markov_head.markov_w1", c.vocab_size, r)?,
                markov_w2: vb.linear("markov_head.markov_w2", c.vocab_size, r)?,
            },
            confidence_head,
            confidence_bias,
            layers,
            rope,
            weight_bytes: w.nbytes(),
            config,
        })
    }

    fn heads(&self, x: &Array, count: i32) -> Result<Array, Exception> {
        let l = x.shape()[1];
        reshape(x, &[1, l, count, self.config.head_dim])
    }

    /// Keys (normed, roped at `start`..) and values (scale-less normed, no RoPE) of rows x.
    fn key_values(&self, layer: &Layer, x: &Array, start: i32) -> Result<(Array, Array), Exception> {
        let eps = self.config.rms_norm_eps;
        let kv_heads = self.config.num_key_value_heads;
        let raw = self.heads(&layer.self_attn.k_proj.forward(x)?, kv_heads)?;
        let raw_values = match &layer.self_attn.v_proj {
            Some(v_proj) => self.heads(&v_proj.forward(x)?, kv_heads)?,
            None => raw.clone(),
        };
        let values = swap_axes_1_2(&rms_norm(&raw_values, None, eps)?)?;
        let keys = self.rope.apply(&swap_axes_1_2(&rms_norm(&raw, Some(&layer.self_attn.k_norm), eps)?)?, start)?;
        Ok((keys, values))
    }

    /// Appends context rows for tapped hidden states `taps` [1, S, taps·H].
    pub fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), Exception> {
        let start = context.len() as i32;
        let c = rms_norm(&self.fc.forward(taps)?, Some(&self.hidden_norm), self.config.rms_norm_eps)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (k, v) = self.key_values(layer, &c, start)?;
            context.push(i, k, v)?;
        }
        Ok(())
    }

    /// The block after `anchor` (at the position right after the context): greedy tokens
    /// with the Markov correction, or drawn by `draw(k, probabilities)`, and confidences; at
    /// most `limit` of them, ending before the first whose confidence is under `threshold`.
    ///
    /// Only the positions the chain can reach go through the head, and the chain runs on the
    /// host's copy of their logits: one MLX round trip per position would cost more than the
    /// position's arithmetic.
    pub fn block(
        &self,
        context: &mut Context,
        anchor: u32,
        limit: usize,
        threshold: f32,
        draw: Option<plugin_api::sdk::Draw<'_>>,
        temperature: f32,
    ) -> Result<Block, Exception> {
        let c = &self.config;
        let limit = limit.min(c.block_size);
        let mut block = Block {
            tokens: Vec::new(),
            confidences: Vec::new(),
            logits: Array::from_slice::<f32>(&[], &[0, c.vocab_size]),
            probabilities: Vec::new(),
        };
        if limit == 0 {
            return Ok(block);
        }
        let (h, base) = self.base(context, anchor, limit)?;
        let mut corrected = Vec::with_capacity(limit);
        let mut previous = anchor;
        for k in 0..limit {
            let (logits, prev) = self.corrected(&base, k, previous)?;
            if let (Some(head), Some(bias)) = (&self.confidence_head, &self.confidence_bias) {
                let features = with_floats(&rows(&h, k..k + 1)?, |x| with_floats(&prev, |p| [x, p].concat()))??;
                let features = rounded(&features, &[1, features.len() as i32], h.dtype());
                let score = add(&head.forward(&features)?, &reshape(bias, &[1, 1])?)?;
                let confidence = sigmoid(&score)?;
                if confidence < threshold {
                    break;
                }
                block.confidences.push(confidence);
            }
            let token = match draw {
                None => with_floats(&logits, first_max)?,
                Some(draw) => {
                    let mut q = with_floats(&logits, <[f32]>::to_vec)?;
                    let vocab = q.len();
                    tempered_softmax_rows(&mut q, vocab, temperature);
                    let token = draw(k, &q);
                    block.probabilities.extend_from_slice(&q);
                    token
                }
            };
            block.tokens.push(token);
            corrected.push(logits);
            previous = token;
        }
        if !corrected.is_empty() {
            block.logits = concat(&corrected.iter().collect::<Vec<_>>(), 0)?;
        }
        Ok(block)
    }

    /// The block's pass after `anchor`: the final hidden states of its first `limit` positions
    /// [limit, H] and their logits before the Markov correction [limit, V].
    fn base(&self, context: &mut Context, anchor: u32, limit: usize) -> Result<(Array, Array), Exception> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        let gamma = c.block_size as i32;
        let start = context.len() as i32;
        let mut ids = vec![anchor as i32];
        ids.extend(std::iter::repeat_n(c.mask_token_id as i32, c.block_size - 1));
        let embedded = self.embed_tokens.embed(&Array::from_slice(&ids, &[1, gamma]))?;
        let mut h = scale(&embedded, &scalar((c.hidden_size as f32).sqrt(), embedded.dtype())?)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let x = rms_norm(&h, Some(&layer.input_layernorm), eps)?;
            let q = self.heads(&a.q_proj.forward(&x)?, c.num_attention_heads)?;
            let q = self.rope.apply(&swap_axes_1_2(&rms_norm(&q, Some(&a.q_norm), eps)?)?, start)?;
            let (kb, vb) = self.key_values(layer, &x, start)?;
            let (keys, values) = context.with_block(i, kb, vb)?;
            let out = attention(&q, &keys, &values, 1.0, &Mask::All)?;
            let out = reshape(&swap_axes_1_2(&out)?, &[1, gamma, c.num_attention_heads * c.head_dim])?;
            h = add(&h, &rms_norm(&a.o_proj.forward(&out)?, Some(&layer.post_attention_layernorm), eps)?)?;
            let f = rms_norm(&h, Some(&layer.pre_feedforward_layernorm), eps)?;
            let f = layer.mlp.geglu(&f)?;
            h = add(&h, &rms_norm(&f, Some(&layer.post_feedforward_layernorm), eps)?)?;
            if let Some(s) = &layer.layer_scalar {
                h = scale(&h, s)?;
            }
        }
        let h = rows(&reshape(&rms_norm(&h, Some(&self.norm), eps)?, &[gamma, c.hidden_size])?, 0..limit)?;
        let mut base = self.lm_head.forward(&h)?;
        if let Some(cap) = c.final_logit_softcapping {
            base = softcap(&base, cap)?;
        }
        Ok((h, base))
    }

    /// The block's position `k` logits after a token `previous`, with the Markov correction
    /// [1, V], and the correction's input [1, r].
    fn corrected(&self, base: &Array, k: usize, previous: u32) -> Result<(Array, Array), Exception> {
        let prev = self.markov_head.markov_w1.embed(&Array::from_slice(&[previous as i32], &[1]))?; // [1, r]
        let logits = add(&rows(base, k..k + 1)?, &self.markov_head.markov_w2.forward(&prev)?)?;
        Ok((logits, prev))
    }

    /// A tree of at most `nodes` drafts, no path deeper than `depth`, after `anchor`: under each
    /// node, the [`TREE_BRANCHES`] likeliest tokens of its position's logits corrected by the
    /// Markov head on the node's own token; the likeliest paths first
    /// ([`likeliest_paths_with`]). Each node's likeliest child is [`Self::block`]'s greedy
    /// choice there; the confidence cut does not apply (the node budget bounds the tree).
    pub fn tree(&self, context: &mut Context, anchor: u32, depth: usize, nodes: usize) -> Result<Tree, Exception> {
        let depth = depth.min(self.config.block_size);
        if depth == 0 || nodes == 0 {
            return Ok(Tree::default());
        }
        let (_, base) = self.base(context, anchor, depth)?;
        likeliest_paths_with(depth, nodes, |k, parent| {
            let (logits, _) = self.corrected(&base, k, parent.unwrap_or(anchor))?;
            let mut p = with_floats(&logits, <[f32]>::to_vec)?;
            let vocab = p.len();
            tempered_softmax_rows(&mut p, vocab, 1.0);
            Ok(most_probable(&p, TREE_BRANCHES))
        })
    }
}

/// MLX's sigmoid of every value of a half-precision dtype, indexed by bit pattern.
type SigmoidTable = Arc<Vec<f32>>;

/// MLX's sigmoid of a one-element score. Half-precision scores read a table of MLX's own
/// results for every value of their dtype, made once: the op's roundings come with it, and a
/// lookup costs nothing next to an MLX round trip per drafted position.
fn sigmoid(score: &Array) -> Result<f32, Exception> {
    static TABLES: OnceLock<Mutex<Vec<(Dtype, SigmoidTable)>>> = OnceLock::new();
    let dtype = score.dtype();
    let Some(bits) = (match dtype {
        Dtype::Bfloat16 | Dtype::Float16 => with_floats(score, |s| s[0])
            .map(|s| {
                if dtype == Dtype::Bfloat16 {
                    half::bf16::from_f32(s).to_bits()
                } else {
                    half::f16::from_f32(s).to_bits()
                }
            })
            .ok(),
        _ => None,
    }) else {
        return Ok(plugin_api::mlx_rs::ops::sigmoid(score)?.as_dtype(Dtype::Float32)?.item_exact::<f32>());
    };
    let mut tables = TABLES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    let table = match tables.iter().find(|(d, _)| *d == dtype) {
        Some((_, table)) => table.clone(),
        None => {
            let every = 0..=u16::MAX;
            let values = match dtype {
                Dtype::Bfloat16 => Array::from_slice(&every.map(half::bf16::from_bits).collect::<Vec<_>>(), &[1 << 16]),
                _ => Array::from_slice(&every.map(half::f16::from_bits).collect::<Vec<_>>(), &[1 << 16]),
            };
            let table = Arc::new(
                plugin_api::mlx_rs::ops::sigmoid(&values)?.as_dtype(Dtype::Float32)?.as_slice::<f32>().to_vec(),
            );
            tables.push((dtype, table.clone()));
            table
        }
    };
    Ok(table[bits as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sigmoid_table_gives_mlxs_op_on_one_element() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            for i in -400..400 {
                let score = Array::from_f32(i as f32 * 0.037).as_dtype(dtype).unwrap().reshape(&[1, 1]).unwrap();
                let op = plugin_api::mlx_rs::ops::sigmoid(&score).unwrap().as_dtype(Dtype::Float32).unwrap();
                assert_eq!(sigmoid(&score).unwrap(), op.item_exact::<f32>(), "{dtype:?} at {}", i as f32 * 0.037);
            }
        }
    }
}
