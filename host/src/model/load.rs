//! Building a [`Gemma4`] from a Hugging Face-format directory: config, weights under any of the
//! prefixes checkpoints use, every tensor's shape checked against the config.

use std::path::Path;

use plugin_api::nn::{Embedding, Linear, Quantization, Rope, Weights, WeightsError};

use crate::distributed::{self, Group};

use super::config::{Gemma4Config, LayerType};
use super::gemma4::{Attention, DecoderLayer, Gemma4, Mlp, Moe, PerLayerInput, PerLayerInputs, Router, SwitchGlu};
use super::shard::Shard;
use super::ModelError;

/// Prefixes of the text model's tensors in the checkpoint formats we read.
const PREFIXES: [&str; 4] = ["model.language_model.", "language_model.model.", "model.", ""];

/// Loads the target whole, or, in a process that `host launch` made a rank, this rank's shard
/// of it (see [`super::shard`]).
pub fn load(dir: &Path) -> Result<Gemma4, ModelError> {
    load_on(dir, distributed::group()?)
}

/// Loads the target for `group`'s rank (whole for `None`).
pub fn load_on(dir: &Path, group: Option<&'static Group>) -> Result<Gemma4, ModelError> {
    let config = Gemma4Config::load(dir)?;
    let shard = group.map(|g| Shard { rank: g.rank, ranks: g.size }).unwrap_or(Shard { rank: 0, ranks: 1 });
    shard.check(&config)?;
    let wrap = |error: WeightsError| ModelError::Weights { dir: dir.to_owned(), error };
    let mut weights = match shard.ranks {
        1 => Weights::load_dir(dir),
        _ => Weights::load_dir_split(dir, &|name| shard.split(name)),
    }
    .map_err(wrap)?;
    normalize_names(&mut weights)?;
    let mut model = build(config, &weights, shard).map_err(wrap)?;
    model.group = group;
    // The arrays of weights repacked for AMX's tiles (see `nn::Linear`) now sit in MLX's
    // buffer cache: on the demo target 12 MB, more than its tiled weights' own 11 MB.
    drop(weights);
    mlx_rs::memory::clear_cache()?;
    Ok(model)
}

/// Renames tensors to the text model's own names (`embed_tokens.weight`, `layers.0.…`).
fn normalize_names(w: &mut Weights) -> Result<(), ModelError> {
    let prefix = PREFIXES.iter().find(|p| w.contains(&format!("{p}embed_tokens.weight"))).copied().unwrap_or("");
    if !prefix.is_empty() {
        w.rename_prefix(prefix, "");
    }
    if w.contains("language_model.lm_head.weight") {
        w.rename_prefix("language_model.lm_head.", "lm_head.");
    }
    // Hugging Face stores each layer's experts as one gate_up tensor; mlx-lm splits it.
    let fused: Vec<String> = w.names().filter(|n| n.ends_with(".experts.gate_up_proj")).map(str::to_owned).collect();
    for name in fused {
        let base = name.trim_end_matches(".gate_up_proj").to_owned();
        if let Some(gate_up) = w.remove(&name) {
            // [experts, 2 × intermediate, hidden]: the gate rows, then the up rows.
            let shape = gate_up.shape().to_vec();
            if shape.len() != 3 || shape[1] % 2 != 0 {
                let reason = format!("has shape {shape:?}; a fused gate_up is [experts, 2 × intermediate, hidden]");
                return Err(ModelError::Tensor { dir: w.dir.clone(), name, reason });
            }
            let parts = gate_up.split_equal(2, -2)?;
            w.insert(format!("{base}.switch_glu.gate_proj.weight"), parts[0].clone());
            w.insert(format!("{base}.switch_glu.up_proj.weight"), parts[1].clone());
        }
        if let Some(down) = w.remove(&format!("{base}.down_proj")) {
            w.insert(format!("{base}.switch_glu.down_proj.weight"), down);
        }
    }
    Ok(())
}

fn build(config: Gemma4Config, w: &Weights, shard: Shard) -> Result<Gemma4, WeightsError> {
    let c = &config;
    // Widths a rank holds: heads, KV heads, intermediate rows and experts are divided.
    let n = shard.ranks as i32;
    let q = |path: &str| -> Option<Quantization> {
        let quant = c.quantization.as_ref()?;
        w.contains(&format!("{path}.scales")).then(|| quant.for_module(path)).flatten()
    };
    let hidden = c.hidden_size;
    let norm = |name: &str, dims: i32| w.shaped(&format!("{name}.weight"), &[dims]);

    let vocab = c.vocab_size / n;
    let embed_tokens = Embedding::load(w, "embed_tokens", vocab, hidden, q("embed_tokens"))?;
    let layers_n = c.num_hidden_layers as i32;
    let per_layer_inputs = if c.hidden_size_per_layer_input > 0 {
        let width = c.hidden_size_per_layer_input;
        Some(PerLayerInputs {
            embed_tokens_per_layer: Embedding::load(
                w,
                "embed_tokens_per_layer",
                c.vocab_size_per_layer_input,
                layers_n * width,
                q("embed_tokens_per_layer"),
            )?,
            per_layer_model_projection: Linear::load(
                w,
                "per_layer_model_projection",
                layers_n * width,
                hidden,
                q("per_layer_model_projection"),
            )?,
            per_layer_projection_norm: norm("per_layer_projection_norm", width)?,
        })
    } else {
        None
    };

    let first_shared = c.first_kv_shared_layer();
    let mut kv_source: Vec<usize> = (0..c.num_hidden_layers).collect();
    for (j, source) in kv_source.iter_mut().enumerate().skip(first_shared) {
        let t = c.layer_type(j);
        *source = (0..first_shared).rev().find(|&i| c.layer_type(i) == t).ok_or_else(|| WeightsError::Missing {
            name: format!("a donor layer of type {t:?} for KV-shared layer {j}"),
            dir: w.dir.clone(),
        })?;
    }

    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let p = format!("layers.{i}");
        let head_dim = c.layer_head_dim(i);
        let n_heads = c.num_attention_heads / n;
        let n_kv = c.layer_kv_heads(i) / n;
        let has_kv = i < first_shared;
        let lin = |name: &str, out: i32, inp: i32| {
            Linear::load(w, &format!("{p}.{name}"), out, inp, q(&format!("{p}.{name}")))
        };
        let self_attn = Attention {
            q_proj: lin("self_attn.q_proj", n_heads * head_dim, hidden)?,
            k_proj: has_kv.then(|| lin("self_attn.k_proj", n_kv * head_dim, hidden)).transpose()?,
            v_proj: (has_kv && !c.k_eq_v(i)).then(|| lin("self_attn.v_proj", n_kv * head_dim, hidden)).transpose()?,
            o_proj: lin("self_attn.o_proj", hidden, n_heads * head_dim)?,
            q_norm: norm(&format!("{p}.self_attn.q_norm"), head_dim)?,
            k_norm: has_kv.then(|| norm(&format!("{p}.self_attn.k_norm"), head_dim)).transpose()?,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            rope: rope_for(c, i, head_dim)
                .map_err(|e| WeightsError::File { file: c.file.clone(), reason: e.to_string() })?,
        };
        let wide = c.use_double_wide_mlp && i >= first_shared && first_shared > 0;
        let inter = c.intermediate_size * if wide { 2 } else { 1 } / n;
        let mlp = Mlp {
            gate_proj: lin("mlp.gate_proj", inter, hidden)?,
            up_proj: lin("mlp.up_proj", inter, hidden)?,
            down_proj: lin("mlp.down_proj", hidden, inter)?,
        };
        let moe = if c.enable_moe_block {
            let local = c.num_experts / n;
            let experts = |name: &str, out: i32, inp: i32| {
                let path = format!("{p}.experts.switch_glu.{name}");
                load_experts(w, &path, local, out, inp, q(&path))
            };
            Some(Moe {
                router: Router {
                    proj: lin("router.proj", c.num_experts, hidden)?,
                    scale: w.shaped(&format!("{p}.router.scale"), &[hidden])?,
                    per_expert_scale: w.shaped(&format!("{p}.router.per_expert_scale"), &[c.num_experts])?,
                },
                experts: SwitchGlu {
                    gate_proj: experts("gate_proj", c.moe_intermediate_size, hidden)?,
                    up_proj: experts("up_proj", c.moe_intermediate_size, hidden)?,
                    down_proj: experts("down_proj", hidden, c.moe_intermediate_size)?,
                },
                top_k: c.top_k_experts,
                local_experts: shard.rank as i32 * local..(shard.rank as i32 + 1) * local,
                pre_feedforward_layernorm_2: norm(&format!("{p}.pre_feedforward_layernorm_2"), hidden)?,
                post_feedforward_layernorm_1: norm(&format!("{p}.post_feedforward_layernorm_1"), hidden)?,
                post_feedforward_layernorm_2: norm(&format!("{p}.post_feedforward_layernorm_2"), hidden)?,
            })
        } else {
            None
        };
        let per_layer = if c.hidden_size_per_layer_input > 0 {
            let width = c.hidden_size_per_layer_input;
            Some(PerLayerInput {
                per_layer_input_gate: lin("per_layer_input_gate", width, hidden)?,
                per_layer_projection: lin("per_layer_projection", hidden, width)?,
                post_per_layer_input_norm: norm(&format!("{p}.post_per_layer_input_norm"), hidden)?,
            })
        } else {
            None
        };
        layers.push(DecoderLayer {
            layer_type: c.layer_type(i),
            self_attn,
            mlp,
            moe,
            per_layer,
            input_layernorm: norm(&format!("{p}.input_layernorm"), hidden)?,
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"), hidden)?,
            pre_feedforward_layernorm: norm(&format!("{p}.pre_feedforward_layernorm"), hidden)?,
            post_feedforward_layernorm: norm(&format!("{p}.post_feedforward_layernorm"), hidden)?,
            layer_scalar: w.optional(&format!("{p}.layer_scalar"))?,
        });
    }
    let (embed_tokens, lm_head) = match c.tie_word_embeddings {
        true => (embed_tokens.tied_head(), None),
        false => (embed_tokens, Some(Linear::load(w, "lm_head", vocab, hidden, q("lm_head"))?)),
    };
    let dtype = embed_tokens.dtype();
    let expert_bytes = layers
        .iter()
        .filter_map(|l| l.moe.as_ref())
        .map(|m| m.experts.gate_proj.nbytes() + m.experts.up_proj.nbytes() + m.experts.down_proj.nbytes())
        .sum();
    let weight_bytes = w.nbytes();
    Ok(Gemma4 {
        norm: norm("norm", hidden)?,
        config,
        embed_tokens,
        per_layer_inputs,
        layers,
        lm_head,
        kv_source,
        dtype,
        weight_bytes,
        expert_bytes,
        group: None,
        vocab_offset: shard.rank as i32 * vocab,
        verify_ms: std::cell::OnceCell::new(),
    })
}

/// Stacked expert weights [E, out, in] (or their quantized form) at `path`.
fn load_experts(
    w: &Weights,
    path: &str,
    experts: i32,
    out: i32,
    inp: i32,
    q: Option<Quantization>,
) -> Result<Linear, WeightsError> {
    let name = format!("{path}.weight");
    Ok(match q {
        None => Linear::plain(w.shaped(&name, &[experts, out, inp])?),
        Some(q) => {
            let weight = w.packed(&name, &[experts, out, inp * q.bits / 32])?;
            let groups = inp / q.group_size;
            Linear::quantized(
                weight,
                w.shaped(&format!("{path}.scales"), &[experts, out, groups])?,
                w.shaped(&format!("{path}.biases"), &[experts, out, groups])?,
                q,
            )
        }
    })
}

fn rope_for(c: &Gemma4Config, layer: usize, head_dim: i32) -> Result<Rope, mlx_rs::error::Exception> {
    let r = match c.layer_type(layer) {
        LayerType::Sliding => &c.sliding_rope,
        LayerType::Full => &c.full_rope,
    };
    match r.partial_rotary_factor {
        None => Ok(Rope::Default { dims: head_dim, base: r.theta }),
        Some(partial) => Rope::proportional(head_dim, (head_dim as f32 * partial) as i32, r.theta, r.factor),
    }
}
