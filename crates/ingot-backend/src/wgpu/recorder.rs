//! The ops of a step as a list of dispatches, sent to the GPU as one compute pass.
//!
//! Each dispatch's small uniform block (sizes, offsets, eps) takes one slot of a params
//! arena, written with one queue write just before the pass is submitted; wgpu orders the
//! dispatches of a pass by the buffers they read and write.

const PARAM_BYTES: usize = 64;
/// Dispatches one pass may hold before it is sent.
const MAX_DISPATCHES: usize = 4096;

struct Dispatch {
    pipeline: wgpu::ComputePipeline,
    bind_group: wgpu::BindGroup,
    grid: [u32; 3],
}

pub struct Recorder {
    arena: wgpu::Buffer,
    /// Bytes between the params of consecutive dispatches (the offset alignment).
    stride: usize,
    params: Vec<u8>,
    dispatches: Vec<Dispatch>,
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
            dispatches: Vec::with_capacity(MAX_DISPATCHES),
        }
    }

    pub fn is_full(&self) -> bool {
        self.dispatches.len() == MAX_DISPATCHES
    }

    /// Adds a dispatch of `pipeline` over `grid` with `params` (at most 16 words) at
    /// binding 0 and `buffers` at theirs.
    pub fn record(
        &mut self,
        device: &wgpu::Device,
        pipeline: wgpu::ComputePipeline,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        grid: [u32; 3],
    ) {
        assert!(!self.is_full(), "flush a full recorder first");
        assert!(params.len() * 4 <= PARAM_BYTES, "too many params");
        let offset = self.params.len();
        self.params
            .extend(params.iter().flat_map(|w| w.to_le_bytes()));
        self.params.resize(offset + self.stride, 0);
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.arena,
                offset: offset as u64,
                size: wgpu::BufferSize::new(PARAM_BYTES as u64),
            }),
        }];
        entries.extend(buffers.iter().map(|&(binding, b)| wgpu::BindGroupEntry {
            binding,
            resource: b.as_entire_binding(),
        }));
        let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        self.dispatches.push(Dispatch {
            pipeline,
            bind_group,
            grid,
        });
    }

    /// Sends the recorded dispatches as one compute pass.
    pub fn flush(&mut self, device: &wgpu::Device, queue: &wgpu::Queue) {
        if self.dispatches.is_empty() {
            return;
        }
        queue.write_buffer(&self.arena, 0, &self.params);
        let mut enc = device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for d in &self.dispatches {
                pass.set_pipeline(&d.pipeline);
                pass.set_bind_group(0, &d.bind_group, &[]);
                pass.dispatch_workgroups(d.grid[0], d.grid[1], d.grid[2]);
            }
        }
        queue.submit([enc.finish()]);
        self.dispatches.clear();
        self.params.clear();
    }
}
