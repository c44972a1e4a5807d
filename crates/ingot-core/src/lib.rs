//! The engine's plain-Rust core: sequences, sampling parameters, the KV block pool with
//! prefix caching, and the scheduler. No tensors here: everything is testable in
//! milliseconds.

pub mod block_pool;
pub mod sampling;
pub mod scheduler;
pub mod sequence;

pub use block_pool::{BlockId, BlockPool, PrefixCacheStats};
pub use sampling::{InvalidParam, ReasoningMarkers, SamplingParams, StructuredOutput};
pub use scheduler::{AdmissionError, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput};
pub use sequence::{FinishReason, SeqId, Sequence};
