//! Running a model over the paged KV cache: the model runner turns a step description
//! into device buffers and logits; the sampler picks tokens; the engine schedules many
//! requests continuously and turns tokens into text.

pub mod detokenizer;
mod embedding;
pub mod engine;
pub mod engine_loop;
pub mod mask_job;
pub mod runner;
pub mod sampler;
mod step_phases;
pub mod structured;

pub use engine::default_max_num_seqs;
pub use engine::{
    Completion, Engine, EngineConfig, EngineStats, QueueFull, RequestId, RequestOutput, SeqDelta,
    StepInfo, StructuredStats,
};
pub use engine_loop::{EngineHandle, Event, Events, Failure, SubmitError};
pub use mask_job::{MaskJob, Masks};
pub use runner::{ModelRunner, RunnerConfig, StepInput};
pub use sampler::{Sampler, TokenLogprobs};
pub use step_phases::StepPhases;
pub use structured::{Grammar, Grammars};
