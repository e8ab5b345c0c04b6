//! # Writing a drafter
//!
//! A drafter is a `cdylib` crate that depends on `plugin-api`, implements three traits from
//! [`sdk`](crate::sdk) and exports them with one macro:
//!
//! ```toml
//! [lib]
//! crate-type = ["cdylib", "rlib"]   # rlib: so its own tests can call it directly
//!
//! [dependencies]
//! plugin-api = { path = "…/plugin-api" }
//! ```
//!
//! 1. [`Drafter`](crate::sdk::Drafter): the [`Descriptor`](crate::Descriptor) (its `kind` is
//!    what manifests name; declare every `[drafter.options]` key with its default), and
//!    `load`, which reads the artifact directory and options into a provider. Refuse a bad
//!    artifact here with [`PluginError::invalid_artifact`](crate::PluginError::invalid_artifact),
//!    naming the file, key or tensor.
//! 2. [`DraftProvider`](crate::sdk::DraftProvider): holds the weights; `open` checks the
//!    target ([`Target::info`](crate::sdk::Target::info)) and refuses a mismatch naming both
//!    values, then creates the rows.
//! 3. [`DraftRows`](crate::sdk::DraftRows): per-row state. `prefill` and `commit` feed it what
//!    the target accepted; `draft` proposes 0..=depth tokens per row and must not change the
//!    committed state; `capture`/`append` snapshot and restore a row; `filter_rows` drops
//!    rows.
//!
//! The SDK catches panics in every entry and turns them into errors. Randomness must come
//! from the `steps` the host passes (never from mlx-rs's global key), and MLX's `compile`
//! must not be used (see the crate docs).
//!
//! Build the crate, copy `lib<name>.so` into the plugins directory, and `host plugins list`
//! shows it. Run the conformance kit (`plugin-api` feature `conformance`) in its tests:
//! `plugin_api::conformance::check::<MyDrafter>(&Config::default()).assert_passed()`.
//!
//! ## Hello drafter
//!
//! A drafter that always proposes repeating the pending token:
//!
//! ```
//! use std::path::Path;
//!
//! use plugin_api::abi::{RowState, TokenRows};
//! use plugin_api::mlx_rs::Array;
//! use plugin_api::sdk::{DraftProvider, DraftRows, Drafter, Options, Proposal, Target};
//! use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};
//!
//! pub struct Hello;
//! pub struct HelloProvider { repeat: usize }
//! pub struct HelloRows { rows: usize, repeat: usize }
//!
//! impl Drafter for Hello {
//!     type Provider = HelloProvider;
//!     fn descriptor() -> Descriptor {
//!         Descriptor::new("hello", "hello drafter", "0.1.0")
//!             .summary("proposes the pending token again")
//!             .option("repeat", "2", "how many copies to propose")
//!     }
//!     fn load(_artifact: Option<&Path>, options: &Options) -> Result<HelloProvider, PluginError> {
//!         Ok(HelloProvider { repeat: options.get_or("repeat", 2)? })
//!     }
//! }
//!
//! impl DraftProvider for HelloProvider {
//!     type Rows = HelloRows;
//!     fn info(&self) -> ProviderInfo {
//!         ProviderInfo {
//!             id: "hello".into(),
//!             weights_bytes: 0,
//!             namespace: "hello/1".into(),
//!             trained_depth: 0,
//!             capabilities: Capabilities::default(),
//!         }
//!     }
//!     fn open(&self, _target: Target, rows: usize) -> Result<HelloRows, PluginError> {
//!         Ok(HelloRows { rows, repeat: self.repeat })
//!     }
//! }
//!
//! impl DraftRows for HelloRows {
//!     fn prefill(&mut self, _: TokenRows<'_>, _: Option<Array>) -> Result<(), PluginError> {
//!         Ok(())
//!     }
//!     fn draft(&mut self, pending: &[u32], depth: usize, _: &[u64]) -> Result<Vec<Proposal>, PluginError> {
//!         Ok(pending.iter().map(|&t| Proposal::tokens(vec![t; self.repeat.min(depth)])).collect())
//!     }
//!     fn commit(&mut self, _: TokenRows<'_>, _: &[u32], _: Option<Array>) -> Result<(), PluginError> {
//!         Ok(())
//!     }
//!     fn filter_rows(&mut self, keep: &[u32]) -> Result<(), PluginError> {
//!         self.rows = keep.len();
//!         Ok(())
//!     }
//!     fn append(&mut self, states: Vec<RowState>) -> Result<(), PluginError> {
//!         self.rows += states.len();
//!         Ok(())
//!     }
//!     fn capture(&mut self, _row: usize) -> Result<RowState, PluginError> {
//!         Ok(RowState { namespace: "hello/1".into(), processed: 0, ids: Default::default(), tensors: Default::default() })
//!     }
//! }
//!
//! plugin_api::export_drafter!(Hello);
//!
//! # let root = plugin_api::sdk::root_module::<Hello>();
//! # let descriptor = (root.descriptor())().unwrap();
//! # assert_eq!(descriptor.kind.as_str(), "hello");
//! ```
