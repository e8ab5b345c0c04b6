//! How often decoding waits for MLX. On MLX's route (Metal, CUDA, `HOST_KERNELS=mlx`) the host
//! waits once per plain step (for the token) and once per speculative round (for the window's
//! tokens, and the drafts of a drafter that leaves them on the device: DFlash, the assistant).
//! Such a drafter waits for nothing itself; ngram computes on the host. On the CPU loops' route
//! the host reads what MLX already computed in host memory and makes no counted wait at all.

mod common;

use std::path::Path;
use std::rc::Rc;

use host::generate::{generate, Event, Request};
use host::model::{load, Gemma4};
use host::plugin::load::load as load_library;
use host::plugin::LoadedDrafter;
use host::sampling::SamplingParams;
use host::speculative::{generate_speculative, SpecConfig, Verify};
use mlx_rs::Array;
use plugin_api::abi::{RowState, TokenRows};
use plugin_api::nn::sync::{graph, waits};
use plugin_api::sdk::{self, DraftProvider, Drafter, GroupedDraftProvider, Options, Proposal, Target};
use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};

const PROMPT: [u32; 12] = [2, 17, 40, 9, 33, 17, 40, 9, 61, 5, 17, 40];

/// Waits per plain step and per round on this process's route.
fn per_step() -> usize {
    if kernels::route::on_cpu() {
        0
    } else {
        1
    }
}

fn settings() -> [SamplingParams; 2] {
    [SamplingParams::default(), SamplingParams { temperature: 0.8, top_p: 0.9, seed: 3, ..Default::default() }]
}

/// The waits counted when each token was emitted.
fn waits_at_tokens(counts: &mut Vec<usize>) -> impl FnMut(Event) + '_ {
    move |event| {
        if let Event::Token(_) = event {
            counts.push(waits());
        }
    }
}

#[test]
fn plain_decoding_waits_once_per_token() {
    host::runtime::init();
    let model = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gemma4/ple-kvshare")).unwrap();
    for params in settings() {
        let request = Request { prompt: PROMPT.to_vec(), max_tokens: 24, sampling: params, ..Default::default() };
        let mut counts = Vec::new();
        generate(&model, &request, waits_at_tokens(&mut counts)).unwrap();
        assert_eq!(counts.len(), 24);
        let between: Vec<usize> = counts.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(between.iter().all(|&n| n == per_step()), "{params:?}: waits between tokens {between:?}");
    }
}

fn models() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models")
}

/// A target, a drafter of it and a prompt.
type Pairing = (Rc<Gemma4>, LoadedDrafter, Vec<u32>);

/// The trained demo target with one of its drafters (`artifact` under models/), and a prompt.
fn demo(plugin: &str, artifact: Option<&str>, options: &str) -> Pairing {
    host::runtime::init();
    let dir = models().join("kjv-gemma4");
    let model = Rc::new(load(&dir).unwrap());
    let tokenizer = host::tokenizer::Tokenizer::load(&dir).unwrap();
    let prompt = tokenizer.encode("And Abraham journeyed from thence toward the south country, and dwelled between Kadesh and Shur, and sojourned in Gerar.\nAnd Abraham said of Sarah his wife, She is my sister: and Abimelech king of Gerar sent, and took Sarah.\n").unwrap();
    let library = load_library(&common::workspace_plugin(plugin), None).unwrap();
    let drafter = LoadedDrafter::load(&library, artifact.map(|a| models().join(a)).as_deref(), options).unwrap();
    (model, drafter, prompt)
}

/// The drafters the rounds are counted with: ngram drafts on the host, DFlash and the
/// assistant on the device.
fn pairings() -> Vec<(&'static str, Pairing)> {
    vec![
        ("ngram", demo("ngram", None, "max_ngram = 3")),
        ("dflash", demo("dflash", Some("kjv-gemma4-dflash"), "")),
        ("assistant", demo("assistant", Some("kjv-gemma4-assistant"), "")),
    ]
}

#[test]
fn a_speculative_round_waits_once() {
    for (name, (model, drafter, prompt)) in pairings() {
        for params in settings() {
            let request = Request { prompt: prompt.clone(), max_tokens: 40, sampling: params, ..Default::default() };
            let plain = generate(&model, &request, |_| ()).unwrap().tokens;
            rounds_wait(name, &model, &drafter, &request, &plain, per_step());
        }
    }
}

/// Decodes `request` speculatively: the output is `plain`, with `waits` counted per round.
fn rounds_wait(
    name: &str,
    model: &Rc<Gemma4>,
    drafter: &LoadedDrafter,
    request: &Request,
    plain: &[u32],
    waits: usize,
) {
    let params = &request.sampling;
    let mut counts = Vec::new();
    let config = SpecConfig::new(4, Verify::Match);
    let spec = generate_speculative(model, drafter, request, config, waits_at_tokens(&mut counts)).unwrap();
    assert_eq!(spec.tokens, plain, "{name}, {params:?}");
    assert!(spec.stats.drafter_error.is_none(), "{name}: {:?}", spec.stats.drafter_error);
    assert!(spec.stats.accepted > 0, "{name}, {params:?}: never drafted right: {:?}", spec.stats);
    // A round's tokens are emitted after its one wait, so tokens of one round share a count.
    let mut rounds = counts.clone();
    rounds.dedup();
    let between: Vec<usize> = rounds.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(between.iter().all(|&n| n == waits), "{name}, {params:?}: waits between rounds {between:?}");
    // The host's own wait comes every round, drafted or not.
    if per_step() > 0 {
        assert_eq!(rounds.len(), spec.stats.rounds, "{name}, {params:?}: one count per round");
    }
}

// --- a drafter of this test's own, whose waits the count sees ----------------------------------

/// Proposes plain decoding's next tokens, wrong at every third step, computed by an MLX op as a
/// device drafter's are: left on the device through `device-draft/1`, waited for in `draft`.
struct Scripted;
struct ScriptedProvider(Vec<u32>);
struct ScriptedRows(Vec<u32>);

impl Drafter for Scripted {
    type Provider = ScriptedProvider;
    fn descriptor() -> Descriptor {
        Descriptor::new("scripted", "proposes a given output", "0.0.0").option("script", "[]", "the output")
    }
    fn load(_: Option<&Path>, options: &Options) -> Result<ScriptedProvider, PluginError> {
        Ok(ScriptedProvider(options.value("script")?))
    }
}

impl DraftProvider for ScriptedProvider {
    type Rows = ScriptedRows;
    fn info(&self) -> ProviderInfo {
        ProviderInfo {
            id: "scripted".into(),
            weights_bytes: 0,
            namespace: "scripted".into(),
            trained_depth: 0,
            capabilities: Capabilities::default(),
        }
    }
    fn open(&self, _: Target, _: usize) -> Result<ScriptedRows, PluginError> {
        Ok(ScriptedRows(self.0.clone()))
    }
}

impl ScriptedRows {
    /// The drafts [rows, depth], still to be computed.
    fn drafts(&self, depth: usize, steps: &[u64]) -> Result<Array, PluginError> {
        let ids: Vec<u32> = steps
            .iter()
            .flat_map(|&step| {
                (0..depth as u64).map(move |i| match self.0.get((step + i) as usize) {
                    Some(&t) if (step + i) % 3 != 2 => t,
                    _ => 1,
                })
            })
            .collect();
        let table = Array::from_slice(&ids, &[steps.len() as i32, depth as i32]);
        Ok(table.multiply(Array::from_int(1))?.as_dtype(mlx_rs::Dtype::Uint32)?)
    }
}

impl GroupedDraftProvider for ScriptedRows {
    fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn draft(&mut self, _: &[u32], depth: usize, steps: &[u64]) -> Result<Vec<Proposal>, PluginError> {
        let drafts = self.drafts(depth, steps)?;
        plugin_api::nn::sync::eval([&drafts])?;
        Ok(drafts.as_slice::<u32>().chunks(depth).map(|row| Proposal::tokens(row.to_vec())).collect())
    }
    fn draft_on_device(&mut self, _: &[u32], depth: usize, steps: &[u64]) -> Result<Option<Array>, PluginError> {
        self.drafts(depth, steps).map(Some)
    }
    fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
        Ok(())
    }
    fn filter_rows(&mut self, _: &[u32]) -> Result<(), PluginError> {
        Ok(())
    }
    fn append(&mut self, _: Vec<RowState>) -> Result<(), PluginError> {
        Ok(())
    }
    fn capture(&mut self, _: usize) -> Result<RowState, PluginError> {
        Err(PluginError::invalid_argument("scripted rows are not captured"))
    }
}

/// Drafts left on the device cost the round no wait of their own: the drafter and the target
/// are waited for together, once a round. (On the CPU loops' route the host takes the drafts
/// from `draft`, and the drafter's wait is the round's one.)
#[test]
fn device_drafts_share_the_rounds_wait() {
    let (model, _, prompt) = demo("ngram", None, "");
    for params in settings() {
        let request = Request { prompt: prompt.clone(), max_tokens: 40, sampling: params, ..Default::default() };
        let plain = generate(&model, &request, |_| ()).unwrap().tokens;
        let options = format!("script = {plain:?}");
        let drafter = LoadedDrafter::load_root(sdk::root_module::<Scripted>(), "scripted", None, &options).unwrap();
        rounds_wait("scripted", &model, &drafter, &request, &plain, 1);
    }
}

/// DFlash and the assistant hand the host drafts still to be computed (their whole forward is
/// in the array's graph), and they are the tokens `draft` gives.
#[test]
fn device_drafts_are_queued_and_equal_the_drafts() {
    for (name, (model, drafter, prompt)) in pairings().into_iter().skip(1) {
        let (prefix, last) = prompt.split_at(prompt.len() - 1);
        let mut group = common::group_after_taps(&model, &drafter, prefix);
        let tokens = group.draft_on_device(last, 3, &[0]).unwrap().expect("drafts on the device");
        if !kernels::route::on_cpu() {
            let ops = graph(&tokens).lines().count();
            assert!(ops > 20, "{name}: the drafts come with {ops} ops to run: the drafter waited for them");
        }
        let drafted = group.draft(last, 3, &[0]).unwrap().remove(0).tokens;
        assert_eq!(tokens.as_slice::<u32>(), drafted, "{name}");
    }
}
