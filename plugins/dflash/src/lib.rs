//! DFlash: a block drafter over tapped target hidden states (z-lab DFlash checkpoints). Each
//! row keeps the projected context of every committed position as per-layer keys and values;
//! a draft is one pass of the block [pending, mask × depth] over that context, read through
//! the target's head. Committing appends the kept rows only, so a rejection drops nothing.

mod config;
mod dspark;
mod model;

use std::path::Path;
use std::rc::Rc;

use plugin_api::draft_tree::{likeliest_paths, most_probable};
use plugin_api::mlx_rs::Array;
use plugin_api::nn::kernels::with_floats;
use plugin_api::nn::ops::tempered_softmax_rows;
use plugin_api::sdk::{
    draw, ContextDrafter, ContextRow, DraftProvider, Drafter, Options, Proposal, SourceRows, Target, TreeProposal,
};
use plugin_api::{Capabilities, Descriptor, PluginError, Ports, ProviderInfo};

pub use dspark::Dspark;
pub use model::{Context, Dflash};

/// The two checkpoint formats this plugin drafts with.
#[allow(clippy::large_enum_variant, reason = "one per loaded drafter")]
pub enum Network {
    /// z-lab DFlash (`config.json` with `dflash_config`).
    Zlab(Dflash),
    /// The seeds' DSpark (`dspark.json`, variant "dspark" or legacy "dflash").
    Dspark(Dspark),
}

impl Network {
    fn tap_layers(&self) -> Vec<u32> {
        match self {
            Network::Zlab(m) => m.config.target_layer_ids.clone(),
            Network::Dspark(m) => m.config.tap_layers.clone(),
        }
    }

    fn max_draft_tokens(&self) -> usize {
        match self {
            Network::Zlab(m) => m.config.block_size - 1,
            Network::Dspark(m) => m.config.gamma,
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Network::Zlab(m) => m.weight_bytes,
            Network::Dspark(m) => m.weight_bytes,
        }
    }

    fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), PluginError> {
        match self {
            Network::Zlab(m) => m.extend(context, taps)?,
            Network::Dspark(m) => m.extend(context, taps)?,
        }
        Ok(())
    }
}

pub struct DflashDrafter;

const NAMESPACE: &str = "dflash-context/1";

impl Drafter for DflashDrafter {
    type Provider = DflashProvider;

    fn descriptor() -> Descriptor {
        Descriptor::new("dflash", "DFlash", env!("CARGO_PKG_VERSION"))
            .summary("block drafter over tapped target hidden states (z-lab DFlash checkpoints)")
            .needs_artifact()
            .capabilities(Capabilities {
                ports: Ports::EMBED.union(Ports::LOGITS).union(Ports::TAPS),
                draft_probabilities: true,
                ..Capabilities::default()
            })
            .option(
                "sample_drafts",
                "false",
                "draw each draft from the drafter's distribution and return it, for verify = \"rejection\"",
            )
            .option(
                "draft_temperature",
                "1.0",
                "with sample_drafts: the temperature drafts are drawn at (set it to the requests'; acceptance falls when they differ)",
            )
            .option("sts", "true", "DSpark: stop a draft where the checkpoint's STS confidence thresholds say")
            .option("min_confidence", "0.0", "DSpark: stop a draft at the first position less confident than this")
    }

    fn load(artifact: Option<&Path>, options: &Options) -> Result<DflashProvider, PluginError> {
        let dir = artifact.ok_or_else(|| PluginError::invalid_artifact("dflash needs an artifact directory"))?;
        let network = if dir.join("dspark.json").exists() {
            Network::Dspark(Dspark::load(dir)?)
        } else {
            Network::Zlab(Dflash::load(dir)?)
        };
        let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let settings = Settings {
            sample_drafts: options.value("sample_drafts")?,
            draft_temperature: options.positive("draft_temperature")?,
            sts: options.value("sts")?,
            min_confidence: options.value("min_confidence")?,
        };
        Ok(DflashProvider { network: Rc::new(network), id, settings })
    }
}

/// The manifest's options for this plugin.
#[derive(Clone, Copy)]
struct Settings {
    sample_drafts: bool,
    draft_temperature: f32,
    sts: bool,
    min_confidence: f32,
}

pub struct DflashProvider {
    network: Rc<Network>,
    id: String,
    settings: Settings,
}

impl DflashProvider {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            ports: Ports::EMBED.union(Ports::LOGITS).union(Ports::TAPS),
            tap_layers: self.network.tap_layers().into(),
            max_draft_tokens: self.network.max_draft_tokens() as u32,
            draft_probabilities: true,
            ..Capabilities::default()
        }
    }
}

impl DraftProvider for DflashProvider {
    type Rows = SourceRows<ContextRow<Shared>>;

    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: self.id.as_str().into(),
            weights_bytes: self.network.weight_bytes() as u64,
            namespace: NAMESPACE.into(),
            trained_depth: self.network.max_draft_tokens() as u32,
            capabilities: self.capabilities(),
        }
    }

    fn open(&self, target: Target, rows: usize) -> Result<SourceRows<ContextRow<Shared>>, PluginError> {
        let info = target.info();
        let refuse = |what: &str, ours: String, theirs: String| {
            Err(PluginError::incompatible_target(format!("the drafter's {what} is {ours}, the target's is {theirs}")))
        };
        match &*self.network {
            Network::Zlab(m) => {
                let c = &m.config;
                if info.hidden_size as i32 != c.hidden_size {
                    return refuse("hidden_size", c.hidden_size.to_string(), info.hidden_size.to_string());
                }
                if info.num_layers != c.num_target_layers {
                    return refuse("num_target_layers", c.num_target_layers.to_string(), info.num_layers.to_string());
                }
                if c.mask_token_id >= info.vocab_size {
                    return refuse(
                        "mask_token_id",
                        c.mask_token_id.to_string(),
                        format!("vocabulary of {}", info.vocab_size),
                    );
                }
                // The target's head brings its own softcap; the drafter's must be the same.
                let target_cap = (info.final_logit_softcap > 0.0).then_some(info.final_logit_softcap);
                if target_cap != c.final_logit_softcapping {
                    return refuse(
                        "final_logit_softcapping",
                        format!("{:?}", c.final_logit_softcapping),
                        format!("{target_cap:?}"),
                    );
                }
            }
            Network::Dspark(m) => {
                let c = &m.config;
                if info.hidden_size as i32 != c.hidden_size {
                    return refuse("hiddenSize", c.hidden_size.to_string(), info.hidden_size.to_string());
                }
                if info.vocab_size as i32 != c.vocab_size {
                    return refuse("vocabSize", c.vocab_size.to_string(), info.vocab_size.to_string());
                }
            }
        }
        // Tap index = that layer's output; the layer count = after the final norm.
        if let Some(bad) = self.network.tap_layers().iter().find(|&&l| l > info.num_layers) {
            return Err(PluginError::incompatible_target(format!(
                "the drafter taps layer {bad}, the target's layers are 0..{} (and {} for the final norm)",
                info.num_layers, info.num_layers
            )));
        }
        let shared = Shared { network: self.network.clone(), target, settings: self.settings };
        Ok(SourceRows::new(shared, ContextRow::default(), rows, NAMESPACE))
    }
}

/// What the rows of a group share.
pub struct Shared {
    network: Rc<Network>,
    target: Target,
    settings: Settings,
}

impl Shared {
    fn draft_dspark(
        &self,
        m: &Dspark,
        context: &mut Context,
        pending: u32,
        depth: usize,
        step: u64,
    ) -> Result<Proposal, PluginError> {
        let thresholds: Vec<f32> = (0..m.config.gamma)
            .map(|k| {
                let sts = if self.settings.sts { m.config.sts_thresholds.get(k).copied().unwrap_or(0.0) } else { 0.0 };
                sts.max(self.settings.min_confidence)
            })
            .collect();
        let draw = |k: usize, q: &[f32]| draw(q, uniform(step + k as u64));
        let sampling: Option<(plugin_api::sdk::Draw<'_>, f32)> =
            self.settings.sample_drafts.then_some((&draw, self.settings.draft_temperature));
        let d = m.draft(context, &self.target, pending, depth, &thresholds, sampling)?;
        Ok(Proposal { tokens: d.tokens, probabilities: d.probabilities })
    }

    /// Every row's block in one pass: [pending, mask × depth] per row, and the logits
    /// [rows · depth, V] of the positions after the first, whose tokens are the drafts.
    fn zlab_logits(
        &self,
        m: &Dflash,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
    ) -> Result<Array, PluginError> {
        let c = &m.config;
        let (rows, width) = (contexts.len() as i32, depth as i32 + 1);
        let ids: Vec<i32> = pending
            .iter()
            .flat_map(|&p| std::iter::once(p as i32).chain(std::iter::repeat_n(c.mask_token_id as i32, depth)))
            .collect();
        let embedded = self.target.embed(&Array::from_slice(&ids, &[rows, width]), true)?;
        let hidden = m.block(contexts, &embedded)?;
        let s = hidden.shape();
        let hidden = plugin_api::nn::layout::slice(&hidden, &[0..s[0] as usize, 1..s[1] as usize, 0..s[2] as usize])?;
        let logits = self.target.logits_from_hidden(&hidden)?;
        Ok(plugin_api::nn::layout::reshape(&logits, &[rows * depth as i32, logits.shape()[2]])?)
    }

    fn draft_zlab(
        &self,
        m: &Dflash,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        let logits = self.zlab_logits(m, contexts, pending, depth)?;
        if !self.settings.sample_drafts {
            let tokens = plugin_api::nn::ops::argmax_rows(&logits)?;
            return Ok(tokens.chunks(depth).map(|row| Proposal::tokens(row.to_vec())).collect());
        }
        // Block positions are drafted independently, so position i's distribution is the
        // proposal distribution of its token whatever the drafts before it.
        let vocab = logits.shape()[1];
        let mut probabilities = with_floats(&logits, <[f32]>::to_vec)?;
        tempered_softmax_rows(&mut probabilities, vocab as usize, self.settings.draft_temperature);
        // Each row's [depth, V] read off the host data, not sliced by MLX ops (one per row).
        let per_row = probabilities.chunks(depth * vocab as usize);
        let proposals = per_row
            .zip(steps)
            .map(|(q, &step)| {
                let tokens =
                    q.chunks(vocab as usize).enumerate().map(|(i, q)| draw(q, uniform(step + i as u64))).collect();
                Proposal { tokens, probabilities: Some(Array::from_slice(q, &[depth as i32, vocab])) }
            })
            .collect();
        Ok(proposals)
    }
}

impl ContextDrafter for Shared {
    fn extend(&self, context: &mut Context, taps: &Array) -> Result<(), PluginError> {
        self.network.extend(context, taps)
    }

    fn extend_rows(&self, contexts: &mut [&mut Context], taps: &Array, kept: &[usize]) -> Result<(), PluginError> {
        match &*self.network {
            Network::Zlab(m) => Ok(m.extend_rows(contexts, taps, kept)?),
            Network::Dspark(_) => plugin_api::sdk::extend_each(self, contexts, taps, kept),
        }
    }

    fn draft(&self, context: &mut Context, pending: u32, depth: usize, step: u64) -> Result<Proposal, PluginError> {
        self.draft_rows(&mut [context], &[pending], depth, &[step]).map(|mut rows| rows.remove(0))
    }

    fn draft_rows(
        &self,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
        steps: &[u64],
    ) -> Result<Vec<Proposal>, PluginError> {
        let depth = depth.min(self.network.max_draft_tokens());
        match &*self.network {
            Network::Zlab(m) => self.draft_zlab(m, contexts, pending, depth, steps),
            Network::Dspark(m) => contexts
                .iter_mut()
                .enumerate()
                .map(|(r, context)| self.draft_dspark(m, context, pending[r], depth, steps[r]))
                .collect(),
        }
    }

    /// A greedy block of the full depth stays on the device. DSpark's confidence cut and
    /// sampled drafts need their values on the host, and draft through `draft_rows`.
    fn draft_rows_on_device(
        &self,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
        _steps: &[u64],
    ) -> Result<Option<Array>, PluginError> {
        match &*self.network {
            Network::Zlab(m) if !self.settings.sample_drafts && depth <= self.network.max_draft_tokens() => {
                let logits = self.zlab_logits(m, contexts, pending, depth)?;
                let tokens = plugin_api::nn::ops::argmax_tokens(&logits)?;
                Ok(Some(tokens.reshape(&[contexts.len() as i32, depth as i32])?))
            }
            _ => Ok(None),
        }
    }

    /// A z-lab block's positions are drafted independently, so its likeliest paths make the
    /// tree: each position's most probable tokens ([`BRANCHES`]) under every node of the
    /// position before, the likeliest paths first ([`likeliest_paths`]). Greedy drafts only:
    /// sampled ones, and DSpark's, draft chains.
    fn draft_tree_rows(
        &self,
        contexts: &mut [&mut Context],
        pending: &[u32],
        depth: usize,
        nodes: usize,
        _steps: &[u64],
    ) -> Result<Option<Vec<TreeProposal>>, PluginError> {
        let Network::Zlab(m) = &*self.network else { return Ok(None) };
        if self.settings.sample_drafts {
            return Ok(None);
        }
        let depth = depth.min(self.network.max_draft_tokens());
        let logits = self.zlab_logits(m, contexts, pending, depth)?;
        let vocab = logits.shape()[1] as usize;
        let mut probabilities = with_floats(&logits, <[f32]>::to_vec)?;
        tempered_softmax_rows(&mut probabilities, vocab, 1.0);
        let trees = probabilities.chunks(depth * vocab).map(|row| {
            let positions: Vec<Vec<(u32, f32)>> = row.chunks(vocab).map(|p| most_probable(p, BRANCHES)).collect();
            TreeProposal { tree: likeliest_paths(&positions, nodes), probabilities: None }
        });
        Ok(Some(trees.collect()))
    }
}

/// Candidates per block position for trees: past the third, a position's tokens rarely carry
/// mass a path would need.
const BRANCHES: usize = 3;

/// The uniform for the draft of output step `step`.
fn uniform(step: u64) -> f64 {
    plugin_api::random::uniform(0xDF1A_5D00, step)
}

plugin_api::export_drafter!(DflashDrafter);

#[cfg(test)]
mod conformance {
    use std::path::Path;

    use plugin_api::conformance::{check, Config};

    fn config() -> Config {
        Config {
            artifact: Some(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash/gemma4-dense/drafter"),
            ),
            vocab_size: 512,
            hidden_size: 64,
            num_layers: 6,
            final_logit_softcap: 30.0,
            depth: 3,
            ..Config::default()
        }
    }

    #[test]
    fn passes_the_conformance_kit() {
        let report = check::<super::DflashDrafter>(&config());
        report.assert_passed();
        assert!(report.drafted > 0);
    }

    #[test]
    fn passes_the_conformance_kit_when_sampling_its_drafts() {
        let report = check::<super::DflashDrafter>(&Config { options: "sample_drafts = true".into(), ..config() });
        report.assert_passed();
        assert!(report.drafted > 0);
    }

    fn dspark_config(options: &str) -> Config {
        Config {
            artifact: Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dspark/dspark/drafter")),
            options: options.into(),
            vocab_size: 512,
            hidden_size: 64,
            num_layers: 6,
            final_logit_softcap: 30.0,
            depth: 4,
            ..Config::default()
        }
    }

    #[test]
    fn passes_the_conformance_kit_on_dspark_checkpoints() {
        for options in ["", "sts = false", "min_confidence = 0.5", "sample_drafts = true"] {
            let report = check::<super::DflashDrafter>(&dspark_config(options));
            report.assert_passed();
            assert!(report.drafted > 0, "{options}");
        }
    }

    #[test]
    fn refuses_a_dspark_target_of_another_size() {
        let report = check::<super::DflashDrafter>(&Config { hidden_size: 48, ..dspark_config("") });
        let why = report.failures()[0].1.as_ref().unwrap_err().clone();
        assert!(why.contains("hiddenSize is 64, the target's is 48"), "{why}");
    }

    #[test]
    fn draws_follow_the_probabilities_they_come_with() {
        let q = [0.1f32, 0.0, 0.6, 0.3];
        let mut counts = [0u32; 4];
        for step in 0..4000 {
            counts[plugin_api::sdk::draw(&q, super::uniform(step)) as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        for (c, p) in counts.iter().zip(q) {
            assert!((*c as f32 / 4000.0 - p).abs() < 0.03, "{counts:?}");
        }
    }

    #[test]
    fn refuses_targets_it_does_not_fit_naming_both_values() {
        for (config, expected) in [
            (Config { num_layers: 8, ..config() }, "num_target_layers is 6, the target's is 8"),
            (Config { hidden_size: 48, ..config() }, "hidden_size is 64, the target's is 48"),
            (
                Config { final_logit_softcap: 0.0, ..config() },
                "final_logit_softcapping is Some(30.0), the target's is None",
            ),
        ] {
            let report = check::<super::DflashDrafter>(&config);
            let why = report.failures()[0].1.as_ref().unwrap_err().clone();
            assert!(why.contains(expected), "{why}");
        }
    }

    /// A drafter trained for the demo target (models/<name>).
    fn demo(name: &str) -> Config {
        Config::demo_target(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name))
    }

    #[test]
    fn the_trained_demo_drafters_pass_the_conformance_kit() {
        for name in ["kjv-gemma4-dflash", "kjv-gemma4-dspark"] {
            let report = check::<super::DflashDrafter>(&demo(name));
            report.assert_passed();
            assert!(report.drafted > 0, "{name}: nothing drafted");
        }
    }
}
