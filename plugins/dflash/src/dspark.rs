//! The seeds' DSpark checkpoints (`dspark.json`): a DFlash backbone without RoPE over a
//! projected context, then a Markov head chained on the drafted tokens and a confidence head
//! that can cut a draft short. Tensors are stored [in, out] and used as x·W; the matrices are
//! held transposed, [out, in], so that their products take the host's loops. Fields follow
//! their names.

use std::path::Path;

use plugin_api::config::ConfigFile;
use plugin_api::mlx_rs::error::Exception;
use plugin_api::mlx_rs::{Array, Dtype};
use plugin_api::nn::kernels::{row_major, with_floats};
use plugin_api::nn::layout::{add, concat, reshape, rows, swap_axes_1_2};
use plugin_api::nn::ops::{attention, first_max, geglu, rms_norm, tempered_softmax_rows, Mask};
use plugin_api::nn::{Linear, Weights};
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
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub ff_norm: Array,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

pub struct Dspark {
    pub config: DsparkConfig,
    pub bb: Vec<BackboneLayer>,
    pub w_c: Linear,
    pub ctx_norm: Array,
    pub tok_proj: Linear,
    pub mask_emb: Array,
    pub block_pos: Array,
    pub out_norm: Array,
    pub out_proj: Linear,
    /// [V, r], float32: row t is the Markov feature of previous token t.
    pub markov_w1: Array,
    pub markov_w2: Linear,
    /// [d + r], float32.
    pub conf_w: Array,
    pub conf_b: f32,
    /// The block's rows after the first, the same in every draft: mask_emb[k − 1] +
    /// block_pos[k] for k = 1..γ, [γ − 1, d].
    mask_rows: Array,
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
        let lin =
            |name: &str, shape: &[i32]| -> Result<Linear, PluginError> { Ok(Linear::from_in_out(&t(name, shape)?)?) };
        let float32 = |name: &str, shape: &[i32]| -> Result<Array, PluginError> {
            let a = t(name, shape)?.as_dtype(Dtype::Float32)?;
            a.eval()?;
            Ok(a)
        };
        let bb = (0..c.n_layers)
            .map(|i| {
                let n = |x: &str| format!("bb.{i}.{x}");
                Ok(BackboneLayer {
                    attn_norm: t(&n("attn_norm"), &[d])?,
                    q: lin(&n("q"), &[d, d])?,
                    k: lin(&n("k"), &[d, d])?,
                    v: lin(&n("v"), &[d, d])?,
                    o: lin(&n("o"), &[d, d])?,
                    ff_norm: t(&n("ff_norm"), &[d])?,
                    gate: lin(&n("gate"), &[d, f])?,
                    up: lin(&n("up"), &[d, f])?,
                    down: lin(&n("down"), &[f, d])?,
                })
            })
            .collect::<Result<Vec<_>, PluginError>>()?;
        let gamma = c.gamma as i32;
        let (mask_emb, block_pos) = (t("mask_emb", &[gamma - 1, d])?, t("block_pos", &[gamma, d])?);
        let mask_rows = mask_emb.add(rows(&block_pos, 1..c.gamma)?)?;
        mask_rows.eval()?;
        let conf_b = float32("conf.b", &[1])?.as_slice::<f32>()[0];
        Ok(Dspark {
            bb,
            w_c: lin("W_c", &[c.tap_layers.len() as i32 * h, d])?,
            ctx_norm: t("ctx_norm", &[d])?,
            tok_proj: lin("tok_proj", &[h, d])?,
            mask_emb,
            block_pos,
            out_norm: t("out_norm", &[d])?,
            out_proj: lin("out_proj", &[d, h])?,
            markov_w1: float32("markov.w1", &[v, r])?,
            markov_w2: lin("markov.w2", &[r, v])?,
            conf_w: float32("conf.w", &[d + r, 1])?,
            conf_b,
            mask_rows,
            weight_bytes: w.nbytes(),
            config,
        })
    }

    /// x [1, n, d] (or [n, d]) as heads [1, heads, n, d / heads].
    fn heads(&self, x: &Array) -> Result<Array, Exception> {
        let (n, heads) = (x.shape()[x.ndim() - 2], self.config.n_heads);
        swap_axes_1_2(&reshape(x, &[1, n, heads, self.config.d_draft / heads])?)
    }

    /// Appends projected context rows for tapped hidden states `taps` [1, S, m·H]: per layer,
    /// the keys and values of RMSNorm(attn_norm)(H_ctx).
    pub fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), Exception> {
        let eps = self.config.eps;
        let h_ctx = rms_norm(&self.w_c.forward(taps)?, Some(&self.ctx_norm), eps)?;
        for (i, layer) in self.bb.iter().enumerate() {
            let n = rms_norm(&h_ctx, Some(&layer.attn_norm), eps)?;
            let (k, v) = (self.heads(&layer.k.forward(&n)?)?, self.heads(&layer.v.forward(&n)?)?);
            context.push(i, k, v)?;
        }
        Ok(())
    }

    /// Drafts after `anchor`: the whole block of γ rows, then the Markov chain, stopping at
    /// the first position k ≥ 1 whose confidence is under `thresholds[k]`, and at `depth`.
    /// When sampling, `(draw, temperature)`: `draw(k, q)` picks position k's token from its
    /// probabilities at that temperature.
    ///
    /// Only the positions the chain can reach go through the head, and the chain runs on the
    /// host's copy of their logits: one MLX round trip per position would cost more than the
    /// position's arithmetic.
    pub fn draft(
        &self,
        context: &mut Context,
        target: &Target,
        anchor: u32,
        depth: usize,
        thresholds: &[f32],
        sampling: Option<(Draw<'_>, f32)>,
    ) -> Result<DsparkDraft, PluginError> {
        let c = &self.config;
        let (eps, gamma, d) = (c.eps, c.gamma as i32, c.d_draft);
        let mut draft = DsparkDraft { tokens: Vec::new(), confidences: Vec::new(), probabilities: None };
        let depth = depth.min(c.gamma);
        if depth == 0 {
            return Ok(draft);
        }
        let embedded = row_major(&target.embed(&Array::from_slice(&[anchor as i32], &[1, 1]), false)?)?;
        let embedded = with_floats(&embedded, |e| Array::from_slice(e, &[1, c.hidden_size]))?;
        let first = add(&self.tok_proj.forward(&embedded)?, &rows(&self.block_pos, 0..1)?)?;
        let mut h = concat(&[&first, &self.mask_rows], 0)?; // [γ, d]
        let scale = ((d / c.n_heads) as f32).powf(-0.5);
        for (i, layer) in self.bb.iter().enumerate() {
            let n = rms_norm(&h, Some(&layer.attn_norm), eps)?;
            let (q, kb, vb) = (
                self.heads(&layer.q.forward(&n)?)?,
                self.heads(&layer.k.forward(&n)?)?,
                self.heads(&layer.v.forward(&n)?)?,
            );
            let (keys, values) = context.with_block(i, kb, vb)?;
            let out = attention(&q, &keys, &values, scale, &Mask::All)?;
            let out = reshape(&swap_axes_1_2(&out)?, &[gamma, d])?;
            h = add(&h, &layer.o.forward(&out)?)?;
            let f = rms_norm(&h, Some(&layer.ff_norm), eps)?;
            h = add(&h, &layer.down.forward(&geglu(&layer.gate.forward(&f)?, &layer.up.forward(&f)?)?)?)?;
        }
        let h = rows(&rms_norm(&h, Some(&self.out_norm), eps)?, 0..depth)?; // [depth, d]
        let base =
            target.logits_from_hidden(&reshape(&self.out_proj.forward(&h)?, &[1, depth as i32, c.hidden_size])?)?;
        let base = with_floats(&row_major(&base)?, <[f32]>::to_vec)?; // [depth, V]
        let h = with_floats(&row_major(&h)?, <[f32]>::to_vec)?;
        let (v, r, d) = (c.vocab_size as usize, c.markov_rank as usize, d as usize);
        let (w1, conf_w) = (self.markov_w1.as_slice::<f32>(), self.conf_w.as_slice::<f32>());

        let mut probabilities = Vec::new();
        let mut previous = anchor as usize;
        for k in 0..depth {
            let markov = &w1[previous * r..(previous + 1) * r];
            let correction = self.markov_w2.forward(&Array::from_slice(markov, &[1, r as i32]))?;
            let logits: Vec<f32> =
                with_floats(&correction, |m| base[k * v..(k + 1) * v].iter().zip(m).map(|(b, m)| b + m).collect())?;
            let features = h[k * d..(k + 1) * d].iter().chain(markov);
            let score = features.zip(conf_w).fold(0f32, |sum, (x, w)| sum + x * w) + self.conf_b;
            let confidence = 1.0 / (1.0 + (-score).exp());
            if k >= 1 && confidence < thresholds.get(k).copied().unwrap_or(0.0) {
                break;
            }
            let token = match sampling {
                None => first_max(&logits),
                Some((draw, temperature)) => {
                    let mut q = logits.clone();
                    tempered_softmax_rows(&mut q, v, temperature);
                    let token = draw(k, &q);
                    probabilities.extend_from_slice(&q);
                    token
                }
            };
            draft.tokens.push(token);
            draft.confidences.push(confidence);
            previous = token as usize;
        }
        if sampling.is_some() && !draft.tokens.is_empty() {
            draft.probabilities = Some(Array::from_slice(&probabilities, &[draft.tokens.len() as i32, v as i32]));
        }
        Ok(draft)
    }
}
