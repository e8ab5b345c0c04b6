//! DeepSeek's DSpark drafters (`Gemma4DSparkModel`): each row keeps the projected context of
//! every committed position as per-layer keys and values; a draft is one non-causal pass of
//! the block [anchor, mask, …], the Markov head chained on the drafted tokens, and, when a
//! `confidence_threshold` is set, a cut at the first position less confident than it (which
//! may leave nothing to propose).

mod config;
mod model;

use std::path::Path;
use std::rc::Rc;

use plugin_api::mlx_rs::Array;
use plugin_api::sdk::{
    draw, ContextDrafter, ContextRow, DraftProvider, Drafter, Options, Proposal, SourceRows, Target, TreeProposal,
};
use plugin_api::{Capabilities, Descriptor, PluginError, Ports, ProviderInfo};

pub use model::{Context, Deepspec};

pub struct DeepspecDrafter;

const NAMESPACE: &str = "deepspec-context/1";

fn ports() -> Ports {
    Ports::TAPS
}

impl Drafter for DeepspecDrafter {
    type Provider = DeepspecProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("deepspec", "DeepSpec DSpark", env!("CARGO_PKG_VERSION"))
            .summary(
                "DeepSeek's DSpark drafters (Gemma4DSparkModel): block drafting with a Markov head and confidences",
            )
            .needs_artifact()
            .capabilities(Capabilities { ports: ports(), draft_probabilities: true, ..Capabilities::default() })
            .option(
                "confidence_threshold",
                "0.0",
                "stop a draft at the first position less confident than this (0: off)",
            )
            .option(
                "sample_drafts",
                "false",
                "draw drafts from the Markov-corrected distribution and return it, for verify = \"rejection\"",
            )
            .option(
                "draft_temperature",
                "1.0",
                "with sample_drafts: the temperature drafts are drawn at (set it to the requests'; acceptance falls when they differ)",
            )
    }

    fn load(artifact: Option<&Path>, options: &Options) -> Result<DeepspecProvider, PluginError> {
        let dir = artifact.ok_or_else(|| PluginError::invalid_artifact("deepspec needs an artifact directory"))?;
        let model = Deepspec::load(dir)?;
        let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(DeepspecProvider {
            model: Rc::new(model),
            id,
            threshold: options.value("confidence_threshold")?,
            sample: options.value("sample_drafts")?,
            temperature: options.positive("draft_temperature")?,
        })
    }
}

pub struct DeepspecProvider {
    model: Rc<Deepspec>,
    id: String,
    threshold: f32,
    sample: bool,
    temperature: f32,
}

impl DraftProvider for DeepspecProvider {
    type Rows = SourceRows<ContextRow<Shared>>;

    fn info(&self) -> ProviderInfo {
        let c = &self.model.config;
        ProviderInfo {
            id: self.id.as_str().into(),
            weights_bytes: self.model.weight_bytes as u64,
            namespace: NAMESPACE.into(),
            trained_depth: c.block_size as u32,
            capabilities: Capabilities {
                ports: ports(),
                tap_layers: c.target_layer_ids.clone().into(),
                max_draft_tokens: c.block_size as u32,
                draft_probabilities: true,
                ..Capabilities::default()
            },
        }
    }

    fn open(&self, target: Target, rows: usize) -> Result<SourceRows<ContextRow<Shared>>, PluginError> {
        let info = target.info();
        let c = &self.model.config;
        let refuse = |what: &str, ours: u32, theirs: u32| {
            Err(PluginError::incompatible_target(format!("the drafter's {what} is {ours}, the target's is {theirs}")))
        };
        if info.num_layers != c.num_target_layers {
            return refuse("num_target_layers", c.num_target_layers, info.num_layers);
        }
        if info.hidden_size as i32 != c.hidden_size {
            return refuse("hidden_size", c.hidden_size as u32, info.hidden_size);
        }
        if info.vocab_size as i32 != c.vocab_size {
            return refuse("vocab_size", c.vocab_size as u32, info.vocab_size);
        }
        // DeepSpec taps decoder layer outputs only, never the final norm.
        if let Some(&bad) = c.target_layer_ids.iter().find(|&&l| l >= info.num_layers) {
            return Err(PluginError::incompatible_target(format!(
                "target_layer_ids has {bad}, the target's layers are 0..{}",
                info.num_layers
            )));
        }
        let shared = Shared {
            model: self.model.clone(),
            threshold: self.threshold,
            sample: self.sample,
            temperature: self.temperature,
        };
        Ok(SourceRows::new(shared, ContextRow::default(), rows, NAMESPACE))
    }
}

/// What the rows of a group share.
pub struct Shared {
    model: Rc<Deepspec>,
    threshold: f32,
    sample: bool,
    temperature: f32,
}

impl ContextDrafter for Shared {
    fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), PluginError> {
        Ok(self.model.extend(context, taps)?)
    }

    fn draft(&self, context: &mut Context, anchor: u32, depth: usize, step: u64) -> Result<Proposal, PluginError> {
        let draw = |k: usize, q: &[f32]| draw(q, uniform(step + k as u64));
        let sampler: Option<plugin_api::sdk::Draw<'_>> = if self.sample { Some(&draw) } else { None };
        let block = self.model.block(context, anchor, depth, self.threshold, sampler, self.temperature)?;
        let probabilities = (self.sample && !block.tokens.is_empty()).then(|| {
            let rows = block.tokens.len() as i32;
            Array::from_slice(&block.probabilities, &[rows, block.probabilities.len() as i32 / rows])
        });
        Ok(Proposal { tokens: block.tokens, probabilities })
    }

    /// Greedy drafts branch where the Markov head ranks several tokens high ([`Deepspec::tree`]);
    /// sampled ones draft chains.
    fn draft_tree_rows(
        &self,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
        nodes: usize,
        _steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        if self.sample {
            return Ok(None);
        }
        let trees = contexts.iter_mut().zip(pending).map(|(context, &anchor)| {
            Ok(TreeProposal { tree: self.model.tree(context, anchor, depth, nodes)?, probabilities: None })
        });
        trees.collect::<Result<Vec<_>, PluginError>>().map(Some)
    }
}

/// The uniform for the draft of output step `step`.
fn uniform(step: u64) -> f64 {
    plugin_api::random::uniform(0xDEE5_9EC0, step)
}

plugin_api::export_drafter!(DeepspecDrafter);

#[cfg(test)]
mod conformance {
    use std::path::Path;

    use plugin_api::conformance::{check, Config};

    fn config(options: &str) -> Config {
        Config {
            artifact: Some(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec/gemma4-dense/drafter"),
            ),
            options: options.into(),
            vocab_size: 512,
            hidden_size: 64,
            num_layers: 6,
            depth: 4,
            ..Config::default()
        }
    }

    #[test]
    fn passes_the_conformance_kit() {
        for options in ["", "confidence_threshold = 0.5", "sample_drafts = true"] {
            let report = check::<super::DeepspecDrafter>(&config(options));
            report.assert_passed();
            assert!(report.drafted > 0, "{options}");
            // Greedy drafts branch into trees; sampled ones stay chains.
            assert_eq!(report.tree_nodes > 0, !options.starts_with("sample"), "{options}: {} nodes", report.tree_nodes);
        }
    }

    /// The fixture's network with its context at each of dspark-mlx's recorded states: `check`
    /// gets the state, the network, the context, the anchor token and the state's oracle arrays.
    fn at_oracle_states(
        mut check: impl FnMut(usize, &crate::Deepspec, &mut crate::Context, u32, &dyn Fn(&str) -> plugin_api::mlx_rs::Array),
    ) {
        use plugin_api::mlx_rs::Dtype;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec/gemma4-dense");
        let model = crate::Deepspec::load(&dir.join("drafter")).unwrap();
        let oracle = plugin_api::nn::Weights::load_file(&dir.join("oracle.safetensors")).unwrap();
        for state in [0, 5, 20] {
            let get = |name: &str| oracle.get(&format!("state{state}.{name}")).unwrap();
            let taps = get("target_taps");
            let taps = taps.reshape(&[1, taps.shape()[0], taps.shape()[1]]).unwrap();
            let mut context = crate::Context::default();
            model.extend(&mut context, &taps).unwrap();
            let ids = get("input_ids").as_dtype(Dtype::Int32).unwrap();
            let anchor = *ids.as_slice::<i32>().last().unwrap() as u32;
            check(state, &model, &mut context, anchor, &get);
        }
    }

    /// A tree's branch of first children is the greedy block: each node's likeliest child joins
    /// before its siblings, and the Markov head ranks it as the chain does.
    #[test]
    fn a_trees_first_children_are_the_greedy_block() {
        use plugin_api::draft_tree::ROOT;
        at_oracle_states(|state, model, context, anchor, _| {
            let chain = model.block(context, anchor, 4, 0.0, None, 1.0).unwrap().tokens;
            let tree = model.tree(context, anchor, 4, 12).unwrap();
            tree.check(4, 12, 512).unwrap();
            assert!(tree.len() > 4, "state {state}: no branches in {tree:?}");
            let mut first_children = Vec::new();
            let mut at = ROOT;
            while let Some(child) = tree.parents.iter().position(|&p| p == at) {
                first_children.push(tree.tokens[child]);
                at = child as u32;
            }
            assert_eq!(first_children, chain, "state {state}");
        });
    }

    /// Fed dspark-mlx's own tapped hidden states, the network gives its tokens and confidences.
    #[test]
    fn block_tokens_and_confidences_equal_dspark_mlx() {
        use plugin_api::mlx_rs::Dtype;
        at_oracle_states(|state, model, context, anchor, get| {
            let block = model.block(context, anchor, usize::MAX, 0.0, None, 1.0).unwrap();
            let expected_tokens: Vec<u32> = get("draft_tokens")
                .as_dtype(Dtype::Int32)
                .unwrap()
                .as_slice::<i32>()
                .iter()
                .map(|&t| t as u32)
                .collect();
            assert_eq!(block.tokens, expected_tokens, "state {state}");
            let expected = get("confidences").as_dtype(Dtype::Float32).unwrap();
            for (got, want) in block.confidences.iter().zip(expected.as_slice::<f32>()) {
                assert!((got - want).abs() < 1e-4, "state {state}: confidence {got} vs {want}");
            }
            assert_eq!(block.confidences.len(), expected.size());
        });
    }

    /// An 8-bit MLX-quantized sibling (written here as mlx-lm writes them: packed weights with
    /// scales and biases, a `quantization` block) loads and computes the float model's function
    /// up to quantization error: first-position logits within 0.5, about twice the 0.23 these
    /// random weights differ by (their top-2 margins are smaller, so the argmax may differ), and
    /// the first confidence within 0.02.
    #[test]
    fn an_mlx_quantized_sibling_computes_what_the_float_model_does() {
        use plugin_api::mlx_rs::{Array, Dtype};
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec/gemma4-dense");
        let float = plugin_api::nn::Weights::load_dir(&dir.join("drafter")).unwrap();
        let mut tensors: Vec<(String, Array)> = Vec::new();
        for name in float.names() {
            let a = float.get(name).unwrap();
            let quantizable =
                name.ends_with(".weight") && a.ndim() == 2 && a.shape()[1] % 32 == 0 && !name.contains("norm");
            if quantizable {
                let (wq, scales, biases) = plugin_api::mlx_rs::ops::quantize(&a, 32, 8).unwrap();
                let base = name.trim_end_matches(".weight");
                tensors.push((name.to_owned(), wq));
                tensors.push((format!("{base}.scales"), scales));
                tensors.push((format!("{base}.biases"), biases));
            } else {
                tensors.push((name.to_owned(), a));
            }
        }
        let quantized = tempfile_dir();
        Array::save_safetensors(
            tensors.iter().map(|(n, a)| (n.as_str(), a)),
            None,
            quantized.join("model.safetensors"),
        )
        .unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("drafter/config.json")).unwrap()).unwrap();
        config["quantization"] = serde_json::json!({"group_size": 32, "bits": 8});
        std::fs::write(quantized.join("config.json"), config.to_string()).unwrap();

        let exact = crate::Deepspec::load(&dir.join("drafter")).unwrap();
        let packed = crate::Deepspec::load(&quantized).unwrap();
        assert!(
            packed.lm_head.quantization.is_some() && packed.confidence_head.as_ref().unwrap().quantization.is_none()
        );
        let oracle = plugin_api::nn::Weights::load_file(&dir.join("oracle.safetensors")).unwrap();
        for state in [0, 5, 20] {
            let taps = oracle.get(&format!("state{state}.target_taps")).unwrap();
            let taps = taps.reshape(&[1, taps.shape()[0], taps.shape()[1]]).unwrap();
            let ids = oracle.get(&format!("state{state}.input_ids")).unwrap().as_dtype(Dtype::Int32).unwrap();
            let anchor = *ids.as_slice::<i32>().last().unwrap() as u32;
            let draft = |model: &crate::Deepspec| {
                let mut context = crate::Context::default();
                model.extend(&mut context, &taps).unwrap();
                model.block(&mut context, anchor, usize::MAX, 0.0, None, 1.0).unwrap()
            };
            let (p, e) = (draft(&packed), draft(&exact));
            let row0 = |l: &Array| l.take_axis(Array::from_int(0), 0).unwrap();
            let d = row0(&p.logits)
                .subtract(row0(&e.logits))
                .unwrap()
                .abs()
                .unwrap()
                .max(None)
                .unwrap()
                .item_exact::<f32>();
            assert!(d < 0.5, "state {state}: first-position logits differ by {d}");
            assert!((p.confidences[0] - e.confidences[0]).abs() < 0.02, "state {state}");
        }
        std::fs::remove_dir_all(&quantized).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("deepspec-quantized-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn refuses_targets_it_does_not_fit_naming_both_values() {
        for (config, expected) in [
            (Config { num_layers: 8, ..config("") }, "num_target_layers is 6, the target's is 8"),
            (Config { hidden_size: 48, ..config("") }, "hidden_size is 64, the target's is 48"),
        ] {
            let report = check::<super::DeepspecDrafter>(&config);
            let why = report.failures()[0].1.as_ref().unwrap_err().clone();
            assert!(why.contains(expected), "{why}");
        }
    }

    #[test]
    fn refuses_variants_it_does_not_implement_by_name() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepspec/gemma4-dense/drafter");
        let config_text = std::fs::read_to_string(src.join("config.json")).unwrap();
        for (edit, expected) in [
            (
                ("\"markov_head_type\": \"vanilla\"", "\"markov_head_type\": \"gated\""),
                "`markov_head_type` = \"gated\" is not supported",
            ),
            (
                ("\"confidence_head_with_markov\": true", "\"confidence_head_with_markov\": false"),
                "`confidence_head_with_markov` = false is not supported",
            ),
            (
                ("\"hidden_activation\": \"gelu_pytorch_tanh\"", "\"hidden_activation\": \"silu\""),
                "`hidden_activation` = \"silu\" is not supported",
            ),
        ] {
            assert!(config_text.contains(edit.0), "fixture lacks {}", edit.0);
            let dir = std::env::temp_dir().join(format!("deepspec-variant-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("config.json"), config_text.replace(edit.0, edit.1)).unwrap();
            let error = crate::config::DeepspecConfig::load(&dir).unwrap_err().to_string();
            assert!(error.contains(expected), "{error}");
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// A drafter trained for the demo target (models/<name>).
    fn demo(name: &str) -> Config {
        Config::demo_target(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name))
    }

    #[test]
    fn the_trained_demo_drafter_passes_the_conformance_kit() {
        let report = check::<super::DeepspecDrafter>(&demo("kjv-gemma4-deepspec"));
        report.assert_passed();
        assert!(report.drafted > 0, "nothing drafted");
    }
}
