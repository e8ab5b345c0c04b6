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
//!
//! [dev-dependencies]
//! plugin-api = { path = "…/plugin-api", features = ["conformance"] }
//!
//! # The CPU kernels are SIMD loops, far too slow unoptimized, in the crate's own tests too.
//! [profile.dev.package.kernels]
//! opt-level = 3
//! ```
//!
//! `host new-drafter NAME` writes such a crate, with a working drafter to start from.
//!
//! Host and plugins link one shared MLX library, prepared by the host checkout's
//! `scripts/setup.sh`. A crate outside the checkout learns where it is with one command, run
//! once: `…/scripts/setup.sh --drafter-crate .` writes the crate's `.cargo/config.toml`
//! (`new-drafter` writes it too); then `cargo build` and `cargo test` work there as in the
//! checkout. Without it, mlx-sys's own build script runs and tries to build a separate MLX from
//! the network.
//!
//! 1. [`Drafter`](crate::sdk::Drafter), the kind: the [`Descriptor`](crate::Descriptor) (its
//!    `kind` is what manifests name; declare every `[drafter.options]` key with its default,
//!    which [`Options::value`](crate::sdk::Options::value) then returns when the manifest
//!    leaves the key out), and `load`, which reads the artifact directory and options into a
//!    provider. Refuse a bad artifact here with
//!    [`PluginError::invalid_artifact`](crate::PluginError::invalid_artifact), naming the file,
//!    key or tensor.
//! 2. [`DraftProvider`](crate::sdk::DraftProvider), a loaded artifact: holds the weights;
//!    `open` checks the target ([`Target::info`](crate::sdk::Target::info)) and refuses a
//!    mismatch naming both values, then creates the rows.
//! 3. The rows, one of two ways:
//!    - [`DraftSource`](crate::sdk::DraftSource), one row: `prefill` and `commit` feed it what
//!      the target accepted; `draft` proposes 0..=depth tokens and must not change the
//!      committed state; `snapshot`/`restore` carry it to another group.
//!      [`SourceRows`](crate::sdk::SourceRows) makes the group of B rows from it, with the row
//!      counts, filtering, capture and append done once, in the SDK. Its `draft_rows` and
//!      `commit_rows` take the rows one at a time unless overridden; a small drafter's cost is
//!      its count of MLX ops whatever the rows, so overriding them to run every row in one pass
//!      pays under batching (DFlash does, through
//!      [`ContextDrafter::draft_rows`](crate::sdk::ContextDrafter::draft_rows)/`extend_rows`).
//!      A drafter that reads only the row's tokens implements
//!      [`FromText`](crate::sdk::lookup::FromText) instead, and
//!      [`TextRow`](crate::sdk::lookup::TextRow) is its row (the `ngram` and `lookup` plugins).
//!    - [`GroupedDraftProvider`](crate::sdk::GroupedDraftProvider), all B rows at once, for a
//!      drafter whose rows cannot be handled apart.
//!
//! ## What the target lends
//!
//! A drafter declares in its [`Capabilities`](crate::Capabilities) the target ports it uses;
//! the host refuses calls to any other.
//! - `embed` and `logits`: the target's embedding (scaled or not) and its head with the final
//!   softcap, through [`Target`](crate::sdk::Target).
//! - `donors`: the K/V of the target's last sliding and last full layer, lent without a copy.
//! - `taps`: the `context` of `prefill` and `commit`. With `tap_layers` empty it is the target's
//!   final (normed) hidden states [B, N, H]; otherwise the outputs of those layers (index =
//!   that layer's output, the layer count = after the final norm) concatenated in the listed
//!   order on the feature axis [B, N, taps·H]. In `prefill` the N positions are the new prompt
//!   tokens; in `commit` they are the window's positions, of which a row keeps
//!   `0..=accepted[r]`. A [`DraftSource`](crate::sdk::DraftSource) receives its own row's kept
//!   span, [1, kept, F].
//!
//! The SDK catches panics in every entry and turns them into errors. Randomness must come
//! from the `steps` the host passes (never from mlx-rs's global key), and MLX's `compile`
//! must not be used (see the crate docs).
//!
//! Build the crate, copy its library (`lib<name>.so` on Linux, `lib<name>.dylib` on macOS) into
//! the plugins directory, and `host plugins list` shows it. Run the conformance kit (`plugin-api` feature `conformance`) in its tests:
//! `plugin_api::conformance::check::<MyDrafter>(&Config::default()).assert_passed()`.
//!
//! ## Hello drafter
//!
//! A drafter that always proposes repeating the pending token:
//!
//! ```
//! use std::path::Path;
//!
//! use plugin_api::mlx_rs::Array;
//! use plugin_api::sdk::{DraftProvider, DraftSource, Drafter, Options, Proposal, Snapshot, SourceRows, Target};
//! use plugin_api::{Capabilities, Descriptor, PluginError, ProviderInfo};
//!
//! pub struct Hello;
//! pub struct HelloProvider { repeat: usize }
//!
//! /// A row: this drafter keeps nothing of its rows.
//! #[derive(Clone)]
//! pub struct HelloRow;
//!
//! impl Drafter for Hello {
//!     type Provider = HelloProvider;
//!     fn descriptor() -> Descriptor {
//!         Descriptor::new("hello", "hello drafter", "0.1.0")
//!             .summary("proposes the pending token again")
//!             .option("repeat", "2", "how many copies to propose")
//!     }
//!     fn load(_artifact: Option<&Path>, options: &Options) -> Result<HelloProvider, PluginError> {
//!         Ok(HelloProvider { repeat: options.value("repeat")? })
//!     }
//! }
//!
//! impl DraftProvider for HelloProvider {
//!     type Rows = SourceRows<HelloRow>;
//!     fn info(&self) -> ProviderInfo {
//!         ProviderInfo {
//!             id: "hello".into(),
//!             weights_bytes: 0,
//!             namespace: "hello/1".into(),
//!             trained_depth: 0,
//!             capabilities: Capabilities::default(),
//!         }
//!     }
//!     fn open(&self, _target: Target, rows: usize) -> Result<SourceRows<HelloRow>, PluginError> {
//!         Ok(SourceRows::new(self.repeat, HelloRow, rows, "hello/1"))
//!     }
//! }
//!
//! impl DraftSource for HelloRow {
//!     type Shared = usize;
//!     fn prefill(&mut self, _: &usize, _: &[u32], _: Option<&Array>) -> Result<(), PluginError> {
//!         Ok(())
//!     }
//!     fn draft(&mut self, repeat: &usize, _row: usize, pending: u32, depth: usize, _step: u64)
//!         -> Result<Proposal, PluginError> {
//!         Ok(Proposal::tokens(vec![pending; (*repeat).min(depth)]))
//!     }
//!     fn commit(&mut self, _: &usize, _: &[u32], _: Option<&Array>) -> Result<(), PluginError> {
//!         Ok(())
//!     }
//!     fn snapshot(&self) -> Snapshot {
//!         Snapshot { processed: 0, ids: Vec::new(), tensors: Vec::new() }
//!     }
//!     fn restore(_: &usize, _: Snapshot) -> Result<HelloRow, PluginError> {
//!         Ok(HelloRow)
//!     }
//! }
//!
//! plugin_api::export_drafter!(Hello);
//!
//! # let root = plugin_api::sdk::root_module::<Hello>();
//! # let descriptor = (root.descriptor())().unwrap();
//! # assert_eq!(descriptor.kind.as_str(), "hello");
//! ```
