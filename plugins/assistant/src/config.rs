//! The assistant's `config.json`: a Gemma 4 text config (flat or under `text_config`) plus the
//! backbone's hidden size and the centroid head's sizes.

use std::path::Path;

use plugin_api::PluginError;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    Sliding,
    Full,
}

#[derive(Debug, Clone)]
pub struct AssistantConfig {
    pub hidden_size: i32,
    pub backbone_hidden_size: i32,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub global_head_dim: i32,
    pub intermediate_size: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    pub layer_types: Vec<LayerType>,
    pub sliding_theta: f32,
    pub full_theta: f32,
    pub full_partial_rotary_factor: f32,
    pub num_centroids: i32,
    pub centroid_intermediate_top_k: i32,
    /// Whether the centroid head is meant to be used (transformers' `use_ordered_embeddings`).
    pub use_ordered_embeddings: bool,
}

impl AssistantConfig {
    pub fn load(dir: &Path) -> Result<AssistantConfig, PluginError> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: {e}", file.display())))?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| PluginError::invalid_artifact(format!("{}: not valid JSON: {e}", file.display())))?;
        let bad = |key: &str, why: &str| PluginError::invalid_artifact(format!("{}: `{key}` {why}", file.display()));
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        if !model_type.contains("assistant") {
            return Err(bad("model_type", &format!("= {model_type:?} is not a Gemma 4 assistant (gemma4_assistant)")));
        }
        let text: &Map<String, Value> = match root.get("text_config") {
            Some(Value::Object(t)) => t,
            _ => root.as_object().ok_or_else(|| bad("config", "is not an object"))?,
        };
        let int = |map: &Map<String, Value>, key: &str, default: Option<i64>| -> Result<i32, PluginError> {
            match map.get(key).filter(|v| !v.is_null()) {
                Some(v) => v.as_i64().map(|n| n as i32).ok_or_else(|| bad(key, "must be an integer")),
                None => default.map(|d| d as i32).ok_or_else(|| bad(key, "is missing")),
            }
        };
        let float = |key: &str, default: f64| text.get(key).and_then(Value::as_f64).unwrap_or(default) as f32;
        let num_hidden_layers = int(text, "num_hidden_layers", None)? as usize;
        let layer_types = match text.get("layer_types") {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v.as_str() {
                    Some("sliding_attention") => Ok(LayerType::Sliding),
                    Some("full_attention") => Ok(LayerType::Full),
                    _ => Err(bad("layer_types", &format!("has {v}, expected sliding_attention or full_attention"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err(bad("layer_types", "is missing")),
        };
        if layer_types.len() != num_hidden_layers {
            return Err(bad(
                "layer_types",
                &format!("has {} entries for {num_hidden_layers} layers", layer_types.len()),
            ));
        }
        let rope = text.get("rope_parameters").and_then(Value::as_object);
        let rope_value = |layer: &str, key: &str, default: f64| {
            rope.and_then(|r| r.get(layer)).and_then(|l| l.get(key)).and_then(Value::as_f64).unwrap_or(default) as f32
        };
        let hidden_size = int(text, "hidden_size", None)?;
        let head_dim = int(text, "head_dim", None)?;
        let root_map = root.as_object().ok_or_else(|| bad("config", "is not an object"))?;
        Ok(AssistantConfig {
            hidden_size,
            backbone_hidden_size: int(root_map, "backbone_hidden_size", None)?,
            num_hidden_layers,
            num_attention_heads: int(text, "num_attention_heads", None)?,
            head_dim,
            global_head_dim: int(text, "global_head_dim", Some(head_dim as i64))?,
            intermediate_size: int(text, "intermediate_size", None)?,
            vocab_size: int(text, "vocab_size", None)?,
            rms_norm_eps: float("rms_norm_eps", 1e-6),
            sliding_window: int(text, "sliding_window", None)? as usize,
            layer_types,
            sliding_theta: rope_value("sliding_attention", "rope_theta", 10_000.0),
            full_theta: rope_value("full_attention", "rope_theta", 1_000_000.0),
            full_partial_rotary_factor: rope_value("full_attention", "partial_rotary_factor", 1.0),
            num_centroids: int(root_map, "num_centroids", Some(0))?,
            centroid_intermediate_top_k: int(root_map, "centroid_intermediate_top_k", Some(0))?,
            use_ordered_embeddings: root_map.get("use_ordered_embeddings").and_then(Value::as_bool).unwrap_or(true),
        })
    }

    pub fn layer_head_dim(&self, layer: usize) -> i32 {
        match self.layer_types[layer] {
            LayerType::Sliding => self.head_dim,
            LayerType::Full => self.global_head_dim,
        }
    }
}
