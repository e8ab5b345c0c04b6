//! Drafter plugins: finding and loading libraries, and driving the drafters they provide.

pub mod check;
pub mod drafter;
pub mod load;
pub mod registry;
pub mod report;

pub use drafter::{check_artifact, DrafterError, LoadedDrafter};
pub use load::{LoadError, Plugin};
pub use registry::{select, Registry, RegistryEntry, SelectError};
