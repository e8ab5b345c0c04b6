//! The seeds' DSpark checkpoints (`dspark.json`): a DFlash backbone without RoPE over a
//! projected context, then a Markov head chained on the drafted tokens and a confidence head
//! that can cut a draft short. Tensors are stored [in, out] and used as x·W; fields follow
//! their names.

use std::path::Path;

use plugin_api::config::ConfigFile;
use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::{Array, Dtype};
use plugin_api::nn::ops::{attention, geglu, rms_norm, Mask};
use plugin_api::nn::Weights;
use plugin_api::sdk::{Draw, Target};
use plugin_api::PluginError;

use crate::model::Context;

pub struct DsparkConfig {
    pub gamma: usize,
    pub d_draft: i32,
    pub n_layers: usize,
    pub n_heads: i32,
    pub markov_rank: i32,
    pub ff_mult: i32,
    pub tap_layers: Vec<u32>,
    /// Per draft position, the confidence below which the draft stops there (STS).
    pub sts_thresholds: Vec<f32>,
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub eps: f32,
}

pub struct BackboneLayer {
    pub attn_norm: Array,
    pub q: Array,
    pub k: Array,
    pub v: Array,
    pub o: Array,
    pub ff_norm: Array,
    pub gate: Array,
    pub up: Array,
    pub down: Array,
}

pub struct Dspark {
    pub config: DsparkConfig,
    pub bb: Vec<BackboneLayer>,
    pub w_c: Array,
    pub ctx_norm: Array,
    pub tok_proj: Array,
    pub mask_emb: Array,
    pub block_pos: Array,
    pub out_norm: Array,
    pub out_proj: Array,
    pub markov_w1: Array,
    pub markov_w2: Array,
    pub conf_w: Array,
    pub conf_b: Array,
    pub weight_bytes: usize,
}

/// A draft of one row: tokens, the confidence of each, and (when sampled) their distributions.
pub struct DsparkDraft {
    pub tokens: Vec<u32>,
    pub confidences: Vec<f32>,
    pub probabilities: Option<Array>,
}

impl DsparkConfig {
    pub fn load(dir: &Path) -> Result<DsparkConfig, PluginError> {
        let file = ConfigFile::load(&dir.join("dspark.json"))?;
        let meta = file.root()?;
        match meta.opt_str("variant")? {
            Some("dspark") | Some("dflash") => {}
            other => {
                return Err(meta.error(
                    "variant",
                    format!(
                        "is {}: a v1 single-vector DSpark checkpoint, superseded and not servable (retrain a v2 one)",
                        other.map_or("absent".to_string(), |v| format!("{v:?}"))
                    ),
                ))
            }
        }
        // Every dimension is required: a guessed one would only surface as a shape error later.
        let c = meta.section("config", "config")?.ok_or_else(|| meta.error("config", "is missing"))?;
        let dims = meta.section("dims", "dims")?.ok_or_else(|| meta.error("dims", "is missing"))?;
        let head = c.str_or("seqHead", "markov")?;
        if head != "markov" {
            return Err(c.error("seqHead", format!("= {head:?} is not supported (only \"markov\")")));
        }
        let sts_thresholds = match c.section("sts", "config.sts")? {
            Some(sts) => sts.opt_floats("thresholds")?.unwrap_or_default(),
            None => Vec::new(),
        };
        Ok(DsparkConfig {
            gamma: c.int("gamma")? as usize,
            d_draft: c.int("dDraft")? as i32,
            n_layers: c.int("nLayers")? as usize,
            n_heads: c.int("nHeads")? as i32,
            markov_rank: c.int("markovRank")? as i32,
            ff_mult: c.int("ffMult")? as i32,
            tap_layers: c.u32_list("tapLayers")?,
            sts_thresholds,
            hidden_size: dims.int("hiddenSize")? as i32,
            vocab_size: dims.int("vocabSize")? as i32,
            eps: dims.float_or("eps", 1e-6)? as f32,
        })
    }
}

impl Dspark {
    pub fn load(dir: &Path) -> Result<Dspark, PluginError> {
        let config = DsparkConfig::load(dir)?;
        let w = Weights::load_file(&dir.join("model.safetensors"))?;
        let c = &config;
        let (d, h, v, r, f) = (c.d_draft, c.hidden_size, c.vocab_size, c.markov_rank, c.ff_mult * c.d_draft);
        let t = |name: &str, shape: &[i32]| w.shaped(name, shape);
        let bb = (0..c.n_layers)
            .map(|i| {
                let n = |x: &str| format!("bb.{i}.{x}");
                Ok(BackboneLayer {
                    attn_norm: t(&n("attn_norm"), &[d])?,
                    q: t(&n("q"), &[d, d])?,
                    k: t(&n("k"), &[d, d])?,
                    v: t(&n("v"), &[d, d])?,
                    o: t(&n("o"), &[d, d])?,
                    ff_norm: t(&n("ff_norm"), &[d])?,
                    gate: t(&n("gate"), &[d, f])?,
                    up: t(&n("up"), &[d, f])?,
                    down: t(&n("down"), &[f, d])?,
                })
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let gamma = c.gamma as i32;
        Ok(Dspark {
            bb,
            w_c: t("W_c", &[c.tap_layers.len() as i32 * h, d])?,
            ctx_norm: t("ctx_norm", &[d])?,
            tok_proj: t("tok_proj", &[h, d])?,
            mask_emb: t("mask_emb", &[gamma - 1, d])?,
            block_pos: t("block_pos", &[gamma, d])?,
            out_norm: t("out_norm", &[d])?,
            out_proj: t("out_proj", &[d, h])?,
            markov_w1: t("markov.w1", &[v, r])?,
            markov_w2: t("markov.w2", &[r, v])?,
            conf_w: t("conf.w", &[d + r, 1])?,
            conf_b: t("conf.b", &[1])?,
            weight_bytes: w.nbytes(),
            config,
        })
    }

    fn heads(&self, x: &Array) -> Result<Array, Exception> {
        let (n, heads) = (x.shape()[1], self.config.n_heads);
        x.reshape(&[1, n, heads, self.config.d_draft / heads])?.transpose_axes(&[0, 2, 1, 3])
    }

    /// Appends projected context rows for tapped hidden states `taps` [1, S, m·H]: per layer,
    /// the keys and values of RMSNorm(attn_norm)(H_ctx).
    pub fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), Exception> {
        let eps = self.config.eps;
        let h_ctx = rms_norm(&taps.matmul(&self.w_c)?, Some(&self.ctx_norm), eps)?;
        for (i, layer) in self.bb.iter().enumerate() {
            let n = rms_norm(&h_ctx, Some(&layer.attn_norm), eps)?;
            let (k, v) = (self.heads(&n.matmul(&layer.k)?)?, self.heads(&n.matmul(&layer.v)?)?);
            context.push(i, k, v)?;
        }
        Ok(())
    }

    /// Drafts after `anchor`: the whole block of γ rows, then the Markov chain, stopping at
    /// the first position k ≥ 1 whose confidence is under `thresholds[k]`, and at `depth`.
    /// When sampling, `(draw, temperature)`: `draw(k, q)` picks position k's token from its
    /// probabilities at that temperature.
    pub fn draft(
        &self,
        context: &Context,
        target: &Target,
        anchor: u32,
        depth: usize,
        thresholds: &[f32],
        sampling: Option<(Draw<'_>, f32)>,
    ) -> Result<DsparkDraft, PluginError> {
        let c = &self.config;
        let eps = c.eps;
        let gamma = c.gamma as i32;
        let embedded = target.embed(&Array::from_slice(&[anchor as i32], &[1, 1]), false)?.as_dtype(Dtype::Float32)?;
        let first = embedded.reshape(&[1, c.hidden_size])?.matmul(&self.tok_proj)?;
        let pos = |k: i32| self.block_pos.take_axis(Array::from_slice(&[k], &[1]), 0);
        let mut rows = vec![first.add(pos(0)?)?];
        for k in 1..gamma {
            rows.push(self.mask_emb.take_axis(Array::from_slice(&[k - 1], &[1]), 0)?.add(pos(k)?)?);
        }
        let mut h = plugin_api::mlx_rs::ops::concatenate(&rows, 0)?.reshape(&[1, gamma, c.d_draft])?;
        let scale = ((c.d_draft / c.n_heads) as f32).powf(-0.5);
        for (i, layer) in self.bb.iter().enumerate() {
            let n = rms_norm(&h, Some(&layer.attn_norm), eps)?;
            let (q, kb, vb) = (
                self.heads(&n.matmul(&layer.q)?)?,
                self.heads(&n.matmul(&layer.k)?)?,
                self.heads(&n.matmul(&layer.v)?)?,
            );
            let (keys, values) = context.with_block(i, kb, vb)?;
            let out = attention(&q, &keys, &values, scale, &Mask::All)?;
            let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[1, gamma, c.d_draft])?;
            h = h.add(out.matmul(&layer.o)?)?;
            let f = rms_norm(&h, Some(&layer.ff_norm), eps)?;
            h = h.add(geglu(&f.matmul(&layer.gate)?, &f.matmul(&layer.up)?)?.matmul(&layer.down)?)?;
        }
        let h = rms_norm(&h, Some(&self.out_norm), eps)?.reshape(&[gamma, c.d_draft])?;
        let base = target.logits_from_hidden(&h.matmul(&self.out_proj)?.reshape(&[1, gamma, c.hidden_size])?)?;
        let base = base.as_dtype(Dtype::Float32)?.reshape(&[gamma, c.vocab_size])?;

        let mut draft = DsparkDraft { tokens: Vec::new(), confidences: Vec::new(), probabilities: None };
        let mut probabilities = Vec::new();
        let mut previous = anchor;
        for k in 0..(depth.min(c.gamma)) {
            let markov = self.markov_w1.take_axis(Array::from_slice(&[previous as i32], &[1]), 0)?; // [1, r]
            let logits =
                base.take_axis(Array::from_slice(&[k as i32], &[1]), 0)?.add(markov.matmul(&self.markov_w2)?)?;
            let hk = h.take_axis(Array::from_slice(&[k as i32], &[1]), 0)?;
            let features = plugin_api::mlx_rs::ops::concatenate(&[hk, markov], -1)?;
            let confidence = plugin_api::mlx_rs::ops::sigmoid(&features.matmul(&self.conf_w)?.add(&self.conf_b)?)?
                .item_exact::<f32>();
            if k >= 1 && confidence < thresholds.get(k).copied().unwrap_or(0.0) {
                break;
            }
            let token = match sampling {
                None => plugin_api::mlx_rs::ops::indexing::argmax_axis(&logits.reshape(&[-1])?, 0, None)?
                    .item_exact::<u32>(),
                Some((draw, temperature)) => {
                    let tempered = logits.reshape(&[-1])?.divide(Array::from_f32(temperature))?;
                    let q = plugin_api::mlx_rs::ops::softmax_axis(&tempered, -1, true)?;
                    let token = draw(k, q.as_slice::<f32>());
                    probabilities.push(q);
                    token
                }
            };
            draft.tokens.push(token);
            draft.confidences.push(confidence);
            previous = token;
        }
        if sampling.is_some() && !probabilities.is_empty() {
            draft.probabilities = Some(plugin_api::mlx_rs::ops::stack(&probabilities, 0)?);
        }
        Ok(draft)
    }
}
