//! The Gemma 4 text model, as mlx-lm's `gemma4_text` computes it. Fields follow the checkpoint's
//! tensor names.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};
use plugin_api::nn::layout::{add, index_axis_2, reshape, scale, swap_axes_1_2};
use plugin_api::nn::ops::{attention_over_slots, geglu, rms_norm, scalar, softcap, Mask};
use plugin_api::nn::{Embedding, Linear, Rope};

use std::rc::Rc;

use super::cache::LayerCache;
use super::config::{Gemma4Config, LayerType};
use super::error::ModelError;
use super::tree::{TreeKv, TreeLayout};
use crate::distributed::Group;

pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Option<Linear>,
    pub v_proj: Option<Linear>,
    pub o_proj: Linear,
    pub q_norm: Array,
    pub k_norm: Option<Array>,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub rope: Rope,
}

pub use plugin_api::nn::Mlp;

/// Experts stacked on a leading axis: [E, out, in] (quantized when their scales exist).
pub struct SwitchGlu {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

pub struct Router {
    pub proj: Linear,
    pub scale: Array,
    pub per_expert_scale: Array,
}

pub struct Moe {
    pub router: Router,
    pub experts: SwitchGlu,
    pub top_k: i32,
    /// The experts this rank holds (all of them in a single process).
    pub local_experts: std::ops::Range<i32>,
    pub pre_feedforward_layernorm_2: Array,
    pub post_feedforward_layernorm_1: Array,
    pub post_feedforward_layernorm_2: Array,
}

pub struct PerLayerInput {
    pub per_layer_input_gate: Linear,
    pub per_layer_projection: Linear,
    pub post_per_layer_input_norm: Array,
}

pub struct DecoderLayer {
    pub layer_type: LayerType,
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub moe: Option<Moe>,
    pub per_layer: Option<PerLayerInput>,
    pub input_layernorm: Array,
    pub post_attention_layernorm: Array,
    pub pre_feedforward_layernorm: Array,
    pub post_feedforward_layernorm: Array,
    pub layer_scalar: Option<Array>,
}

/// The model-level per-layer-input tables (Gemma 4 E2B/E4B).
pub struct PerLayerInputs {
    pub embed_tokens_per_layer: Embedding,
    pub per_layer_model_projection: Linear,
    pub per_layer_projection_norm: Array,
}

pub struct Gemma4 {
    pub config: Gemma4Config,
    pub embed_tokens: Embedding,
    pub per_layer_inputs: Option<PerLayerInputs>,
    pub layers: Vec<DecoderLayer>,
    pub norm: Array,
    pub lm_head: Option<Linear>,
    /// For each layer, the layer whose K/V it uses (itself, or the last donor of its type).
    pub kv_source: Vec<usize>,
    /// The activation dtype (the embedding's).
    pub dtype: Dtype,
    /// Bytes of all weights, and of the routed experts among them.
    pub weight_bytes: usize,
    pub expert_bytes: usize,
    /// The ranks of a tensor-parallel target, over which o_proj's and down_proj's partial
    /// outputs are summed; `None` in a single process.
    pub group: Option<&'static Group>,
    /// The first token id of this rank's slice of the vocabulary (of the embedding table and
    /// the head); 0 in a single process.
    pub vocab_offset: i32,
    /// Milliseconds of a verify forward at each window width, measured once, when a batch
    /// first drafts `"auto"` (`speculative::measure`).
    pub verify_ms: std::cell::OnceCell<Vec<f64>>,
}

/// Hidden states captured during a forward, at the requested layers.
pub struct Taps {
    pub layers: Vec<usize>,
    pub captured: Vec<Array>,
}

/// One layer's K/V as attention reads them, shared with the layers that reuse them: their
/// first `slots` slots, or a tree forward's.
#[derive(Clone)]
enum SharedKv {
    Slots { keys: Array, values: Array, slots: usize, mask: Mask },
    Tree(Rc<TreeKv>),
}

/// Where a forward's keys and values go: written into the caches after what they hold, or, for
/// a tree of drafts, read beside them ([`TreeLayout`]).
enum Writes<'a> {
    Caches(&'a mut [LayerCache]),
    Tree(&'a TreeLayout, &'a [LayerCache]),
}

/// A layer's part of [`Writes`].
enum LayerWrite<'a> {
    Cache(Option<&'a mut LayerCache>),
    Tree(&'a TreeLayout, Option<&'a LayerCache>),
}

impl Gemma4 {
    /// One cache per donor layer for `rows` rows: a ring for sliding layers (rolling back up
    /// to `slack` rows), a growing cache for full ones.
    pub fn make_caches(&self, rows: usize, slack: usize) -> Vec<LayerCache> {
        (0..self.config.first_kv_shared_layer())
            .map(|i| match self.config.layer_type(i) {
                LayerType::Full => LayerCache::full(rows),
                LayerType::Sliding => LayerCache::sliding(rows, self.config.sliding_window, slack),
            })
            .collect()
    }

    /// Weight bytes one decode step reads: everything but the experts not routed to (and
    /// the embedding table, of which a step reads one row, unless it is also the head).
    pub fn weight_bytes_per_token(&self) -> usize {
        let c = &self.config;
        let experts_unused = if c.enable_moe_block {
            self.expert_bytes - self.expert_bytes * c.top_k_experts as usize / c.num_experts as usize
        } else {
            0
        };
        let per_layer_table = self.per_layer_inputs.as_ref().map_or(0, |p| p.embed_tokens_per_layer.nbytes());
        let untied_table = if self.lm_head.is_some() { self.embed_tokens.nbytes() } else { 0 };
        self.weight_bytes - experts_unused - per_layer_table - untied_table
    }

    /// Token embeddings of ids [B, L], times √hidden when `scaled` (the model's own input).
    pub fn embed(&self, ids: &Array, scaled: bool) -> Result<Array, Exception> {
        let h = match self.group {
            None => self.embed_tokens.embed(ids)?,
            // This rank's rows of the table for the ids in its slice of the vocabulary, zeros
            // for the others: the ranks' rows add up to the table's, exactly.
            Some(g) => {
                let rows = self.embed_tokens.vocab();
                let local = ids.subtract(Array::from_int(self.vocab_offset))?;
                let here = local.ge(Array::from_int(0))?.logical_and(local.lt(Array::from_int(rows))?)?;
                let found = self.embed_tokens.embed(&mlx_rs::ops::select(&here, &local, Array::from_int(0))?)?;
                let zero = scalar(0.0, found.dtype())?;
                g.all_sum(&mlx_rs::ops::select(&here.expand_dims(-1)?, &found, &zero)?)?
            }
        };
        if !scaled {
            return Ok(h);
        }
        scale(&h, &scalar((self.config.hidden_size as f32).sqrt(), h.dtype())?)
    }

    /// Logits [B, L, V] from final hidden states: the (tied) head, then the softcap.
    pub fn logits_from_hidden(&self, h: &Array) -> Result<Array, Exception> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed_tokens.as_linear(h)?,
        };
        // Each rank scored its slice of the vocabulary; all_gather joins slices along the first
        // axis, so the vocabulary goes there and back (to row-major logits, as a single
        // process returns them).
        let logits = match self.group {
            None => logits,
            Some(g) => {
                let last = logits.ndim() as i32 - 1;
                let slices = g.all_gather(&mlx_rs::ops::move_axis(&logits, last, 0)?)?;
                mlx_rs::ops::move_axis(&slices, 0, last)?.contiguous()?
            }
        };
        match self.config.final_logit_softcapping {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// The final-normed hidden states [B, L, H] of ids [B, L], row r written after what
    /// `caches` hold for it. `taps` (layer index, or the layer count for the final norm) are
    /// captured.
    pub fn forward_hidden(
        &self,
        ids: &Array,
        caches: &mut [LayerCache],
        taps: Option<&mut Taps>,
    ) -> Result<Array, ModelError> {
        Ok(self.forward_with(ids, Writes::Caches(caches), taps)?.0)
    }

    /// The final-normed hidden states [N, 1, H] of the node rows of trees of drafts, ids
    /// [N, 1] laid out by `layout` over what `caches` hold, which stay as they are; with each
    /// cache's layer's keys and values of every node row [N, Hkv, 1, D], from which the
    /// accepted paths are written.
    pub fn forward_tree(
        &self,
        ids: &Array,
        layout: &TreeLayout,
        caches: &[LayerCache],
        taps: Option<&mut Taps>,
    ) -> Result<(Array, Vec<(Array, Array)>), ModelError> {
        self.forward_with(ids, Writes::Tree(layout, caches), taps)
    }

    fn forward_with(
        &self,
        ids: &Array,
        mut writes: Writes,
        mut taps: Option<&mut Taps>,
    ) -> Result<(Array, Vec<(Array, Array)>), ModelError> {
        let c = &self.config;
        let rows = ids.shape()[0] as usize;
        let offsets: Vec<i32> = match &writes {
            Writes::Caches(caches) => match caches.first() {
                Some(cache) => cache.offsets().iter().map(|&o| o as i32).collect(),
                None => vec![0; rows],
            },
            Writes::Tree(layout, _) => layout.positions.clone(),
        };
        let mut h = self.embed(ids, true)?;
        let per_layer = self.per_layer_inputs(ids, &h)?;

        let mut shared: Vec<Option<SharedKv>> = vec![None; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let source = self.kv_source[i];
            let write = match &mut writes {
                Writes::Caches(caches) => LayerWrite::Cache(caches.get_mut(i).filter(|_| source == i)),
                Writes::Tree(layout, caches) => LayerWrite::Tree(layout, caches.get(i).filter(|_| source == i)),
            };
            let per_layer = per_layer.as_ref().map(|p| (p, i));
            let (out, kv) = layer.forward(&h, &offsets, write, shared[source].clone(), per_layer, self)?;
            h = out;
            if source == i {
                shared[i] = Some(kv);
            }
            if let Some(t) = taps.as_deref_mut() {
                if t.layers.contains(&i) {
                    t.captured.push(h.clone());
                }
            }
        }
        let h = rms_norm(&h, Some(&self.norm), c.rms_norm_eps)?;
        if let Some(t) = taps {
            if t.layers.contains(&self.layers.len()) {
                t.captured.push(h.clone());
            }
        }
        // The tree's keys and values of each cached layer.
        let written = match writes {
            Writes::Caches(_) => Vec::new(),
            Writes::Tree(_, caches) => (0..caches.len())
                .filter_map(|i| match &shared[i] {
                    Some(SharedKv::Tree(kv)) => Some((kv.keys.clone(), kv.values.clone())),
                    _ => None,
                })
                .collect(),
        };
        Ok((h, written))
    }

    fn per_layer_inputs(&self, ids: &Array, h: &Array) -> Result<Option<Array>, Exception> {
        let Some(p) = &self.per_layer_inputs else { return Ok(None) };
        let c = &self.config;
        let width = c.hidden_size_per_layer_input;
        let layers = c.num_hidden_layers as i32;
        let [b, l] = [ids.shape()[0], ids.shape()[1]];
        let tokens = p.embed_tokens_per_layer.embed(ids)?;
        let tokens =
            reshape(&scale(&tokens, &scalar((width as f32).sqrt(), tokens.dtype())?)?, &[b, l, layers, width])?;
        let projected = p.per_layer_model_projection.forward(h)?;
        let projected = scale(&projected, &scalar((c.hidden_size as f32).powf(-0.5), projected.dtype())?)?;
        let projected = rms_norm(
            &reshape(&projected, &[b, l, layers, width])?,
            Some(&p.per_layer_projection_norm),
            c.rms_norm_eps,
        )?;
        let combined = add(&projected, &tokens)?;
        Ok(Some(scale(&combined, &scalar(0.5f32.sqrt(), combined.dtype())?)?))
    }
}

impl DecoderLayer {
    fn forward(
        &self,
        x: &Array,
        offsets: &[i32],
        write: LayerWrite,
        shared: Option<SharedKv>,
        per_layer: Option<(&Array, usize)>,
        model: &Gemma4,
    ) -> Result<(Array, SharedKv), ModelError> {
        let (eps, group) = (model.config.rms_norm_eps, model.group);
        let r = rms_norm(x, Some(&self.input_layernorm), eps)?;
        let (attn, kv) = self.self_attn.forward(&r, offsets, write, shared, eps)?;
        let attn = sum_over_ranks(group, attn)?;
        let h = add(x, &rms_norm(&attn, Some(&self.post_attention_layernorm), eps)?)?;

        let ff = match &self.moe {
            None => {
                let dense = self.mlp.geglu(&rms_norm(&h, Some(&self.pre_feedforward_layernorm), eps)?)?;
                sum_over_ranks(group, dense)?
            }
            Some(moe) => {
                let dense = self.mlp.geglu(&rms_norm(&h, Some(&self.pre_feedforward_layernorm), eps)?)?;
                let routed = moe.forward(&h, eps)?;
                // Both partial sums cross the ranks in one collective.
                let (dense, routed) = match group {
                    None => (dense, routed),
                    Some(g) => {
                        let both = g.all_sum(&mlx_rs::ops::stack(&[dense, routed], 0)?)?;
                        (both.index(0), both.index(1))
                    }
                };
                let dense = rms_norm(&dense, Some(&moe.post_feedforward_layernorm_1), eps)?;
                dense.add(rms_norm(&routed, Some(&moe.post_feedforward_layernorm_2), eps)?)?
            }
        };
        let mut h = add(&h, &rms_norm(&ff, Some(&self.post_feedforward_layernorm), eps)?)?;

        if let (Some(p), Some((inputs, i))) = (&self.per_layer, per_layer) {
            let layer_input = index_axis_2(inputs, i)?;
            let gate = geglu(&p.per_layer_input_gate.forward(&h)?, &layer_input)?;
            let gate = rms_norm(&p.per_layer_projection.forward(&gate)?, Some(&p.post_per_layer_input_norm), eps)?;
            h = add(&h, &gate)?;
        }
        if let Some(s) = &self.layer_scalar {
            h = scale(&h, s)?;
        }
        Ok((h, kv))
    }
}

impl Attention {
    fn forward(
        &self,
        x: &Array,
        offsets: &[i32],
        write: LayerWrite,
        shared: Option<SharedKv>,
        eps: f32,
    ) -> Result<(Array, SharedKv), ModelError> {
        let [b, l] = [x.shape()[0], x.shape()[1]];
        let write_layout = match &write {
            LayerWrite::Tree(layout, _) => Some(*layout),
            LayerWrite::Cache(_) => None,
        };
        let q = reshape(&self.q_proj.forward(x)?, &[b, l, self.n_heads, self.head_dim])?;
        let q = swap_axes_1_2(&rms_norm(&q, Some(&self.q_norm), eps)?)?;
        let q = self.rope.apply_rows(&q, offsets)?;

        let kv = match (shared, &self.k_proj, &self.k_norm) {
            (Some(kv), _, _) => kv,
            (None, Some(k_proj), Some(k_norm)) => {
                let k = reshape(&k_proj.forward(x)?, &[b, l, self.n_kv_heads, self.head_dim])?;
                let v = match &self.v_proj {
                    Some(v_proj) => reshape(&v_proj.forward(x)?, &[b, l, self.n_kv_heads, self.head_dim])?,
                    None => k.clone(),
                };
                let k = self.rope.apply_rows(&swap_axes_1_2(&rms_norm(&k, Some(k_norm), eps)?)?, offsets)?;
                let v = swap_axes_1_2(&rms_norm(&v, None, eps)?)?;
                match write {
                    LayerWrite::Cache(Some(cache)) => {
                        let f = cache.write(&k, &v)?;
                        SharedKv::Slots { keys: f.keys, values: f.values, slots: f.slots, mask: f.mask }
                    }
                    LayerWrite::Cache(None) => SharedKv::Slots {
                        mask: if l == 1 { Mask::All } else { Mask::Causal },
                        slots: l as usize,
                        keys: k,
                        values: v,
                    },
                    LayerWrite::Tree(layout, cache) => SharedKv::Tree(Rc::new(TreeKv::new(layout, &k, &v, cache)?)),
                }
            }
            _ => return Err(ModelError::Internal("a KV-sharing layer ran before its donor".into())),
        };
        let out = match (&kv, &write_layout) {
            (SharedKv::Slots { keys, values, slots, mask }, _) => {
                attention_over_slots(&q, keys, values, *slots, 1.0, mask)?
            }
            (SharedKv::Tree(tree), Some(layout)) => tree.attend(&q, layout, 1.0)?,
            (SharedKv::Tree(_), None) => {
                return Err(ModelError::Internal("a tree's keys reached a forward without a tree".into()))
            }
        };
        let out = reshape(&swap_axes_1_2(&out)?, &[b, l, self.n_heads * self.head_dim])?;
        Ok((self.o_proj.forward(&out)?, kv))
    }
}

impl Moe {
    /// The routed experts: RMSNorm with scale·hidden^-½, top-k scores, softmax over them
    /// times each expert's scale, then the chosen experts' GeGLU weighted and summed.
    fn forward(&self, h: &Array, eps: f32) -> Result<Array, Exception> {
        let hidden = h.shape()[2];
        let r = &self.router;
        let weight = r.scale.multiply(scalar((hidden as f32).powf(-0.5), r.scale.dtype())?)?;
        let scores = r.proj.forward(&rms_norm(h, Some(&weight), eps)?)?;
        let experts = scores.shape()[2];
        let order = mlx_rs::ops::argpartition_axis(&scores, experts - self.top_k, -1)?;
        let top: Vec<i32> = (experts - self.top_k..experts).collect();
        let indices = order.take_axis(Array::from_slice(&top, &[self.top_k]), -1)?;
        let weights = scores.take_along_axis(&indices, -1)?;
        let weights =
            mlx_rs::ops::softmax_axis(&weights, -1, None)?.multiply(r.per_expert_scale.take_axis(&indices, 0)?)?;
        let (indices, weights) = self.local(indices, weights, experts)?;

        let x = rms_norm(h, Some(&self.pre_feedforward_layernorm_2), eps)?.expand_dims_axes(&[-2, -3])?;
        let up = switch_linear(&self.experts.up_proj, &x, &indices)?;
        let gate = switch_linear(&self.experts.gate_proj, &x, &indices)?;
        let y = switch_linear(&self.experts.down_proj, &geglu(&gate, &up)?, &indices)?.squeeze_axes(&[-2])?;
        y.multiply(weights.expand_dims(-1)?)?.sum_axis(-2, None)
    }

    /// Routing restricted to the experts this rank holds: indices into its own stack, with the
    /// weight of every expert held elsewhere zeroed (its slot computes expert 0 of the stack,
    /// which then counts for nothing). The other ranks add what they hold.
    fn local(&self, indices: Array, weights: Array, experts: i32) -> Result<(Array, Array), Exception> {
        let range = &self.local_experts;
        if range.start == 0 && range.end == experts {
            return Ok((indices, weights));
        }
        let local = indices.subtract(Array::from_int(range.start))?;
        let here = local.ge(Array::from_int(0))?.logical_and(local.lt(Array::from_int(range.end - range.start))?)?;
        let indices = mlx_rs::ops::select(&here, &local, Array::from_int(0))?;
        let weights = mlx_rs::ops::select(&here, &weights, scalar(0.0, weights.dtype())?)?;
        Ok((indices, weights))
    }
}

/// Sums a rank's partial output over all ranks; a single process holds the whole sum already.
fn sum_over_ranks(group: Option<&Group>, x: Array) -> Result<Array, Exception> {
    match group {
        Some(g) => g.all_sum(&x),
        None => Ok(x),
    }
}

/// x [.., 1, 1, in] through the experts chosen by `indices` [.., k]: [.., k, 1, out].
fn switch_linear(l: &Linear, x: &Array, indices: &Array) -> Result<Array, Exception> {
    match (&l.scales, l.quantization) {
        (Some(scales), Some(q)) => mlx_rs::ops::gather_qmm(
            x,
            l.weight(),
            scales,
            l.biases.as_ref(),
            None,
            indices,
            true,
            q.group_size,
            q.bits,
            false,
        ),
        _ => mlx_rs::ops::gather_mm(x, l.weight().swap_axes(-1, -2)?, None, indices, false),
    }
}
