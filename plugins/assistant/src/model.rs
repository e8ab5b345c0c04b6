//! The assistant network: a few Gemma 4 layers that attend, query-only, to the target's donor
//! K/V, between a projection in from the target's space and one back out. Fields follow the
//! checkpoint's tensor names.

use std::path::Path;

use plugin_api::draft_tree::most_probable;
use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::{Array, Dtype};
use plugin_api::nn::kernels::candidates::best_tokens;
use plugin_api::nn::kernels::{bits16, route, row_major, with_floats};
use plugin_api::nn::layout::{add, concat, reshape, scale, swap_axes_1_2};
use plugin_api::nn::ops::{attention_over_slots, rms_norm, Mask};
use plugin_api::nn::{Embedding, Linear, Mlp, Rope, Weights};
use plugin_api::target::DonorLayer;
use plugin_api::PluginError;

use crate::config::{AssistantConfig, LayerType};

pub struct Attention {
    pub q_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Array,
}

pub struct Layer {
    pub self_attn: Attention,
    pub mlp: Mlp,
    pub input_layernorm: Array,
    pub post_attention_layernorm: Array,
    pub pre_feedforward_layernorm: Array,
    pub post_feedforward_layernorm: Array,
    pub layer_scalar: Option<Array>,
    layer_type: LayerType,
    head_dim: i32,
    rope: Rope,
}

/// The centroid head: score centroids, keep the best few, score only their tokens.
pub struct MaskedEmbedding {
    pub centroids: Linear,
    /// [V] token ids grouped by centroid: row c of its [C, V/C] view holds centroid c's tokens.
    pub token_ordering: Array,
    /// `token_ordering`'s ids on the host, read once (reading the array each step waits on MLX).
    pub token_ordering_ids: Vec<i32>,
}

pub struct Assistant {
    pub config: AssistantConfig,
    pub pre_projection: Linear,
    pub post_projection: Linear,
    pub embed_tokens: Embedding,
    pub layers: Vec<Layer>,
    pub norm: Array,
    /// Present only when the checkpoint ships centroid tensors; else the tied head is used.
    pub masked_embedding: Option<MaskedEmbedding>,
    pub weight_bytes: usize,
}

/// One draft step's result for B rows.
pub struct Step {
    /// [B] token ids.
    pub tokens: Array,
    /// [B, 1, backbone hidden]: the hidden fed to the next step.
    pub next_hidden: Array,
    /// [B, 1, D]: the final normed hidden the head read ([`Assistant::top_tokens`]).
    pub normed: Array,
}

impl Assistant {
    pub fn load(dir: &Path) -> Result<Assistant, PluginError> {
        let config = AssistantConfig::load(dir)?;
        let w = Weights::load_dir(dir)?;
        let vb = w.view();
        let c = &config;
        let (d, t) = (c.hidden_size, c.backbone_hidden_size);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = vb.pp(format_args!("model.layers.{i}"));
            let hd = c.layer_head_dim(i);
            let layer_type = c.layer_types[i];
            let rope = match layer_type {
                LayerType::Sliding => Rope::Default { dims: hd, base: c.sliding_theta },
                LayerType::Full => {
                    Rope::proportional(hd, (hd as f32 * c.full_partial_rotary_factor) as i32, c.full_theta, 1.0)
                        .map_err(PluginError::from)?
                }
            };
            let attn = l.pp("self_attn");
            layers.push(Layer {
                self_attn: Attention {
                    q_proj: attn.linear("q_proj", c.num_attention_heads * hd, d)?,
                    o_proj: attn.linear("o_proj", d, c.num_attention_heads * hd)?,
                    q_norm: attn.norm("q_norm", hd)?,
                },
                mlp: Mlp::load(&l.pp("mlp"), d, c.intermediate_size)?,
                input_layernorm: l.norm("input_layernorm", d)?,
                post_attention_layernorm: l.norm("post_attention_layernorm", d)?,
                pre_feedforward_layernorm: l.norm("pre_feedforward_layernorm", d)?,
                post_feedforward_layernorm: l.norm("post_feedforward_layernorm", d)?,
                layer_scalar: l.optional("layer_scalar")?,
                layer_type,
                head_dim: hd,
                rope,
            });
        }
        // The centroid head needs its tensors: some artifacts declare centroids and ship none,
        // and then the tied head is the one that works.
        let masked_embedding = if c.use_ordered_embeddings && w.contains("masked_embedding.centroids.weight") {
            let masked = vb.pp("masked_embedding");
            let centroids = masked.linear("centroids", c.num_centroids, d)?;
            let token_ordering = masked.indices("token_ordering", &[c.vocab_size])?;
            if c.num_centroids <= 0 || c.vocab_size % c.num_centroids != 0 || c.centroid_intermediate_top_k <= 0 {
                return Err(PluginError::invalid_artifact(format!(
                    "{}: centroid head needs num_centroids dividing vocab_size {} and centroid_intermediate_top_k > 0",
                    dir.display(),
                    c.vocab_size
                )));
            }
            let token_ordering = token_ordering.as_dtype(Dtype::Int32).map_err(PluginError::from)?;
            let ids = token_ordering.try_as_slice::<i32>().map_err(|e| {
                PluginError::invalid_artifact(format!("{}: masked_embedding.token_ordering: {e}", dir.display()))
            })?;
            if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= c.vocab_size) {
                return Err(PluginError::invalid_artifact(format!(
                    "{}: masked_embedding.token_ordering holds token id {bad}, outside the vocabulary of {}",
                    dir.display(),
                    c.vocab_size
                )));
            }
            let token_ordering_ids = ids.to_vec();
            Some(MaskedEmbedding { centroids, token_ordering, token_ordering_ids })
        } else {
            None
        };
        Ok(Assistant {
            pre_projection: vb.linear("pre_projection", d, 2 * t)?,
            post_projection: vb.linear("post_projection", t, d)?,
            embed_tokens: vb.embedding("model.embed_tokens", c.vocab_size, d)?,
            norm: vb.norm("model.norm", d)?,
            layers,
            masked_embedding,
            weight_bytes: w.nbytes(),
            config,
        })
    }

    /// One draft step for B rows: `embedded` [B, 1, T] is the target's scaled embedding of the
    /// input token, `hidden` [B, 1, T] the target-space hidden before it, `positions` the rows'
    /// query positions (the pending token's, for every step of a round).
    pub fn step(
        &self,
        embedded: &Array,
        hidden: &Array,
        positions: &[i32],
        sliding: &DonorLayer,
        full: &DonorLayer,
    ) -> Result<Step, Exception> {
        let eps = self.config.rms_norm_eps;
        let x = concat(&[embedded, hidden], 2)?;
        let mut h = self.pre_projection.forward(&x)?;
        for layer in &self.layers {
            let donors = match layer.layer_type {
                LayerType::Sliding => sliding,
                LayerType::Full => full,
            };
            let r = rms_norm(&h, Some(&layer.input_layernorm), eps)?;
            let attn = layer.attend(&r, positions, donors, &self.config, eps)?;
            h = add(&h, &rms_norm(&attn, Some(&layer.post_attention_layernorm), eps)?)?;
            let f = rms_norm(&h, Some(&layer.pre_feedforward_layernorm), eps)?;
            let f = layer.mlp.geglu(&f)?;
            h = add(&h, &rms_norm(&f, Some(&layer.post_feedforward_layernorm), eps)?)?;
            if let Some(s) = &layer.layer_scalar {
                h = scale(&h, s)?;
            }
        }
        let h = rms_norm(&h, Some(&self.norm), eps)?;
        Ok(Step { tokens: self.head(&h)?, next_hidden: self.post_projection.forward(&h)?, normed: h })
    }

    /// The `n` tokens the head ranks highest for each row of h [B, 1, D] (a step's
    /// [`Step::normed`]), best first, ties to the lower id: the first is [`Self::head`]'s token.
    /// Read on the host where MLX runs on the CPU; `None` elsewhere.
    pub fn top_tokens(&self, h: &Array, n: usize) -> Result<Option<Vec<Vec<u32>>>, Exception> {
        if !route::on_cpu() {
            return Ok(None);
        }
        let b = h.shape()[0];
        match &self.masked_embedding {
            None => {
                let logits = row_major(&self.embed_tokens.as_linear(h)?.reshape(&[b, -1])?)?;
                let ranked = with_floats(&logits, |l| {
                    let vocab = l.len() / b as usize;
                    l.chunks(vocab).map(|row| most_probable(row, n).into_iter().map(|(t, _)| t).collect()).collect()
                })?;
                Ok(Some(ranked))
            }
            Some(m) => Ok(self
                .centroid_head_on_host(m, h, n)?
                .map(|rows| rows.into_iter().map(|row| row.into_iter().map(|t| t as u32).collect()).collect())),
        }
    }

    /// The greedy token of h [B, 1, D]; ties go to the lowest id.
    fn head(&self, h: &Array) -> Result<Array, Exception> {
        let b = h.shape()[0];
        match &self.masked_embedding {
            None => {
                let logits = self.embed_tokens.as_linear(h)?.reshape(&[b, -1])?;
                plugin_api::nn::ops::argmax_tokens(&logits)
            }
            Some(m) => {
                if let Some(rows) = self.centroid_head_on_host(m, h, 1)? {
                    let tokens: Vec<i32> = rows.iter().map(|best| best[0]).collect();
                    return Ok(Array::from_slice(&tokens, &[tokens.len() as i32]));
                }
                let c = &self.config;
                let per_centroid = c.vocab_size / c.num_centroids;
                let k = c.centroid_intermediate_top_k;
                let scores = m.centroids.forward(h)?.reshape(&[b, c.num_centroids])?;
                let order = plugin_api::mlx_rs::ops::argpartition_axis(&scores, c.num_centroids - k, -1)?;
                let top: Vec<i32> = (c.num_centroids - k..c.num_centroids).collect();
                let chosen = order.take_axis(Array::from_slice(&top, &[k]), -1)?; // [B, k]
                let groups = m.token_ordering.reshape(&[c.num_centroids, per_centroid])?;
                let candidates = groups.take_axis(&chosen, 0)?.reshape(&[b, k * per_centroid])?; // [B, k·V/C]
                let embedded = self.embed_tokens.embed(&candidates)?; // [B, k·V/C, D]
                let score = embedded.multiply(h)?.sum_axis(-1, None)?; // [B, k·V/C]
                                                                       // Among equal scores the lowest id wins: break ties on the id itself.
                let best = score.max_axis(-1, true)?;
                let tied = score.eq(&best)?;
                let big = Array::from_int(i32::MAX);
                let ids = plugin_api::mlx_rs::ops::select(&tied, &candidates, &big)?;
                ids.min_axis(-1, None)
            }
        }
    }

    /// [`Self::head`]'s centroid path in host loops, where MLX runs on the CPU and the table is
    /// plain (bfloat16 or float32): the centroids' product, the best k of their scores, then one
    /// dot product per candidate token, each a few hundred multiply-adds. The same steps as MLX
    /// ops cost a dispatch each, together more than the tied head's whole product, which the
    /// centroids are there to save; this path reads k·V/C rows of the table where the tied head
    /// reads all V. Each row's `n` best tokens, best first; `None` where it does not apply.
    fn centroid_head_on_host(
        &self,
        m: &MaskedEmbedding,
        h: &Array,
        n: usize,
    ) -> Result<Option<Vec<Vec<i32>>>, Exception> {
        if !route::on_cpu() || self.embed_tokens.scales.is_some() {
            return Ok(None);
        }
        let table = &self.embed_tokens.weight();
        let c = &self.config;
        let (d, per_centroid, k) =
            (c.hidden_size as usize, (c.vocab_size / c.num_centroids) as usize, c.centroid_intermediate_top_k as usize);
        let h = row_major(h)?;
        let scores = row_major(&m.centroids.forward(&h)?)?;
        let hs = with_floats(&h, <[f32]>::to_vec)?;
        let scores = with_floats(&scores, <[f32]>::to_vec)?;
        let ordering = &m.token_ordering_ids;
        // Scores rounded as the tied head's product rounds its outputs: to the activations'
        // dtype, where ties go to the lowest id.
        let to_bf16 = h.dtype() == Dtype::Bfloat16;
        let mut tokens = Vec::new();
        for (x, scores) in hs.chunks(d).zip(scores.chunks(c.num_centroids as usize)) {
            // The best k centroids, higher score first, ties to the lower index.
            let mut order: Vec<usize> = (0..scores.len()).collect();
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            let candidates: Vec<i32> = order[..k.min(order.len())]
                .iter()
                .flat_map(|&centroid| &ordering[centroid * per_centroid..(centroid + 1) * per_centroid])
                .copied()
                .collect();
            let best = match (table.dtype(), bits16(table)) {
                (Dtype::Bfloat16, Some(bits)) => best_tokens(bits, x, &candidates, to_bf16, n),
                (Dtype::Float32, _) => match table.try_as_slice::<f32>() {
                    Ok(floats) => best_tokens(floats, x, &candidates, to_bf16, n),
                    Err(_) => return Ok(None),
                },
                _ => return Ok(None),
            };
            // No finite score (broken weights): the MLX path reports it as it does.
            if best.is_empty() {
                return Ok(None);
            }
            tokens.push(best);
        }
        Ok(Some(tokens))
    }
}

impl Layer {
    /// Query-only attention of r [B, 1, D] over this layer type's donor K/V.
    fn attend(
        &self,
        r: &Array,
        positions: &[i32],
        donors: &DonorLayer,
        c: &AssistantConfig,
        eps: f32,
    ) -> Result<Array, Exception> {
        let b = r.shape()[0];
        let hd = self.head_dim;
        let q = reshape(&self.self_attn.q_proj.forward(r)?, &[b, 1, c.num_attention_heads, hd])?;
        let q = swap_axes_1_2(&rms_norm(&q, Some(&self.self_attn.q_norm), eps)?)?;
        let q = self.rope.apply_rows(&q, positions)?;
        let keys = donors.keys.borrow().to_array();
        let values = donors.values.borrow().to_array();
        let window = match self.layer_type {
            LayerType::Sliding => Some(c.sliding_window),
            LayerType::Full => None,
        };
        let (mask, slots) = donor_mask(&donors.slot_positions.borrow().to_array(), positions, window)?;
        // QK-norm replaces the 1/√d scale, as in the target.
        let out = attention_over_slots(&q, &keys, &values, slots, 1.0, &Mask::Array(mask))?;
        let out = reshape(&swap_axes_1_2(&out)?, &[b, 1, c.num_attention_heads * hd])?;
        self.self_attn.o_proj.forward(&out)
    }
}

/// [B, 1, 1, s]: a query at position p (the pending token, whose key the target has not
/// written) reads every cached position before p, and in a sliding layer of window W only the
/// last W + 1 of them, p − 1 − W ..= p − 1: transformers' assistant mask, |q − k| <= W flipped
/// to look back from the last cached key. The mask covers the first s slots, up to the last that
/// any row reads: a full layer's storage grows ahead of its writes, and the slots past them
/// would cost attention a masked score and a zero weight each.
fn donor_mask(slot_positions: &Array, positions: &[i32], window: Option<usize>) -> Result<(Array, usize), Exception> {
    let slots = slot_positions.as_dtype(Dtype::Int32)?;
    let s = slots.shape()[1] as usize;
    let data = slots.as_slice::<i32>();
    let reads = |row: usize, slot: usize| {
        let (k, p) = (data[row * s + slot], positions[row]);
        k >= 0 && k < p && window.is_none_or(|w| p - k <= w as i32 + 1)
    };
    // At least one slot, so that a row that reads none still meets MLX's masked softmax.
    let used = (0..s).rev().find(|&slot| (0..positions.len()).any(|row| reads(row, slot))).map_or(s.min(1), |j| j + 1);
    let mask: Vec<bool> = (0..positions.len()).flat_map(|row| (0..used).map(move |slot| reads(row, slot))).collect();
    Ok((Array::from_slice(&mask, &[positions.len() as i32, 1, 1, used as i32]), used))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head's ranking starts with its greedy token, with either head.
    #[test]
    fn the_top_token_is_the_heads_greedy_token() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/assistant");
        for name in ["centroids", "tied"] {
            let model = Assistant::load(&fixtures.join(name).join("assistant")).unwrap();
            let d = model.config.hidden_size;
            let key = plugin_api::mlx_rs::random::key(3).unwrap();
            let h = plugin_api::mlx_rs::random::normal::<f32>(&[4, 1, d], None, None, &key).unwrap();
            let h = h.as_dtype(model.embed_tokens.weight().dtype()).unwrap();
            let greedy = model.head(&h).unwrap().as_dtype(Dtype::Int32).unwrap();
            let ranked = model.top_tokens(&h, 3).unwrap().expect("read on the host");
            assert_eq!(ranked.len(), 4);
            for (row, (ranked, &greedy)) in ranked.iter().zip(greedy.as_slice::<i32>()).enumerate() {
                assert_eq!(ranked.len(), 3, "{name}, row {row}");
                assert_eq!(ranked[0], greedy as u32, "{name}, row {row}: {ranked:?}");
                assert!(ranked[1] != ranked[0] && ranked[2] != ranked[1], "{name}, row {row}: {ranked:?}");
            }
        }
    }

    #[test]
    fn the_donor_mask_ends_at_the_last_slot_any_row_reads() {
        // Two rows of a storage of 8 slots: row 0 holds positions 0..3, row 1 positions 0..5.
        let slots = Array::from_slice(&[0, 1, 2, -1, -1, -1, -1, -1, 0, 1, 2, 3, 4, -1, -1, -1], &[2, 8]);
        let (mask, used) = donor_mask(&slots, &[3, 5], None).unwrap();
        assert_eq!((used, mask.shape()), (5, &[2, 1, 1, 5][..]));
        let (t, f) = (true, false);
        assert_eq!(mask.as_slice::<bool>(), &[t, t, t, f, f, t, t, t, t, t]);
        // A window of 1 reads the last two positions before each query's.
        let (mask, used) = donor_mask(&slots, &[3, 4], Some(1)).unwrap();
        assert_eq!((used, mask.as_slice::<bool>()), (4, &[f, t, t, f, f, f, t, t][..]));
        // A row that reads nothing keeps one slot, all masked, as attention's softmax needs.
        let (mask, used) = donor_mask(&slots, &[0, 0], None).unwrap();
        assert_eq!((used, mask.as_slice::<bool>()), (1, &[f, f][..]));
    }
}
