//! The drafter host: a Gemma 4 target, its caches and the speculative verify loop, with
//! drafters loaded as plugins. The `host` binary is a thin command line over this library.

pub mod batch;
pub mod bench;
pub mod chat;
pub mod check_model;
pub mod checkout;
pub mod distributed;
pub mod doctor;
pub mod generate;
pub mod hub;
pub mod interrupt;
pub mod launch;
pub mod manifest;
pub mod model;
pub mod new_drafter;
pub mod plugin;
pub mod plugins_dir;
pub mod run;
pub mod runtime;
pub mod sampling;
pub mod serve;
pub mod speculative;
pub mod target_view;
pub mod tokenizer;
