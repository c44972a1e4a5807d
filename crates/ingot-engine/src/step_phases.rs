//! Where the engine thread's time goes: each phase of a step, summed since start. A step
//! whose host work outlasts the device's shows it here (served as `/metrics` counters, read
//! by `ingot bench serve`).

use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    /// Steps that read back or submitted work.
    pub steps: u64,
    /// Waiting for the device to finish the step before, and reading its results back.
    pub wait_device: Duration,
    /// Committing the tokens read back (host sampling, stop tokens, scheduler state).
    pub commit: Duration,
    pub schedule: Duration,
    /// Queuing the next forward pass on the device.
    pub submit: Duration,
    /// Waiting for the structured-output grammars to advance past the new tokens and
    /// compute the next step's masks.
    pub wait_masks: Duration,
    /// Queuing the next step's token picks (with their masks) on the device.
    pub sample: Duration,
    /// Applying what the grammars' advance says to the new tokens (a grammar complete, a
    /// token refused).
    pub advance_grammars: Duration,
    /// Detokenizing, stop strings, and the deltas of the step before.
    pub deliver: Duration,
    /// The engine thread's time between steps: requests in, deltas out, aborts.
    pub between_steps: Duration,
}

impl StepPhases {
    /// The phases' metric labels, in the order a step runs them.
    pub const NAMES: [&'static str; 9] = [
        "wait_device",
        "commit",
        "schedule",
        "submit",
        "wait_masks",
        "sample",
        "advance_grammars",
        "deliver",
        "between_steps",
    ];

    /// Each phase with its label from [`NAMES`](Self::NAMES).
    pub fn named(&self) -> [(&'static str, Duration); 9] {
        let times = [
            self.wait_device,
            self.commit,
            self.schedule,
            self.submit,
            self.wait_masks,
            self.sample,
            self.advance_grammars,
            self.deliver,
            self.between_steps,
        ];
        std::array::from_fn(|i| (Self::NAMES[i], times[i]))
    }
}

/// Adds the time since `*mark` to `phase` and moves the mark to now.
pub fn lap(phase: &mut Duration, mark: &mut Instant) {
    let now = Instant::now();
    *phase += now - *mark;
    *mark = now;
}
