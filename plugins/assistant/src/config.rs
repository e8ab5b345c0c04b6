//! The assistant's `config.json`: a Gemma 4 text config (flat or under `text_config`) plus the
//! backbone's hidden size and the centroid head's sizes.

use std::path::Path;

use plugin_api::config::ConfigFile;
use plugin_api::PluginError;

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
        let file = ConfigFile::load(&dir.join("config.json"))?;
        let root = file.root()?;
        let model_type = root.str_or("model_type", "")?;
        if !model_type.contains("assistant") {
            return Err(
                root.error("model_type", format!("= {model_type:?} is not a Gemma 4 assistant (gemma4_assistant)"))
            );
        }
        // The text model's keys: under `text_config`, or flat.
        let text = root.section("text_config", "text_config")?.unwrap_or(root);
        let num_hidden_layers = text.int("num_hidden_layers")? as usize;
        let layer_types = text
            .sliding_layers(num_hidden_layers)?
            .ok_or_else(|| text.error("layer_types", "is missing"))?
            .into_iter()
            .map(|sliding| if sliding { LayerType::Sliding } else { LayerType::Full })
            .collect();
        let rope = text.section("rope_parameters", "rope_parameters")?;
        let rope_value = |layer: &str, key: &str, default: f64| -> Result<f32, PluginError> {
            let path = if layer == "full_attention" {
                "rope_parameters.full_attention"
            } else {
                "rope_parameters.sliding_attention"
            };
            let section = match rope {
                Some(r) => r.section(layer, path)?,
                None => None,
            };
            Ok(section.map_or(Ok(default), |s| s.float_or(key, default))? as f32)
        };
        let head_dim = text.int("head_dim")? as i32;
        Ok(AssistantConfig {
            hidden_size: text.int("hidden_size")? as i32,
            backbone_hidden_size: root.int("backbone_hidden_size")? as i32,
            num_hidden_layers,
            num_attention_heads: text.int("num_attention_heads")? as i32,
            head_dim,
            global_head_dim: text.opt_int("global_head_dim")?.map_or(head_dim, |d| d as i32),
            intermediate_size: text.int("intermediate_size")? as i32,
            vocab_size: text.int("vocab_size")? as i32,
            rms_norm_eps: text.float_or("rms_norm_eps", 1e-6)? as f32,
            sliding_window: text.int("sliding_window")? as usize,
            layer_types,
            sliding_theta: rope_value("sliding_attention", "rope_theta", 10_000.0)?,
            full_theta: rope_value("full_attention", "rope_theta", 1_000_000.0)?,
            full_partial_rotary_factor: rope_value("full_attention", "partial_rotary_factor", 1.0)?,
            num_centroids: root.opt_int("num_centroids")?.unwrap_or(0) as i32,
            centroid_intermediate_top_k: root.opt_int("centroid_intermediate_top_k")?.unwrap_or(0) as i32,
            use_ordered_embeddings: root.bool_or("use_ordered_embeddings", true)?,
        })
    }

    pub fn layer_head_dim(&self, layer: usize) -> i32 {
        match self.layer_types[layer] {
            LayerType::Sliding => self.head_dim,
            LayerType::Full => self.global_head_dim,
        }
    }
}
