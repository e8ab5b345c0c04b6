//! The operating system's side of the host: signals, file modes, the libraries loaded in the
//! process, and the object format of a plugin library. Each call is written for the platforms
//! that have it (`cfg`), with a fallback beside it that keeps the host working where they do
//! not: no handler, no pinning, no list of libraries, rather than no build.

pub mod files;
pub mod libraries;
pub mod object_format;
pub mod processes;
pub mod signals;
