//! The `tandem` binary's library: wires the crates into the commands of the CLI.

pub mod bench;
pub mod cli;
pub mod hub;
pub mod inspect;
pub mod kernels;
pub mod load;
pub mod logging;
pub mod logits;
pub mod plan;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
