//! A z-lab DFlash `config.json`: a small Qwen3-style decoder plus `block_size` and
//! `dflash_config` (which target layers it taps, the mask token).

use std::path::Path;

use plugin_api::config::ConfigFile;
use plugin_api::PluginError;

#[derive(Debug, Clone)]
pub struct DflashConfig {
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Per layer, its sliding window (`None` for full attention).
    pub windows: Vec<Option<usize>>,
    pub block_size: usize,
    pub num_target_layers: u32,
    pub target_layer_ids: Vec<u32>,
    pub mask_token_id: u32,
    pub final_logit_softcapping: Option<f32>,
}

impl DflashConfig {
    pub fn load(dir: &Path) -> Result<DflashConfig, PluginError> {
        let file = ConfigFile::load(&dir.join("config.json"))?;
        let c = file.root()?;
        let d = c.section("dflash_config", "dflash_config")?.ok_or_else(|| c.error("dflash_config", "is missing"))?;
        if c.opt_strings("architectures")?.is_some_and(|a| a.contains(&"DFlash2DraftModel")) {
            return Err(c.error("architectures", "= DFlash2DraftModel (DFlash 2) is not supported"));
        }
        for (key, default) in [("input_embedding_scale", 1.0), ("output_multiplier", 1.0)] {
            let value = d.float_or(key, default)?;
            if value != default {
                return Err(d.error(key, format!("= {value} is not supported (only {default})")));
            }
        }
        if c.bool_or("is_causal", false)? {
            return Err(c.error("is_causal", "= true is not supported"));
        }
        let act = c.str_or("hidden_act", "silu")?;
        if act != "silu" {
            return Err(c.error("hidden_act", format!("= {act} is not supported (only silu)")));
        }
        let num_hidden_layers = c.int("num_hidden_layers")? as usize;
        let windows = match c.sliding_layers(num_hidden_layers)? {
            None => vec![None; num_hidden_layers],
            Some(kinds) if kinds.iter().any(|&s| s) => {
                let window = c.int("sliding_window")? as usize;
                kinds.into_iter().map(|sliding| sliding.then_some(window)).collect()
            }
            Some(kinds) => vec![None; kinds.len()],
        };
        let rope_theta = match c.opt_float("rope_theta")? {
            Some(theta) => theta,
            None => match c.section("rope_parameters", "rope_parameters")? {
                Some(r) => r.float_or("rope_theta", 10_000.0)?,
                None => 10_000.0,
            },
        } as f32;
        let block_size = match d.opt_int("block_size")? {
            Some(n) => n,
            None => c.opt_int("block_size")?.unwrap_or(16),
        };
        if block_size < 2 {
            return Err(d.error("block_size", "must be at least 2"));
        }
        let softcap = match d.opt_float("final_logit_softcapping")? {
            Some(cap) => Some(cap),
            None => c.opt_float("final_logit_softcapping")?,
        };
        Ok(DflashConfig {
            hidden_size: c.int("hidden_size")? as i32,
            num_hidden_layers,
            num_attention_heads: c.int("num_attention_heads")? as i32,
            num_key_value_heads: c.int("num_key_value_heads")? as i32,
            head_dim: c.int("head_dim")? as i32,
            intermediate_size: c.int("intermediate_size")? as i32,
            rms_norm_eps: c.float_or("rms_norm_eps", 1e-6)? as f32,
            rope_theta,
            windows,
            block_size: block_size as usize,
            num_target_layers: c.int("num_target_layers")? as u32,
            target_layer_ids: d.u32_list("target_layer_ids")?,
            mask_token_id: d.opt_int("mask_token_id")?.ok_or_else(|| d.error("mask_token_id", "is missing"))? as u32,
            final_logit_softcapping: softcap.map(|s| s as f32),
        })
    }
}
