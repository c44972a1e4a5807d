//! The ops of a step as a list of dispatches, sent to the GPU in compute passes: the first
//! pass after the device was idle holds `FIRST_SUBMIT` dispatches, each next one twice as
//! many up to `SUBMIT_EVERY`, so that the GPU starts soon after the step does and then runs
//! while the host records the rest, paying the host's cost of a submission a few times per
//! step.
//!
//! Each dispatch's small uniform block (sizes, offsets, eps) takes one slot of a params
//! arena; a pass's slots are written with one queue write just before it is submitted,
//! and the arena starts over only once the device is idle. wgpu orders the dispatches of
//! a pass by the buffers they read and write.
//!
//! Bind groups are kept by (pipeline, params slot, buffers): a decode step records the
//! same dispatches at the same slots as the one before it, and finds them all made. Those
//! not used for `BIND_GROUP_IDLES` waits for the device are dropped with the buffers they
//! hold.

use anyhow::{anyhow, Result};
use std::collections::HashMap;
use std::sync::mpsc;

const PARAM_BYTES: usize = 64;
/// Dispatches the params arena holds between two waits for the device.
const MAX_DISPATCHES: usize = 4096;
/// Dispatches of the first pass after the device was idle; each next pass doubles it.
const FIRST_SUBMIT: usize = 4;
/// The most dispatches recorded before they are submitted without waiting for a result.
const SUBMIT_EVERY: usize = 64;
/// Bind groups kept; the cache starts over when full (it holds its buffers alive).
const MAX_BIND_GROUPS: usize = 8192;
/// Waits for the device after which an unused bind group is dropped.
const BIND_GROUP_IDLES: u64 = 64;
/// Dispatches timed per submission while profiling: two timestamps each, and a query set
/// holds at most `wgpu::QUERY_SET_MAX_QUERIES`.
const PROFILED_DISPATCHES: usize = wgpu::QUERY_SET_MAX_QUERIES as usize / 2;

/// A dispatch's pipeline, params offset and (binding, buffer) list.
type BindGroupKey = (wgpu::ComputePipeline, usize, Vec<(u32, wgpu::Buffer)>);

struct Dispatch {
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    grid: [u32; 3],
    /// What the op profile counts it as (only while profiling).
    op: Option<String>,
}

/// Device time per op, from timestamps written around each dispatch. Each dispatch runs
/// in a pass of its own then, so the profile shows kernel time, not the one-pass step.
struct Profiler {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    readback: wgpu::Buffer,
    totals: HashMap<String, (u64, f64)>,
}

pub struct Recorder {
    arena: wgpu::Buffer,
    /// Bytes between the params of consecutive dispatches (the offset alignment).
    stride: usize,
    /// The params of every dispatch since the device was last idle; the first `written`
    /// bytes are in the arena.
    params: Vec<u8>,
    written: usize,
    /// Recorded, not yet submitted.
    dispatches: Vec<Dispatch>,
    /// Dispatches the next pass is submitted at.
    submit_at: usize,
    /// Each with the count of `idle` calls when it was last used.
    bind_groups: HashMap<BindGroupKey, (wgpu::BindGroup, u64)>,
    idles: u64,
    profiler: Option<Profiler>,
    /// The error of a flush made to free room for a dispatch, for the next flush to return.
    failed: Option<anyhow::Error>,
}

impl Recorder {
    pub fn new(device: &wgpu::Device, limits: &wgpu::Limits) -> Recorder {
        let stride = (limits.min_uniform_buffer_offset_alignment as usize).max(PARAM_BYTES);
        let arena = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("params"),
            size: (stride * MAX_DISPATCHES) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Recorder {
            arena,
            stride,
            params: Vec::with_capacity(stride * MAX_DISPATCHES),
            written: 0,
            dispatches: Vec::with_capacity(MAX_DISPATCHES),
            submit_at: FIRST_SUBMIT,
            bind_groups: HashMap::new(),
            idles: 0,
            profiler: None,
            failed: None,
        }
    }

    /// Whether recording one more dispatch needs a wait for the device first.
    fn is_full(&self) -> bool {
        self.params.len() == self.stride * MAX_DISPATCHES
    }

    /// Called once every submission has completed: the arena may be rewritten from its
    /// start.
    pub fn idle(&mut self) {
        if self.dispatches.is_empty() {
            self.params.clear();
            self.written = 0;
            self.submit_at = FIRST_SUBMIT;
        }
        self.idles += 1;
        if self.idles.is_multiple_of(BIND_GROUP_IDLES) {
            let idles = self.idles;
            self.bind_groups
                .retain(|_, (_, used)| *used + BIND_GROUP_IDLES > idles);
        }
    }

    /// Times every dispatch from now on (the device must have `TIMESTAMP_QUERY`).
    pub fn start_profile(&mut self, device: &wgpu::Device) {
        let bytes = 8 * wgpu::QUERY_SET_MAX_QUERIES as u64;
        self.profiler = Some(Profiler {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("op profile"),
                ty: wgpu::QueryType::Timestamp,
                count: wgpu::QUERY_SET_MAX_QUERIES,
            }),
            resolved: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("op profile"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            readback: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("op profile readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            totals: HashMap::new(),
        });
    }

    /// (op, calls, milliseconds) since the profile started, longest first.
    pub fn profile(&self) -> Vec<(String, u64, f64)> {
        let mut ops: Vec<(String, u64, f64)> = self
            .profiler
            .iter()
            .flat_map(|p| p.totals.iter().map(|(k, &(n, ms))| (k.clone(), n, ms)))
            .collect();
        ops.sort_by(|a, b| b.2.total_cmp(&a.2));
        ops
    }

    /// Submits what is recorded, and waits for the device where the arena is full; an
    /// error waits for the next [`Recorder::flush`].
    fn submit_and_make_room(&mut self, device: &wgpu::Device, queue: &wgpu::Queue) {
        if let Err(e) = self.flush(device, queue) {
            self.failed.get_or_insert(e);
        }
        if self.is_full() {
            match device.poll(wgpu::PollType::wait_indefinitely()) {
                Ok(_) => self.idle(),
                Err(e) => {
                    self.failed
                        .get_or_insert(anyhow!("wgpu: waiting for the device: {e}"));
                }
            }
        }
    }

    /// Adds a dispatch of `pipeline` over `grid` with `params` (at most 16 words) at
    /// binding 0 and `buffers` at theirs; `op` names it in the op profile.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        pipeline: wgpu::ComputePipeline,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        grid: [u32; 3],
        op: impl FnOnce() -> String,
    ) {
        assert!(params.len() * 4 <= PARAM_BYTES, "too many params");
        if self.is_full() {
            self.submit_and_make_room(device, queue);
            assert!(
                !self.is_full(),
                "the params arena stays full: {:?}",
                self.failed
            );
        }
        let offset = self.params.len();
        self.params
            .extend(params.iter().flat_map(|w| w.to_le_bytes()));
        self.params.resize(offset + self.stride, 0);
        let key = (
            pipeline.clone(),
            offset,
            buffers.iter().map(|&(i, b)| (i, b.clone())).collect(),
        );
        if !self.bind_groups.contains_key(&key) && self.bind_groups.len() == MAX_BIND_GROUPS {
            self.bind_groups.clear();
        }
        let arena = &self.arena;
        let bind_group =
            self.bind_groups
                .entry(key)
                .or_insert_with_key(|(pipeline, offset, buffers)| {
                    let mut entries = vec![wgpu::BindGroupEntry {
                        binding: 0,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: arena,
                            offset: *offset as u64,
                            size: wgpu::BufferSize::new(PARAM_BYTES as u64),
                        }),
                    }];
                    entries.extend(buffers.iter().map(|(binding, b)| wgpu::BindGroupEntry {
                        binding: *binding,
                        resource: b.as_entire_binding(),
                    }));
                    let group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &pipeline.get_bind_group_layout(0),
                        entries: &entries,
                    });
                    (group, 0)
                });
        bind_group.1 = self.idles;
        let bind_group = bind_group.0.clone();
        self.dispatches.push(Dispatch {
            pipeline,
            bind_group,
            grid,
            op: self.profiler.is_some().then(op),
        });
        let most = if self.profiler.is_some() {
            PROFILED_DISPATCHES
        } else {
            self.submit_at
        };
        if self.dispatches.len() == most {
            self.submit_and_make_room(device, queue);
        }
    }

    /// Submits the recorded dispatches as one compute pass (one pass per dispatch while
    /// profiling, then waits for their timestamps).
    pub fn flush(&mut self, device: &wgpu::Device, queue: &wgpu::Queue) -> Result<()> {
        self.submit(device, queue, None)
    }

    /// [`Recorder::flush`], with a copy of `bytes` bytes from `src` to `dst` after the
    /// dispatches in the same submission.
    pub fn flush_and_copy(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<()> {
        self.submit(device, queue, Some((src, dst, bytes)))
    }

    fn submit(
        &mut self,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        copy: Option<(&wgpu::Buffer, &wgpu::Buffer, u64)>,
    ) -> Result<()> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if self.dispatches.is_empty() {
            if let Some((src, dst, bytes)) = copy {
                let mut enc = device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(src, 0, dst, 0, bytes);
                queue.submit([enc.finish()]);
            }
            return Ok(());
        }
        queue.write_buffer(
            &self.arena,
            self.written as u64,
            &self.params[self.written..],
        );
        self.written = self.params.len();
        let mut enc = device.create_command_encoder(&Default::default());
        match &self.profiler {
            None => {
                let mut pass = enc.begin_compute_pass(&Default::default());
                for d in &self.dispatches {
                    pass.set_pipeline(&d.pipeline);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.grid[0], d.grid[1], d.grid[2]);
                }
            }
            Some(p) => {
                for (i, d) in self.dispatches.iter().enumerate() {
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                            query_set: &p.queries,
                            beginning_of_pass_write_index: Some(2 * i as u32),
                            end_of_pass_write_index: Some(2 * i as u32 + 1),
                        }),
                    });
                    pass.set_pipeline(&d.pipeline);
                    pass.set_bind_group(0, &d.bind_group, &[]);
                    pass.dispatch_workgroups(d.grid[0], d.grid[1], d.grid[2]);
                }
                let n = 2 * self.dispatches.len() as u32;
                enc.resolve_query_set(&p.queries, 0..n, &p.resolved, 0);
                enc.copy_buffer_to_buffer(&p.resolved, 0, &p.readback, 0, 8 * n as u64);
            }
        }
        if let Some((src, dst, bytes)) = copy {
            enc.copy_buffer_to_buffer(src, 0, dst, 0, bytes);
        }
        queue.submit([enc.finish()]);
        self.submit_at = (2 * self.submit_at).min(SUBMIT_EVERY);
        let dispatches = std::mem::take(&mut self.dispatches);
        if let Some(p) = &mut self.profiler {
            let bytes = 8 * 2 * dispatches.len() as u64;
            let (tx, rx) = mpsc::channel();
            p.readback
                .map_async(wgpu::MapMode::Read, ..bytes, move |r| {
                    let _ = tx.send(r);
                });
            device
                .poll(wgpu::PollType::wait_indefinitely())
                .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
            rx.recv()?
                .map_err(|e| anyhow!("wgpu: reading the op profile back: {e}"))?;
            let ticks: Vec<u64> =
                bytemuck::pod_collect_to_vec(&p.readback.get_mapped_range(..bytes)?);
            p.readback.unmap();
            let ns_per_tick = f64::from(queue.get_timestamp_period());
            for (d, t) in dispatches.iter().zip(ticks.chunks_exact(2)) {
                let e = p
                    .totals
                    .entry(d.op.clone().unwrap_or_default())
                    .or_default();
                e.0 += 1;
                e.1 += t[1].saturating_sub(t[0]) as f64 * ns_per_tick * 1e-6;
            }
        }
        // The list's allocation is kept for the next pass.
        self.dispatches = dispatches;
        self.dispatches.clear();
        if self.profiler.is_some() {
            self.idle();
        }
        Ok(())
    }
}
