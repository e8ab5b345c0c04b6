//! Gemma 4 `config.json`: flat (`gemma4_text`) or nested under `text_config` (`gemma4`,
//! `gemma4_unified`). The sizes that fix tensor shapes are required: no default could match the
//! weights but by chance. Other missing keys take mlx-lm's defaults, since mlx-lm is the oracle;
//! a value this host does not implement is refused naming its key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plugin_api::nn::Quantization;
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: {reason}")]
    File { file: PathBuf, reason: String },
    #[error("{}: `{key}` = {value} is not supported{why}", located(.file, *.line))]
    Unsupported { file: PathBuf, line: Option<u32>, key: String, value: String, why: String },
    #[error("{}: `{key}`: {reason}", located(.file, *.line))]
    Invalid { file: PathBuf, line: Option<u32>, key: String, reason: String },
}

/// The line of JSON `text` where `"key"` is first written, if it is.
pub(crate) fn json_key_line(text: &str, key: &str) -> Option<usize> {
    text.find(&format!("\"{key}\"")).map(|at| text[..at].matches('\n').count() + 1)
}

/// `file`, or `file:line` where the line is known.
fn located(file: &Path, line: Option<u32>) -> String {
    match line {
        Some(line) => format!("{}:{line}", file.display()),
        None => file.display().to_string(),
    }
}

impl ConfigError {
    /// The error with the line of `text` (the config's) where its key is written, if it is.
    fn at_line_of(mut self, text: &str) -> ConfigError {
        if let ConfigError::Unsupported { key, line, .. } | ConfigError::Invalid { key, line, .. } = &mut self {
            *line = json_key_line(text, key.rsplit('.').next().unwrap_or(key)).map(|l| l as u32);
        }
        self
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    Sliding,
    Full,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Proportional RoPE (full layers of Gemma 4): only this share of the head is rotated.
    pub partial_rotary_factor: Option<f32>,
    pub factor: f32,
}

#[derive(Debug, Clone)]
pub struct Gemma4Config {
    pub file: PathBuf,
    pub model_type: String,
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub global_head_dim: i32,
    pub num_key_value_heads: i32,
    pub num_global_key_value_heads: Option<i32>,
    pub num_kv_shared_layers: usize,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub vocab_size_per_layer_input: i32,
    pub hidden_size_per_layer_input: i32,
    pub sliding_window: usize,
    /// The longest sequence (prompt + output) the model was trained for.
    pub max_position_embeddings: usize,
    pub layer_types: Vec<LayerType>,
    pub sliding_rope: RopeConfig,
    pub full_rope: RopeConfig,
    pub attention_k_eq_v: bool,
    pub final_logit_softcapping: Option<f32>,
    pub use_double_wide_mlp: bool,
    pub enable_moe_block: bool,
    pub num_experts: i32,
    pub top_k_experts: i32,
    pub moe_intermediate_size: i32,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<QuantizationConfig>,
}

/// The `quantization` block mlx-lm writes: a default, and per-module overrides (or `false`).
#[derive(Debug, Clone)]
pub struct QuantizationConfig {
    pub default: Quantization,
    pub per_module: BTreeMap<String, Option<Quantization>>,
}

impl QuantizationConfig {
    /// The quantization of the module at `path` (e.g. `layers.0.router.proj`), when its
    /// weights are quantized at all (a `.scales` tensor exists, as mlx-lm decides).
    pub fn for_module(&self, path: &str) -> Option<Quantization> {
        self.per_module
            .iter()
            .find(|(key, _)| key.as_str() == path || key.ends_with(&format!(".{path}")))
            .map(|(_, q)| *q)
            .unwrap_or(Some(self.default))
    }
}

impl Gemma4Config {
    pub fn load(dir: &Path) -> Result<Gemma4Config, ConfigError> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file).map_err(|e| ConfigError::File {
            file: file.clone(),
            reason: match e.kind() {
                std::io::ErrorKind::NotFound => format!("missing: {} is not a checkpoint directory", dir.display()),
                _ => e.to_string(),
            },
        })?;
        let root: Value = serde_json::from_str(&text)
            .map_err(|e| ConfigError::File { file: file.clone(), reason: format!("not valid JSON: {e}") })?;
        parse(&file, &root).map_err(|e| e.at_line_of(&text))
    }

    /// The special token ids the config names, with the key that names them.
    pub fn special_ids(&self) -> Vec<(&'static str, u32)> {
        self.eos_token_ids.iter().map(|&id| ("eos_token_id", id)).collect()
    }

    pub fn layer_type(&self, layer: usize) -> LayerType {
        self.layer_types[layer]
    }

    /// Layers below this own a KV cache; the rest reuse a donor's.
    pub fn first_kv_shared_layer(&self) -> usize {
        self.num_hidden_layers - self.num_kv_shared_layers
    }

    pub fn layer_head_dim(&self, layer: usize) -> i32 {
        match self.layer_type(layer) {
            LayerType::Full => self.global_head_dim,
            LayerType::Sliding => self.head_dim,
        }
    }

    /// Whether a full-attention layer uses its keys as values (no v_proj).
    pub fn k_eq_v(&self, layer: usize) -> bool {
        self.attention_k_eq_v && self.layer_type(layer) == LayerType::Full
    }

    pub fn layer_kv_heads(&self, layer: usize) -> i32 {
        match (self.k_eq_v(layer), self.num_global_key_value_heads) {
            (true, Some(n)) => n,
            _ => self.num_key_value_heads,
        }
    }
}

const SUPPORTED_MODEL_TYPES: [&str; 4] = ["gemma4_text", "gemma4", "gemma4_unified", "gemma4_unified_text"];

fn parse(file: &Path, root: &Value) -> Result<Gemma4Config, ConfigError> {
    let root = root
        .as_object()
        .ok_or_else(|| ConfigError::File { file: file.to_owned(), reason: "not a JSON object".into() })?;
    let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or("").to_owned();
    if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(ConfigError::Unsupported {
            file: file.to_owned(),
            line: None,
            key: "model_type".into(),
            value: format!("{:?}", model_type),
            why: format!(" (supported: {})", SUPPORTED_MODEL_TYPES.join(", ")),
        });
    }
    let (text, prefix) = match root.get("text_config") {
        Some(Value::Object(t)) => (t, "text_config."),
        _ => (root, ""),
    };
    let c = Reader { file, map: text, prefix };
    let top = Reader { file, map: root, prefix: "" };

    if let Some(act) = text.get("hidden_activation").and_then(Value::as_str) {
        if act != "gelu_pytorch_tanh" {
            return Err(c.unsupported("hidden_activation", act, ""));
        }
    }
    for key in ["attention_bias", "use_bidirectional_attention"] {
        if text.get(key).and_then(Value::as_bool) == Some(true) {
            return Err(c.unsupported(key, "true", ""));
        }
    }

    let num_hidden_layers = c.required_int("num_hidden_layers")? as usize;
    if num_hidden_layers == 0 {
        return Err(c.invalid("num_hidden_layers", "must be positive, found 0"));
    }
    let sliding_window_pattern = c.int("sliding_window_pattern", 5)? as usize;
    let layer_types = match text.get("layer_types") {
        None | Some(Value::Null) => (0..num_hidden_layers)
            .map(|i| if (i + 1) % sliding_window_pattern.max(1) == 0 { LayerType::Full } else { LayerType::Sliding })
            .collect(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v.as_str() {
                Some("sliding_attention") => Ok(LayerType::Sliding),
                Some("full_attention") => Ok(LayerType::Full),
                _ => {
                    Err(c.unsupported("layer_types", &v.to_string(), " (expected sliding_attention or full_attention)"))
                }
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(c.invalid("layer_types", &format!("expected a list, found {other}"))),
    };
    if layer_types.len() != num_hidden_layers {
        return Err(c.invalid("layer_types", &format!("{} entries for {num_hidden_layers} layers", layer_types.len())));
    }

    let (sliding_rope, full_rope) = rope_configs(&c, text)?;
    let quantization = match root.get("quantization").or_else(|| root.get("quantization_config")) {
        None | Some(Value::Null) => None,
        Some(q) => Some(quantization(&top, q)?),
    };
    let num_kv_shared_layers = c.int("num_kv_shared_layers", 20)? as usize;
    if num_kv_shared_layers >= num_hidden_layers {
        return Err(c.invalid(
            "num_kv_shared_layers",
            &format!("{num_kv_shared_layers} of {num_hidden_layers} layers leaves no donor"),
        ));
    }
    let eos_token_ids = token_ids(text.get("eos_token_id").or_else(|| root.get("eos_token_id")));
    let head_dim = c.required_int("head_dim")?;
    let hidden_size_per_layer_input = c.required_int("hidden_size_per_layer_input")?;
    let vocab_size_per_layer_input = match hidden_size_per_layer_input {
        0 => c.int("vocab_size_per_layer_input", 0)?,
        _ => c.required_int("vocab_size_per_layer_input")?,
    };
    let config = Gemma4Config {
        file: file.to_owned(),
        model_type,
        hidden_size: c.required_int("hidden_size")?,
        num_hidden_layers,
        intermediate_size: c.required_int("intermediate_size")?,
        num_attention_heads: c.required_int("num_attention_heads")?,
        head_dim,
        global_head_dim: match text.get("global_head_dim") {
            Some(Value::Null) | None => head_dim,
            Some(_) => c.int("global_head_dim", 512)?,
        },
        num_key_value_heads: c.required_int("num_key_value_heads")?,
        num_global_key_value_heads: c.optional_int("num_global_key_value_heads")?,
        num_kv_shared_layers,
        rms_norm_eps: c.float("rms_norm_eps", 1e-6)?,
        vocab_size: c.required_int("vocab_size")?,
        vocab_size_per_layer_input,
        hidden_size_per_layer_input,
        sliding_window: c.int("sliding_window", 512)? as usize,
        max_position_embeddings: c.int("max_position_embeddings", 131_072)? as usize,
        layer_types,
        sliding_rope,
        full_rope,
        attention_k_eq_v: c.boolean("attention_k_eq_v", false)?,
        final_logit_softcapping: match text.get("final_logit_softcapping") {
            Some(Value::Null) => None,
            None => Some(30.0),
            Some(_) => Some(c.float("final_logit_softcapping", 30.0)?),
        },
        use_double_wide_mlp: c.boolean("use_double_wide_mlp", true)?,
        enable_moe_block: c.boolean("enable_moe_block", false)?,
        num_experts: c.optional_int("num_experts")?.unwrap_or(0),
        top_k_experts: c.optional_int("top_k_experts")?.unwrap_or(0),
        moe_intermediate_size: c.optional_int("moe_intermediate_size")?.unwrap_or(0),
        tie_word_embeddings: c.boolean("tie_word_embeddings", true)?,
        eos_token_ids,
        quantization,
    };
    if config.enable_moe_block
        && (config.num_experts <= 0 || config.top_k_experts <= 0 || config.moe_intermediate_size <= 0)
    {
        return Err(c.invalid("enable_moe_block", "needs num_experts, top_k_experts and moe_intermediate_size"));
    }
    check_domain(&c, &config)?;
    Ok(config)
}

/// Values a checkpoint can parse but no model can have, refused naming the key before any
/// shape is computed from them.
fn check_domain(c: &Reader, config: &Gemma4Config) -> Result<(), ConfigError> {
    let positive = [
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("head_dim", config.head_dim),
        ("global_head_dim", config.global_head_dim),
        ("vocab_size", config.vocab_size),
        ("max_position_embeddings", config.max_position_embeddings.min(i32::MAX as usize) as i32),
    ];
    if let Some((key, _)) = positive.iter().find(|(_, v)| *v <= 0) {
        return Err(c.invalid(key, "must be positive, found 0"));
    }
    if config.layer_types.contains(&LayerType::Sliding) && config.sliding_window == 0 {
        return Err(c.invalid("sliding_window", "must be positive for sliding layers, found 0"));
    }
    if !(config.rms_norm_eps.is_finite() && config.rms_norm_eps > 0.0) {
        return Err(c.invalid("rms_norm_eps", &format!("must be a positive number, found {}", config.rms_norm_eps)));
    }
    if let Some(cap) = config.final_logit_softcapping {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(
                c.invalid("final_logit_softcapping", &format!("must be positive (or null for none), found {cap}"))
            );
        }
    }
    for (heads_key, heads, dim_key, dim) in [
        ("num_attention_heads", config.num_attention_heads, "head_dim", config.head_dim),
        ("num_attention_heads", config.num_attention_heads, "global_head_dim", config.global_head_dim),
        ("num_key_value_heads", config.num_key_value_heads, "head_dim", config.head_dim),
    ] {
        if heads.checked_mul(dim).is_none_or(|n| n.checked_mul(config.hidden_size).is_none()) {
            return Err(c.invalid(
                heads_key,
                &format!(
                    "{heads} heads × {dim_key} {dim} × hidden_size {} is beyond the sizes MLX can index",
                    config.hidden_size
                ),
            ));
        }
    }
    if config.num_attention_heads % config.num_key_value_heads != 0 {
        return Err(c.invalid(
            "num_key_value_heads",
            &format!(
                "{} does not divide num_attention_heads {}",
                config.num_key_value_heads, config.num_attention_heads
            ),
        ));
    }
    Ok(())
}

fn rope_configs(c: &Reader, text: &Map<String, Value>) -> Result<(RopeConfig, RopeConfig), ConfigError> {
    let default_sliding = RopeConfig { theta: 10000.0, partial_rotary_factor: None, factor: 1.0 };
    let default_full = RopeConfig { theta: 1_000_000.0, partial_rotary_factor: Some(0.25), factor: 1.0 };
    let Some(params) = text.get("rope_parameters").and_then(Value::as_object) else {
        return Ok((default_sliding, default_full));
    };
    let one = |layer: &str, fallback: RopeConfig| -> Result<RopeConfig, ConfigError> {
        let Some(p) = params.get(layer).and_then(Value::as_object) else { return Ok(fallback) };
        let key = |k: &str| format!("rope_parameters.{layer}.{k}");
        let rope_type = p.get("rope_type").and_then(Value::as_str).unwrap_or("default");
        let theta = p.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0) as f32;
        let partial = p.get("partial_rotary_factor").and_then(Value::as_f64).unwrap_or(1.0) as f32;
        let factor = p.get("factor").and_then(Value::as_f64).unwrap_or(1.0) as f32;
        match rope_type {
            "default" => {
                if partial != 1.0 {
                    return Err(c.unsupported(
                        &key("partial_rotary_factor"),
                        &partial.to_string(),
                        " with rope_type default",
                    ));
                }
                Ok(RopeConfig { theta, partial_rotary_factor: None, factor: 1.0 })
            }
            "proportional" => Ok(RopeConfig { theta, partial_rotary_factor: Some(partial), factor }),
            other => Err(c.unsupported(&key("rope_type"), other, " (supported: default, proportional)")),
        }
    };
    Ok((one("sliding_attention", default_sliding)?, one("full_attention", default_full)?))
}

fn quantization(top: &Reader, q: &Value) -> Result<QuantizationConfig, ConfigError> {
    let map = q.as_object().ok_or_else(|| top.invalid("quantization", "expected an object"))?;
    if let Some(mode) = map.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(top.unsupported("quantization.mode", mode, " (supported: affine)"));
        }
    }
    let read = |v: &Value, key: &str| -> Result<Quantization, ConfigError> {
        let group_size = v.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
        let bits = v.get("bits").and_then(Value::as_i64).ok_or_else(|| top.invalid(key, "missing `bits`"))? as i32;
        if ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(top.unsupported(&format!("{key}.bits"), &bits.to_string(), ""));
        }
        Ok(Quantization { group_size, bits })
    };
    let default = read(q, "quantization")?;
    let mut per_module = BTreeMap::new();
    for (key, value) in map {
        match value {
            Value::Object(_) => {
                per_module.insert(key.clone(), Some(read(value, &format!("quantization.{key}"))?));
            }
            Value::Bool(false) => {
                per_module.insert(key.clone(), None);
            }
            _ => {}
        }
    }
    Ok(QuantizationConfig { default, per_module })
}

fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items.iter().filter_map(|v| v.as_u64().map(|n| n as u32)).collect(),
        _ => Vec::new(),
    }
}

/// Typed access to one JSON object, with errors naming the full key.
struct Reader<'a> {
    file: &'a Path,
    map: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Reader<'_> {
    fn unsupported(&self, key: &str, value: &str, why: &str) -> ConfigError {
        ConfigError::Unsupported {
            file: self.file.to_owned(),
            line: None,
            key: format!("{}{key}", self.prefix),
            value: value.to_owned(),
            why: why.to_owned(),
        }
    }
    fn invalid(&self, key: &str, reason: &str) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_owned(),
            line: None,
            key: format!("{}{key}", self.prefix),
            reason: reason.to_owned(),
        }
    }
    fn required_int(&self, key: &str) -> Result<i32, ConfigError> {
        self.optional_int(key)?.ok_or_else(|| self.invalid(key, "is required (it fixes tensor shapes) and missing"))
    }
    fn int(&self, key: &str, default: i64) -> Result<i32, ConfigError> {
        Ok(self.optional_int(key)?.unwrap_or(default as i32))
    }
    fn optional_int(&self, key: &str) -> Result<Option<i32>, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)) {
                Some(n) if (0..=i32::MAX as i64).contains(&n) => Ok(Some(n as i32)),
                Some(n) if n > 0 => Err(self.invalid(key, &format!("{v} is too large (at most {})", i32::MAX))),
                _ => Err(self.invalid(key, &format!("expected a non-negative integer, found {v}"))),
            },
        }
    }
    fn float(&self, key: &str, default: f64) -> Result<f32, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default as f32),
            Some(v) => {
                v.as_f64().map(|f| f as f32).ok_or_else(|| self.invalid(key, &format!("expected a number, found {v}")))
            }
        }
    }
    fn boolean(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.invalid(key, &format!("expected true or false, found {v}"))),
        }
    }
}
