//! Running a model over the paged KV cache: the model runner turns a host-side step
//! description into device buffers and logits; the sampler picks tokens; `generate`
//! drives one sequence from prompt to completion.

pub mod generate;
pub mod runner;
pub mod sampler;

pub use generate::{GenerateOptions, Generation, Generator};
pub use runner::{ModelRunner, RunnerConfig, StepInput};
pub use sampler::Sampler;
