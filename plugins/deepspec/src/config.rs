//! A `Gemma4DSparkModel` `config.json`: a copied Gemma 4 text config (full attention, K=V or
//! a separate `v_proj`, proportional RoPE) plus the block, taps, Markov and confidence heads.

use std::path::Path;

use plugin_api::config::ConfigFile;
use plugin_api::nn::Quantization;
use plugin_api::PluginError;

#[derive(Debug, Clone)]
pub struct DeepspecConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub intermediate_size: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub final_logit_softcapping: Option<f32>,
    pub rope_theta: f32,
    pub partial_rotary_factor: f32,
    /// Values are the keys' projection (no `v_proj`), as released DSpark drafters have it.
    pub attention_k_eq_v: bool,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<u32>,
    pub num_target_layers: u32,
    pub markov_rank: i32,
    pub enable_confidence_head: bool,
    /// The `quantization` block of an MLX-quantized sibling; modules with `.scales` use it.
    pub quantization: Option<Quantization>,
}

impl DeepspecConfig {
    pub fn load(dir: &Path) -> Result<DeepspecConfig, PluginError> {
        let file = ConfigFile::load(&dir.join("config.json"))?;
        let c = file.root()?;
        let arch = c.opt_strings("architectures")?.and_then(|a| a.first().copied()).unwrap_or("");
        if arch != "Gemma4DSparkModel" {
            return Err(
                c.error("architectures", format!("= [{arch:?}] is not a DeepSpec DSpark model (Gemma4DSparkModel)"))
            );
        }
        let activation = c.str_or("hidden_activation", "gelu_pytorch_tanh")?;
        if activation != "gelu_pytorch_tanh" {
            return Err(
                c.error("hidden_activation", format!("= {activation:?} is not supported (only gelu_pytorch_tanh)"))
            );
        }
        let markov = c.str_or("markov_head_type", "vanilla")?;
        if markov != "vanilla" {
            return Err(c.error("markov_head_type", format!("= {markov:?} is not supported (only \"vanilla\")")));
        }
        let enable_confidence_head = c.bool_or("enable_confidence_head", true)?;
        if enable_confidence_head && !c.bool_or("confidence_head_with_markov", true)? {
            return Err(c.error("confidence_head_with_markov", "= false is not supported"));
        }
        // The full-attention RoPE, from `rope_parameters.full_attention` or the top level.
        let rope = c.section("rope_parameters", "rope_parameters")?;
        let full = match rope {
            Some(r) => r.section("full_attention", "rope_parameters.full_attention")?,
            None => None,
        };
        let rope_value = |key: &str, default: f64| -> Result<f32, PluginError> {
            let value = match full {
                Some(f) => f.opt_float(key)?,
                None => None,
            };
            Ok(value.map_or_else(|| c.float_or(key, default), Ok)? as f32)
        };
        let either = |a: &str, b: &str| -> Result<i64, PluginError> {
            match c.opt_int(a)? {
                Some(n) if n > 0 => Ok(n),
                Some(n) => Err(c.error(a, format!("= {n} must be positive"))),
                None => c.int(b),
            }
        };
        Ok(DeepspecConfig {
            hidden_size: c.int("hidden_size")? as i32,
            num_hidden_layers: c.int("num_hidden_layers")? as usize,
            num_attention_heads: c.int("num_attention_heads")? as i32,
            num_key_value_heads: either("num_global_key_value_heads", "num_key_value_heads")? as i32,
            head_dim: either("global_head_dim", "head_dim")? as i32,
            intermediate_size: c.int("intermediate_size")? as i32,
            vocab_size: c.int("vocab_size")? as i32,
            rms_norm_eps: c.float_or("rms_norm_eps", 1e-6)? as f32,
            final_logit_softcapping: c.opt_float("final_logit_softcapping")?.map(|v| v as f32),
            rope_theta: rope_value("rope_theta", 1_000_000.0)?,
            partial_rotary_factor: rope_value("partial_rotary_factor", 0.25)?,
            attention_k_eq_v: c.bool_or("attention_k_eq_v", true)?,
            block_size: c.int("block_size")? as usize,
            mask_token_id: c.opt_int("mask_token_id")?.ok_or_else(|| c.error("mask_token_id", "is missing"))? as u32,
            target_layer_ids: c.u32_list("target_layer_ids")?,
            num_target_layers: c.int("num_target_layers")? as u32,
            markov_rank: c.int("markov_rank")? as i32,
            enable_confidence_head,
            quantization: c.quantization()?,
        })
    }
}
