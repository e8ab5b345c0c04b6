//! # The drafter plugin contract
//!
//! A drafter is a shared library that the host loads at run time to propose tokens, which the
//! host's target model then verifies. Host and plugins are built apart, possibly by different
//! people, so what crosses between them is ABI-stable (`abi_stable`) and described here once.
//! Authors write plain Rust against [`sdk`]; the [`abi`], [`target`] and [`extension`] modules
//! are the wire. [`config`] reads artifact configs and [`random`] is the one source of
//! randomness.
//!
//! This crate is the contract alone: no SIMD and no platform code, so it changes only when the
//! contract does. Two crates sit beneath it, each depending only on the one below:
//! - [`nn`], the model toolkit: the MLX building blocks host and drafters share (a prefix view
//!   over weights, linear layers, norms, RoPE, attention, the gated MLP), so that a drafter
//!   computes exactly as the target does. Re-exported here as `plugin_api::nn`, the path
//!   drafters have always used.
//! - `kernels` (`plugin_api::nn::kernels`): the CPU loops the toolkit dispatches to, feature
//!   detection, core affinity and every other platform-specific call. With `HOST_KERNELS=mlx`,
//!   or off the CPU, every op is MLX's own.
//!
//! ## Ownership
//! Host and plugins link the same `libmlx.so` and each keep their own static copy of mlx-c and
//! mlx-rs, so an MLX array is meaningful on both sides. It crosses as a raw mlx-c handle in a
//! wrapper that says who owns it: an [`ArrayRef`] is lent for one call (read it, or take a new
//! reference with [`ArrayRef::to_array`], never free it); an [`OwnedArray`] is handed over and
//! the receiver frees it. Other values (`RVec`, `RString`, trait objects) carry their own
//! deallocator, so whichever side drops them frees them correctly. A row group keeps the
//! target view it was opened with until the group is dropped; the host keeps the target
//! alive that long.
//!
//! ## Threading
//! A provider, its row groups and the target view are used from one thread at a time: the
//! host never calls into one row group concurrently, and a plugin must not call the target
//! view from threads of its own. Each copy of mlx-rs has its own default stream scope and
//! random key, so anything random is derived from the `steps` the host passes, never from
//! mlx-rs's global key. MLX's function compilation stays off in every artifact of the
//! process: mlx-rs numbers compiled functions per copy while the compile cache is shared, so
//! a plugin's compiled function could return the host's. The host turns it off at start-up.
//! The toolkit's products share their work with a helper thread (`nn::helper`): the host's,
//! which it hands to each plugin it loads through the extension [`shared_helper`], so that
//! drafter and target never take turns at one core with two spinning helpers; a plugin loaded
//! without it starts its own on first use. A helper lives as long as the process, so the host
//! never unloads a plugin library.
//!
//! ## Errors
//! Every entry returns `RResult<_, `[`PluginError`]`>`: a kind and one line that names what was
//! wrong and where. The SDK runs every entry under `catch_unwind`, so a panic arrives as an
//! error of kind `PANICKED` carrying its message; the panic itself prints nothing on the user's
//! terminal unless the host sets [`sdk::PANIC_OUTPUT_ENV`] (`host run --verbose`). The host then
//! drops that drafter for the rest of the request and finishes it by plain decoding. A panic
//! that escaped would end the process, which is why
//! plugins go through the SDK rather than implementing the ABI traits themselves. The host
//! validates every answer (lengths, token ids, shapes) before using it.
//!
//! ## Versioning
//! The library header carries [`API_VERSION`]; the host compares its major first and refuses
//! another major with a one-line message, then abi_stable checks the layout of every type
//! reachable from the root module. Items marked **ABI-frozen** keep their layout for the life
//! of the major version. Neither the root module nor the target view ever grows: new features
//! arrive as extensions, looked up by a versioned id (`"name/1"`) through
//! [`abi::DrafterRoot::extension`] (the plugin's) or `TargetViewAbi::extension` (the host's)
//! and layout-checked on their own, so a newer host still loads older plugins (which answer
//! that they have none) and an older host ignores what it does not know. API 1.1 added
//! [`device_draft`], drafts left on the device; API 1.2 [`draft_tree`], trees of candidates
//! verified in one forward. Source compatibility
//! follows the same major: every public path of this crate, `plugin_api::nn::…` included,
//! stays for its life (re-exported where an item moved), so a drafter that built against
//! 1.x builds against any later 1.y.
//!
//! ## Writing a drafter
//! Three roles, in [`sdk`]: a [`DraftProvider`](sdk::DraftProvider) is a loaded artifact
//! (weights, options); a [`GroupedDraftProvider`](sdk::GroupedDraftProvider) is the B rows the
//! host's verify loop drives; a [`DraftSource`](sdk::DraftSource) is one row, of which
//! [`SourceRows`](sdk::SourceRows) makes the group. Beneath them the ABI's `ProviderAbi` and
//! `RowGroupAbi` cross the boundary. See [`guide`], and [`train_guide`] to train one of the
//! shipped kinds for your own target.

#![allow(non_local_definitions)]

pub mod abi;
pub mod config;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod descriptor;
pub mod device_draft;
pub mod draft_tree;
pub mod error;
pub mod extension;
pub mod guide;
pub mod random;
pub mod sdk;
pub mod shared_helper;
pub mod target;
pub mod tensor;
pub mod train_guide;
pub mod version;

/// The model toolkit (its own crate, `nn`), at the path drafters have always used.
pub use nn;

pub use descriptor::{Capabilities, Descriptor, OptionDoc, Ports, PrefillMode, ProviderInfo};
pub use error::{ErrorKind, PluginError};
pub use tensor::{ArrayRef, OwnedArray, RawArray};
pub use version::{API_MAJOR, API_MINOR, API_VERSION};

pub use abi_stable;
pub use mlx_rs;

#[doc(hidden)]
pub mod __private {
    pub use abi_stable::library::{__call_root_module_loader, CheckTypeLayout, LibHeader, RootModuleResult};
}
