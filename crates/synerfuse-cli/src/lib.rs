//! What the two `synerfuse` binaries share: the data commands (`preprocess`, `merge`,
//! `inspect`, `index`, `topology`, `timeline`), which never load libtorch, the entry point
//! (logging with the rank, the one-line error, the list of the libtorch commands), the
//! parsers of flag values and atomic writes.
//!
//! `synerfuse` is this library and a `main`; `synerfuse-torch` adds the commands that need
//! libtorch or MPI (`src/torch/`: train, profile, plan, score, generate, export, env),
//! compiled into that binary only, so this library, and `synerfuse` with it, links no
//! libtorch. The work itself lives in the library crates; this crate parses, wires and
//! prints.
#![doc = include_str!("../README.md")]

pub mod data_commands;
pub mod entry;
pub mod files;
pub mod index_command;
pub mod timeline_command;
pub mod topology_command;
pub mod values;
