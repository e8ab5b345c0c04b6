//! A `Gemma4DSparkModel` `config.json`: a copied Gemma 4 text config (full attention with K=V
//! and proportional RoPE) plus the block, taps, Markov and confidence heads.

use std::path::Path;

use plugin_api::nn::Quantization;
use plugin_api::PluginError;
use serde_json::{Map, Value};

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
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: {e}", file.display())))?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: not valid JSON: {e}", file.display())))?;
        let bad = |key: &str, why: &str| PluginError::invalid_artifact(format!("{}: `{key}` {why}", file.display()));
        let c: &Map<String, Value> = root.as_object().ok_or_else(|| bad("config", "is not an object"))?;
        let arch = c
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "Gemma4DSparkModel" {
            return Err(bad(
                "architectures",
                &format!("= [{arch:?}] is not a DeepSpec DSpark model (Gemma4DSparkModel)"),
            ));
        }
        let int = |key: &str| -> Result<i64, PluginError> {
            c.get(key).and_then(Value::as_i64).ok_or_else(|| bad(key, "is missing or not an integer"))
        };
        let string = |key: &str, default: &str| c.get(key).and_then(Value::as_str).unwrap_or(default).to_owned();
        let flag = |key: &str, default: bool| c.get(key).and_then(Value::as_bool).unwrap_or(default);
        if !flag("attention_k_eq_v", false) {
            return Err(bad("attention_k_eq_v", "must be true (only K=V attention is implemented)"));
        }
        let activation = string("hidden_activation", "gelu_pytorch_tanh");
        if activation != "gelu_pytorch_tanh" {
            return Err(bad(
                "hidden_activation",
                &format!("= {activation:?} is not supported (only gelu_pytorch_tanh)"),
            ));
        }
        let markov = string("markov_head_type", "vanilla");
        if markov != "vanilla" {
            return Err(bad("markov_head_type", &format!("= {markov:?} is not supported (only \"vanilla\")")));
        }
        if flag("enable_confidence_head", true) && !flag("confidence_head_with_markov", true) {
            return Err(bad("confidence_head_with_markov", "= false is not supported"));
        }
        let rope = c.get("rope_parameters").and_then(|r| r.get("full_attention"));
        let rope_value = |key: &str, default: f64| {
            rope.and_then(|r| r.get(key)).or_else(|| c.get(key)).and_then(Value::as_f64).unwrap_or(default) as f32
        };
        let head_dim = c
            .get("global_head_dim")
            .or_else(|| c.get("head_dim"))
            .and_then(Value::as_i64)
            .ok_or_else(|| bad("global_head_dim", "is missing"))?;
        let kv_heads = c
            .get("num_global_key_value_heads")
            .or_else(|| c.get("num_key_value_heads"))
            .and_then(Value::as_i64)
            .ok_or_else(|| bad("num_global_key_value_heads", "is missing"))?;
        let quantization = match c.get("quantization") {
            None | Some(Value::Null) => None,
            Some(q) => {
                if let Some(mode) = q.get("mode").and_then(Value::as_str) {
                    if mode != "affine" {
                        return Err(bad("quantization.mode", &format!("= {mode:?} is not supported (only affine)")));
                    }
                }
                let bits =
                    q.get("bits").and_then(Value::as_i64).ok_or_else(|| bad("quantization.bits", "is missing"))?;
                Some(Quantization {
                    group_size: q.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32,
                    bits: bits as i32,
                })
            }
        };
        let taps =
            c.get("target_layer_ids").and_then(Value::as_array).ok_or_else(|| bad("target_layer_ids", "is missing"))?;
        Ok(DeepspecConfig {
            hidden_size: int("hidden_size")? as i32,
            num_hidden_layers: int("num_hidden_layers")? as usize,
            num_attention_heads: int("num_attention_heads")? as i32,
            num_key_value_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            intermediate_size: int("intermediate_size")? as i32,
            vocab_size: int("vocab_size")? as i32,
            rms_norm_eps: c.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            final_logit_softcapping: c.get("final_logit_softcapping").and_then(Value::as_f64).map(|v| v as f32),
            rope_theta: rope_value("rope_theta", 1_000_000.0),
            partial_rotary_factor: rope_value("partial_rotary_factor", 0.25),
            block_size: int("block_size")? as usize,
            mask_token_id: int("mask_token_id")? as u32,
            target_layer_ids: taps
                .iter()
                .map(|v| v.as_u64().map(|n| n as u32).ok_or_else(|| bad("target_layer_ids", "must hold integers")))
                .collect::<Result<_, _>>()?,
            num_target_layers: int("num_target_layers")? as u32,
            markov_rank: int("markov_rank")? as i32,
            enable_confidence_head: flag("enable_confidence_head", true),
            quantization,
        })
    }
}
