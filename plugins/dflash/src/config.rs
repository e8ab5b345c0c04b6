//! A z-lab DFlash `config.json`: a small Qwen3-style decoder plus `block_size` and
//! `dflash_config` (which target layers it taps, the mask token).

use std::path::Path;

use plugin_api::PluginError;
use serde_json::{Map, Value};

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
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: {e}", file.display())))?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: not valid JSON: {e}", file.display())))?;
        let bad = |key: &str, why: &str| PluginError::invalid_artifact(format!("{}: `{key}` {why}", file.display()));
        let c = root.as_object().ok_or_else(|| bad("config", "is not an object"))?;
        let d = c.get("dflash_config").and_then(Value::as_object).ok_or_else(|| bad("dflash_config", "is missing"))?;
        if c.get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|v| v.as_str() == Some("DFlash2DraftModel")))
        {
            return Err(bad("architectures", "= DFlash2DraftModel (DFlash 2) is not supported"));
        }
        let int = |map: &Map<String, Value>, key: &str| -> Result<i64, PluginError> {
            map.get(key).and_then(Value::as_i64).ok_or_else(|| bad(key, "is missing or not an integer"))
        };
        for (key, default) in [("input_embedding_scale", 1.0), ("output_multiplier", 1.0)] {
            let value = d.get(key).and_then(Value::as_f64).unwrap_or(default);
            if value != default {
                return Err(bad(
                    &format!("dflash_config.{key}"),
                    &format!("= {value} is not supported (only {default})"),
                ));
            }
        }
        if c.get("is_causal").and_then(Value::as_bool) == Some(true) {
            return Err(bad("is_causal", "= true is not supported"));
        }
        if let Some(act) = c.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad("hidden_act", &format!("= {act} is not supported (only silu)")));
            }
        }
        let num_hidden_layers = int(c, "num_hidden_layers")? as usize;
        let sliding_window = c.get("sliding_window").and_then(Value::as_i64);
        let windows = match c.get("layer_types").and_then(Value::as_array) {
            None => vec![None; num_hidden_layers],
            Some(types) => types
                .iter()
                .map(|t| match (t.as_str(), sliding_window) {
                    (Some("full_attention"), _) => Ok(None),
                    (Some("sliding_attention"), Some(w)) => Ok(Some(w as usize)),
                    (Some("sliding_attention"), None) => Err(bad("sliding_window", "is missing for sliding layers")),
                    _ => Err(bad("layer_types", &format!("has {t}, expected sliding_attention or full_attention"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        if windows.len() != num_hidden_layers {
            return Err(bad("layer_types", &format!("has {} entries for {num_hidden_layers} layers", windows.len())));
        }
        let rope_theta = c
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or_else(|| c.get("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64))
            .unwrap_or(10_000.0) as f32;
        let taps = d
            .get("target_layer_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("dflash_config.target_layer_ids", "is missing"))?;
        let target_layer_ids = taps
            .iter()
            .map(|v| {
                v.as_u64().map(|n| n as u32).ok_or_else(|| bad("dflash_config.target_layer_ids", "must hold integers"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let block_size =
            d.get("block_size").or_else(|| c.get("block_size")).and_then(Value::as_u64).unwrap_or(16) as usize;
        if block_size < 2 {
            return Err(bad("block_size", "must be at least 2"));
        }
        let softcap =
            d.get("final_logit_softcapping").or_else(|| c.get("final_logit_softcapping")).and_then(Value::as_f64);
        Ok(DflashConfig {
            hidden_size: int(c, "hidden_size")? as i32,
            num_hidden_layers,
            num_attention_heads: int(c, "num_attention_heads")? as i32,
            num_key_value_heads: int(c, "num_key_value_heads")? as i32,
            head_dim: int(c, "head_dim")? as i32,
            intermediate_size: int(c, "intermediate_size")? as i32,
            rms_norm_eps: c.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta,
            windows,
            block_size,
            num_target_layers: int(c, "num_target_layers")? as u32,
            target_layer_ids,
            mask_token_id: int(d, "mask_token_id")? as u32,
            final_logit_softcapping: softcap.map(|s| s as f32),
        })
    }
}
