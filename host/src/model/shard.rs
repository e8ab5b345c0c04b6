//! How a tensor-parallel target divides its weights among ranks (Megatron-style):
//!
//! - q/k/v and gate/up are split by output rows, so each rank holds whole heads, whole KV heads
//!   and a slice of the intermediate width;
//! - o and down are split by input columns, and their partial outputs are summed over ranks;
//! - routed experts are divided among ranks, each rank computing its own experts' share;
//! - the embedding table and the head are split by vocabulary: each rank embeds the ids in its
//!   slice (the ranks' rows summed) and scores its slice of the logits (gathered whole on every
//!   rank, so that sampling and verification stay identical on all of them);
//! - everything else (norms, router, per-layer inputs) is replicated.
//!
//! The head is split rather than replicated: a replicated head makes every rank read the whole
//! table for every token, which on a large vocabulary costs more than gathering the logits (see
//! docs/parallelism.md).

use plugin_api::nn::Split;

use super::config::{Gemma4Config, LayerType};
use super::error::ModelError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub ranks: usize,
}

impl Shard {
    /// Refuses a configuration whose heads, KV heads, widths, experts or quantization groups do
    /// not divide among the ranks, naming the numbers.
    pub fn check(&self, c: &Gemma4Config) -> Result<(), ModelError> {
        let n = self.ranks as i32;
        let refuse = |what: String, value: i32| {
            Err(ModelError::Shard(format!("{}: {what} = {value} does not divide among {n} ranks", c.file.display())))
        };
        if c.num_attention_heads % n != 0 {
            return refuse("num_attention_heads".into(), c.num_attention_heads);
        }
        for layer in 0..c.num_hidden_layers {
            let kv = c.layer_kv_heads(layer);
            if kv % n != 0 {
                let key = match (c.layer_type(layer), c.num_global_key_value_heads) {
                    (LayerType::Full, Some(_)) => "num_global_key_value_heads",
                    _ => "num_key_value_heads",
                };
                return refuse(format!("{key} (layer {layer})"), kv);
            }
        }
        if c.vocab_size % n != 0 {
            return refuse("vocab_size".into(), c.vocab_size);
        }
        if c.intermediate_size % n != 0 {
            return refuse("intermediate_size".into(), c.intermediate_size);
        }
        if c.enable_moe_block && c.num_experts % n != 0 {
            return refuse("num_experts".into(), c.num_experts);
        }
        if let Some(q) = &c.quantization {
            // o_proj and down_proj are split along their quantized input: by whole groups only.
            let group = q.default.group_size;
            for (what, width) in [
                ("num_attention_heads × head_dim", c.num_attention_heads * c.head_dim),
                ("num_attention_heads × global_head_dim", c.num_attention_heads * c.global_head_dim),
                ("intermediate_size", c.intermediate_size),
            ] {
                if (width / n) % group != 0 {
                    return Err(ModelError::Shard(format!(
                        "{}: {what} = {width} splits into {} columns per rank over {n} ranks, not whole \
                         quantization groups of {group}",
                        c.file.display(),
                        width / n
                    )));
                }
            }
        }
        Ok(())
    }

    /// This rank's part of the checkpoint tensor `name` (any of the prefixes checkpoints use),
    /// `None` for a replicated one.
    pub fn split(&self, name: &str) -> Option<Split> {
        let module = ["weight", "scales", "biases"]
            .iter()
            .find_map(|suffix| name.strip_suffix(&format!(".{suffix}")))
            .unwrap_or(name);
        let by_rows = [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "embed_tokens",
            "lm_head",
        ];
        let by_columns = ["self_attn.o_proj", "mlp.down_proj"];
        let axis = if module.contains(".experts.") {
            // Stacked [experts, out, in] (mlx-lm), or Hugging Face's fused gate_up and down.
            0
        } else if by_rows.iter().any(|m| module.ends_with(m)) {
            0
        } else if by_columns.iter().any(|m| module.ends_with(m)) {
            1
        } else {
            return None;
        };
        Some(Split { axis, part: self.rank, parts: self.ranks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projections_split_by_rows_or_columns_and_the_rest_is_replicated() {
        let s = Shard { rank: 1, ranks: 2 };
        let part = |axis| Some(Split { axis, part: 1, parts: 2 });
        assert_eq!(s.split("model.layers.3.self_attn.q_proj.weight"), part(0));
        assert_eq!(s.split("model.language_model.layers.0.mlp.up_proj.scales"), part(0));
        assert_eq!(s.split("layers.0.self_attn.o_proj.biases"), part(1));
        assert_eq!(s.split("layers.2.mlp.down_proj.weight"), part(1));
        assert_eq!(s.split("layers.2.experts.switch_glu.down_proj.weight"), part(0));
        assert_eq!(s.split("model.layers.2.experts.gate_up_proj"), part(0));
        assert_eq!(s.split("model.embed_tokens.weight"), part(0));
        assert_eq!(s.split("language_model.lm_head.weight"), part(0));
        for replicated in [
            "model.embed_tokens_per_layer.weight",
            "layers.0.self_attn.q_norm.weight",
            "layers.2.router.proj.weight",
            "layers.1.per_layer_projection.weight",
        ] {
            assert_eq!(s.split(replicated), None, "{replicated}");
        }
    }
}
