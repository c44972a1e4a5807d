//! The wgpu backend: WGSL compute kernels that wgpu runs through Metal on macOS and Vulkan
//! elsewhere (and on Mesa's lavapipe, a CPU Vulkan, in CI).
//!
//! Activations run in f32 (the ops that bound a step read weights and the KV cache, which
//! keep 16-bit formats); matrices are kept as f32, f16, bf16 or GGUF Q8_0, Q4_0, Q4_1, Q4_K,
//! Q5_K or Q6_K blocks or FP8 ones that the shaders dequantize (every block format ingot
//! reads); the KV
//! cache may be f32, f16 or bf16. Ops are recorded, not run: each
//! adds a dispatch to the step's list, which goes to the GPU in compute passes of a few
//! dozen dispatches as it grows, and at once when the host needs a result (a download, an
//! upload that must not overtake the recorded ops, or a synchronize).

mod recorder;
pub mod shader;

use crate::{
    AttentionMetadata, Backend, CacheLayout, DType, MatmulOut, MlpScratch, MoeShape, QkvLayout,
    RopeKvWrite,
};
use anyhow::{anyhow, bail, ensure, Context, Result};
use recorder::Recorder;
use shader::{Features, Kernel, WG};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};

/// Most rows a matmul runs through the GEMV kernel (the kernel's GEMV_ROWS).
const GEMV_MAX_ROWS: usize = 8;
/// Most rows a matmul runs through the wide GEMV, 8 rows per dispatch: each dispatch
/// reads the weights again, which costs less than the tiled GEMM up to here.
const GEMV_CHUNKED_ROWS: usize = 64;
/// Vectors of 4 per thread that `add_rms_norm_wide` holds (`WIDE_VECS` in norm.wgsl).
const NORM_WIDE_VECS: usize = 8;
/// Output columns of one GEMV workgroup (the kernel's GEMV_COLS).
const GEMV_COLS: usize = 32;
/// Most parts the context of a decode row is split into (the decode kernel's max_splits).
const DECODE_SPLITS: usize = 32;
// decode_reduce holds a sequence's split maxima and sums in arrays of 64.
const _: () = assert!(DECODE_SPLITS <= 64);
/// Query rows of one workgroup of the prefill attention kernel (its Q_TILE).
const PREFILL_ROWS: usize = 16;
/// Workgroups along x of a dispatch; more go to y (the limit is 65535 per dimension).
const GRID_X: u32 = 32768;
/// Bytes uploaded between waits for the device. wgpu stages every write in new
/// host-visible memory, held until the submission that copies it has completed: without
/// waits, loading a model staged all of its weights at once (on lavapipe, Qwen2-0.5B's
/// 0.9 GiB of f16 weights peaked at 2.1 GB resident, 1.7 GB with waits).
const UPLOAD_WAIT_BYTES: usize = 256 << 20;

/// Which adapter features the backend may use: all on unless switched off to test the
/// paths without them (`INGOT_WGPU_DISABLE=shader-f16,subgroup,cooperative-matrix` on the
/// command line).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub shader_f16: bool,
    pub subgroup: bool,
    pub cooperative_matrix: CooperativeMatrices,
    /// A lower storage-binding limit than the adapter's, in bytes
    /// (`INGOT_WGPU_MAX_BINDING`): to see how a model splits, or fits, on a device with a
    /// smaller one.
    pub max_binding: Option<u64>,
    /// A lower workgroup-memory limit than the adapter's, in bytes
    /// (`INGOT_WGPU_MAX_WORKGROUP_MEMORY`): Apple GPUs give kernels 32 KiB, where decode
    /// attention takes smaller key tiles; this runs those tiles on any adapter.
    pub max_workgroup_memory: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            shader_f16: true,
            subgroup: true,
            cooperative_matrix: CooperativeMatrices::Auto,
            max_binding: None,
            max_workgroup_memory: None,
        }
    }
}

impl Options {
    /// The defaults less what `INGOT_WGPU_DISABLE` (a comma-separated list) names.
    pub fn from_env() -> Result<Options> {
        let mut o = Options::default();
        if let Ok(list) = std::env::var("INGOT_WGPU_DISABLE") {
            for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match name {
                    "shader-f16" => o.shader_f16 = false,
                    "subgroup" => o.subgroup = false,
                    "cooperative-matrix" => o.cooperative_matrix = CooperativeMatrices::Off,
                    other => bail!(
                        "INGOT_WGPU_DISABLE: unknown feature `{other}` (expected shader-f16, \
                         subgroup, cooperative-matrix)"
                    ),
                }
            }
        }
        if let Ok(v) = std::env::var("INGOT_WGPU_COOPERATIVE_MATRIX") {
            o.cooperative_matrix = match v.trim() {
                "1" => CooperativeMatrices::On,
                "0" => CooperativeMatrices::Off,
                other => bail!("INGOT_WGPU_COOPERATIVE_MATRIX: `{other}` is not 0 or 1"),
            };
        }
        if let Ok(v) = std::env::var("INGOT_WGPU_MAX_WORKGROUP_MEMORY") {
            let bytes = v.trim().parse::<u32>().ok().filter(|&b| b > 0);
            o.max_workgroup_memory = Some(bytes.with_context(|| {
                format!("INGOT_WGPU_MAX_WORKGROUP_MEMORY: `{v}` is not a positive number of bytes")
            })?);
        }
        if let Ok(v) = std::env::var("INGOT_WGPU_MAX_BINDING") {
            let bytes = v.trim().parse::<u64>().ok().filter(|&b| b > 0);
            o.max_binding = Some(bytes.with_context(|| {
                format!("INGOT_WGPU_MAX_BINDING: `{v}` is not a positive number of bytes")
            })?);
        }
        Ok(o)
    }
}

/// Whether products run on cooperative matrices where the adapter has them
/// (`INGOT_WGPU_COOPERATIVE_MATRIX=0|1`; unset: Auto).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CooperativeMatrices {
    Off,
    /// On GPUs; off on CPU implementations, which emulate them in scalar code (lavapipe,
    /// 2-core VM, SmolLM2 Q4_1 prefill of 256 tokens: 44.9-46.9 tok/s on them against
    /// 59.4-61.4 without).
    Auto,
    /// Wherever offered, and an error where not.
    On,
}

/// A device buffer and what it holds.
pub struct WgpuBuffer {
    buf: wgpu::Buffer,
    dtype: DType,
    numel: usize,
}

impl WgpuBuffer {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }
}

/// The adapters wgpu finds, most preferred first: discrete GPUs, integrated ones, virtual
/// ones, then CPU implementations.
pub fn adapters() -> Vec<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let mut all = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::PRIMARY));
    all.sort_by_key(|a| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    });
    all
}

/// The cooperative-matrix configuration the products take on `adapter`: square fragments
/// with f16 inputs and f32 sums, 16 x 16 where offered (NVIDIA), else 8 x 8 (Metal's
/// simdgroup matrices, lavapipe), on an adapter whose subgroups have one size (the kernels
/// lay their tiles out by subgroup); why not where it has no such configuration.
fn cooperative_matrix(adapter: &wgpu::Adapter) -> Result<shader::CooperativeMatrix, String> {
    if !adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return Err("it offers no cooperative matrices".into());
    }
    let info = adapter.get_info();
    let configs = adapter.cooperative_matrix_properties();
    tracing::debug!(
        "{}: cooperative matrix configurations {configs:?}",
        info.name
    );
    if info.subgroup_min_size != info.subgroup_max_size {
        return Err(format!(
            "its subgroups have {} to {} threads",
            info.subgroup_min_size, info.subgroup_max_size
        ));
    }
    let side = [16, 8].into_iter().find(|&side| {
        configs.iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (side, side, side)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
    });
    let side = side.ok_or("it has no square 8 or 16 fragments of f16 inputs and f32 sums")?;
    Ok(shader::CooperativeMatrix {
        side,
        subgroup_size: info.subgroup_max_size,
    })
}

/// A kernel's entry point in one dtype variant with values for its override constants.
type PipelineKey = (&'static str, &'static str, DType, Vec<(&'static str, u32)>);

pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    features: Features,
    limits: wgpu::Limits,
    name: String,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    /// Whether the adapter is a CPU implementation (lavapipe).
    cpu_adapter: bool,
    recorder: Mutex<Recorder>,
    /// Bound where a kernel's optional input is absent (a matmul without bias).
    dummy: wgpu::Buffer,
    /// Reused for downloads, grown as needed.
    staging: Mutex<Option<wgpu::Buffer>>,
    /// The partial sums of split-k products on cooperative matrices, grown as needed.
    partials: Mutex<Option<wgpu::Buffer>>,
    /// Bytes written by uploads since the device was last waited for.
    unwaited_upload: AtomicUsize,
}

impl WgpuBackend {
    /// Opens adapter `ordinal` of [`adapters`] with what `options` allows of its features.
    pub fn new(ordinal: usize, options: Options) -> Result<WgpuBackend> {
        let all = adapters();
        let adapter = all.get(ordinal).cloned().ok_or_else(|| {
            anyhow!(
                "no wgpu adapter {ordinal}: {} found{}",
                all.len(),
                if all.is_empty() {
                    " (is a Vulkan driver installed? On Debian: apt-get install mesa-vulkan-drivers)"
                } else {
                    ""
                }
            )
        })?;
        let info = adapter.get_info();
        let offered = adapter.features();
        let shader_f16 = options.shader_f16 && offered.contains(wgpu::Features::SHADER_F16);
        let subgroup = options.subgroup && offered.contains(wgpu::Features::SUBGROUP);
        let usable = if shader_f16 && subgroup {
            cooperative_matrix(&adapter)
        } else {
            Err("the kernels on them need shader-f16 and subgroups".into())
        };
        let cpu_adapter = info.device_type == wgpu::DeviceType::Cpu;
        let cooperative_matrix = match (options.cooperative_matrix, usable) {
            (CooperativeMatrices::Off, _) => None,
            (CooperativeMatrices::On, Err(why)) => bail!(
                "adapter {}: INGOT_WGPU_COOPERATIVE_MATRIX=1 asks for cooperative matrices, \
                 but {why}",
                info.name
            ),
            (CooperativeMatrices::Auto, Ok(_)) if cpu_adapter => {
                tracing::info!(
                    "{}: a CPU implementation emulates cooperative matrices (slower than \
                     the f32 products); off unless INGOT_WGPU_COOPERATIVE_MATRIX=1",
                    info.name
                );
                None
            }
            (_, Ok(c)) => Some(c),
            (CooperativeMatrices::Auto, Err(_)) => None,
        };
        let features = Features {
            shader_f16,
            subgroup,
            cooperative_matrix,
        };
        let mut required = wgpu::Features::empty();
        required.set(wgpu::Features::SHADER_F16, features.shader_f16);
        required.set(wgpu::Features::SUBGROUP, features.subgroup);
        required.set(
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            features.cooperative_matrix.is_some(),
        );
        // For the op profile only.
        required.set(
            wgpu::Features::TIMESTAMP_QUERY,
            offered.contains(wgpu::Features::TIMESTAMP_QUERY),
        );
        let mut limits = adapter.limits();
        // Asked of the device as its limit; decode attention sizes its tiles to it.
        if let Some(max) = options.max_workgroup_memory {
            limits.max_compute_workgroup_storage_size =
                limits.max_compute_workgroup_storage_size.min(max);
        }
        ensure!(
            limits.max_compute_workgroup_storage_size >= shader::MIN_WORKGROUP_MEMORY,
            "adapter {} gives a workgroup {} bytes of memory; the kernels need {}",
            info.name,
            limits.max_compute_workgroup_storage_size,
            shader::MIN_WORKGROUP_MEMORY
        );
        ensure!(
            adapter
                .get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32),
            "adapter {} cannot pack f16 pairs in shaders (SHADER_F16_IN_F32)",
            info.name
        );
        ensure!(
            limits.max_compute_invocations_per_workgroup >= WG
                && limits.max_compute_workgroup_size_x >= WG,
            "adapter {} runs at most {} threads per workgroup; the kernels need {WG}",
            info.name,
            limits.max_compute_invocations_per_workgroup
        );
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("ingot"),
            required_features: required,
            required_limits: limits.clone(),
            // SAFETY: wgpu marks cooperative matrices experimental (its WGSL and their
            // translation may change); the kernels that use them pass the conformance
            // suite on each adapter kind against the CPU, as every kernel does.
            experimental_features: if features.cooperative_matrix.is_some() {
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            ..Default::default()
        }))
        .with_context(|| format!("opening wgpu adapter {}", info.name))?;
        if let Some(max) = options.max_binding {
            limits.max_storage_buffer_binding_size =
                limits.max_storage_buffer_binding_size.min(max);
        }
        let name = format!(
            "wgpu {} ({:?}, {:?})",
            info.name, info.backend, info.device_type
        );
        tracing::info!(
            "{name}: max buffer {} MiB, max storage binding {} MiB, workgroup memory {} KiB; \
             shader-f16 {}, subgroups {}, cooperative matrices {}",
            limits.max_buffer_size >> 20,
            limits.max_storage_buffer_binding_size >> 20,
            limits.max_compute_workgroup_storage_size >> 10,
            if features.shader_f16 {
                "on"
            } else {
                "off (packed pairs)"
            },
            if features.subgroup {
                "on"
            } else {
                "off (workgroup memory)"
            },
            match features.cooperative_matrix {
                Some(c) => format!(
                    "{0}x{0} f16 -> f32 fragments, subgroups of {1}",
                    c.side, c.subgroup_size
                ),
                None => "off (f32 products)".into(),
            },
        );
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let recorder = Recorder::new(&device, &limits);
        Ok(WgpuBackend {
            device,
            queue,
            features,
            limits,
            name,
            pipelines: Mutex::new(HashMap::new()),
            cpu_adapter,
            recorder: Mutex::new(recorder),
            dummy,
            staging: Mutex::new(None),
            partials: Mutex::new(None),
            unwaited_upload: AtomicUsize::new(0),
        })
    }

    /// The shader features this backend runs with.
    pub fn features(&self) -> Features {
        self.features
    }

    /// The cooperative-matrix configuration an `m`-row product of `k` with `weights`
    /// runs on, if it does ([`cooperative_product_inputs`]): past GEMV_MAX_ROWS rows.
    fn cooperative_product(
        &self,
        m: usize,
        k: usize,
        weights: DType,
    ) -> Option<shader::CooperativeMatrix> {
        self.features
            .cooperative_matrix
            .filter(|_| cooperative_product_inputs(m, k, weights) == DType::F16)
    }

    /// Whether `gemv_wide` takes a product of `m` rows of `k` with `weights`: decode steps
    /// (GEMV_CHUNKED_ROWS rows at most) that do not run on cooperative matrices, k a
    /// multiple of 8 (16-byte loads).
    fn takes_wide_gemv(&self, m: usize, k: usize, weights: DType) -> bool {
        m <= GEMV_CHUNKED_ROWS
            && k.is_multiple_of(8)
            && self.cooperative_product(m, k, weights).is_none()
    }

    /// Rows up to which a decode row's product is bitwise the same alone and in a batch
    /// (k a multiple of 8): the GEMVs' rows. Past GEMV_MAX_ROWS, products with 16-bit and
    /// block weights on cooperative matrices round x to f16 and sum in the matrix units'
    /// order, as tensor-core products on CUDA do.
    pub fn batch_invariant_rows(&self) -> usize {
        if self.features.cooperative_matrix.is_some() {
            GEMV_MAX_ROWS
        } else {
            GEMV_CHUNKED_ROWS
        }
    }

    /// `x · wᵀ` (+ bias, or added to `out` with `add_out`) on cooperative matrices `c`:
    /// gemm_coop over the tiles of [`CoopTiles::for_rows`], with k split where they are
    /// few, then gemm_coop_reduce over the runs' partial sums.
    #[allow(clippy::too_many_arguments)]
    fn coop_product(
        &self,
        c: shader::CooperativeMatrix,
        x: &WgpuBuffer,
        w: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        (m, n, k): (usize, usize, usize),
        out: &WgpuBuffer,
        (ld, col): (usize, usize),
        add_out: bool,
    ) {
        let t = CoopTiles::for_rows(c, m);
        let splits = t.splits(c, m, n, k);
        let p = words(&[m, n, k, ld, col, bias.is_some() as usize]);
        // Bound without a split too (the kernel names it), though not written then: any
        // size does.
        let partials = self.partials(if splits > 1 { splits * m * n } else { 1 });
        let bias = bias.map_or(&self.dummy, |b| &b.buf);
        let buffers = [
            (5, &x.buf),
            (6, &w.buf),
            (3, bias),
            (4, &out.buf),
            (7, &partials),
        ];
        let constants = [&t.constants(c)[..], &[("ADD_OUT", u32::from(add_out))]].concat();
        let pipeline = self.pipeline(&shader::MATMUL_COOP, "gemm_coop", w.dtype, &constants);
        let tiles = [
            n.div_ceil(t.cols()) as u32,
            m.div_ceil(t.rows(c)) as u32,
            splits as u32,
        ];
        let add = if add_out { "_add" } else { "" };
        self.record(pipeline, &p, &buffers, tiles, || {
            let (side, dtype) = (c.side, w.dtype);
            format!("gemm_coop{add} {dtype} n={n} k={k} {side}x{side} splits={splits}")
        });
        if splits > 1 {
            let constants = [
                ("COOP_SPLITS", splits as u32),
                ("ADD_OUT", u32::from(add_out)),
            ];
            let pipeline = self.pipeline(
                &shader::MATMUL_COOP,
                "gemm_coop_reduce",
                w.dtype,
                &constants,
            );
            let groups = grid((m * n).div_ceil(WG as usize));
            let buffers = [(3, bias), (4, &out.buf), (7, &partials)];
            self.record(pipeline, &p, &buffers, groups, || {
                format!("gemm_coop_reduce{add} n={n} splits={splits}")
            });
        }
    }

    /// The buffer of split-k partial sums, at least `floats` long: 16 MiB at most, since k
    /// splits only where there are fewer than COOP_SPLIT_WORKGROUPS tiles (of at most 64 x
    /// 128 outputs) and then into fewer than 2 * COOP_SPLIT_WORKGROUPS workgroups.
    fn partials(&self, floats: usize) -> wgpu::Buffer {
        let mut partials = self.partials.lock().unwrap();
        let size = (floats * 4) as u64;
        self.grown(
            &mut partials,
            "split-k partials",
            size,
            wgpu::BufferUsages::STORAGE,
        )
        .clone()
    }

    /// The buffer in `slot`, replaced by one of `size` bytes where it is missing or
    /// smaller (the reused staging and partial-sum buffers).
    fn grown<'a>(
        &self,
        slot: &'a mut Option<wgpu::Buffer>,
        label: &'static str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> &'a wgpu::Buffer {
        if slot.as_ref().is_none_or(|b| b.size() < size) {
            *slot = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation: false,
            }));
        }
        slot.as_ref().unwrap()
    }

    /// The pipeline of `entry` in `kernel`'s `dtype` variant with `constants` for its
    /// override constants, compiled on first use.
    fn pipeline(
        &self,
        kernel: &Kernel,
        entry: &'static str,
        dtype: DType,
        constants: &[(&'static str, u32)],
    ) -> wgpu::ComputePipeline {
        let key = (kernel.file, entry, dtype, constants.to_vec());
        let mut pipelines = self.pipelines.lock().unwrap();
        if let Some(p) = pipelines.get(&key) {
            return p.clone();
        }
        let constants: Vec<(&str, f64)> =
            constants.iter().map(|&(k, v)| (k, f64::from(v))).collect();
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(kernel.file),
            source: wgpu::ShaderSource::Wgsl(shader::source(kernel, dtype, self.features).into()),
        };
        // SAFETY: every kernel checks its indices against the sizes it is given, and the
        // host checks those sizes and the indices it uploads (token ids, slots, block
        // tables) as it does for the CUDA kernels. Without per-access bounds checks the
        // loads stay vector loads.
        let module = unsafe {
            self.device
                .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
        };
        let p = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &constants,
                    // Every kernel writes the workgroup memory it reads first.
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        pipelines.insert(key, p.clone());
        p
    }

    /// Records `entry` over `groups` workgroups (spread over x and y), with `params` as
    /// its uniform block (binding 0) and `buffers` at their bindings.
    fn dispatch(
        &self,
        kernel: &Kernel,
        entry: &'static str,
        dtype: DType,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        groups: usize,
    ) {
        if groups == 0 {
            return;
        }
        self.dispatch_grid(kernel, entry, dtype, params, buffers, grid(groups));
    }

    fn dispatch_grid(
        &self,
        kernel: &Kernel,
        entry: &'static str,
        dtype: DType,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        grid: [u32; 3],
    ) {
        let pipeline = self.pipeline(kernel, entry, dtype, &[]);
        self.record(pipeline, params, buffers, grid, || {
            format!("{entry} {dtype}")
        });
    }

    /// Records a dispatch of `pipeline`, counted as `op` in the op profile.
    fn record(
        &self,
        pipeline: wgpu::ComputePipeline,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        grid: [u32; 3],
        op: impl FnOnce() -> String,
    ) {
        self.recorder.lock().unwrap().record(
            &self.device,
            &self.queue,
            pipeline,
            params,
            buffers,
            grid,
            op,
        );
    }

    fn flush(&self) -> Result<()> {
        self.recorder
            .lock()
            .unwrap()
            .flush(&self.device, &self.queue)
    }

    /// Waits until every submission has completed.
    fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("wgpu: waiting for the device: {e}"))?;
        self.unwaited_upload.store(0, Ordering::Relaxed);
        self.recorder.lock().unwrap().idle();
        Ok(())
    }

    /// The first `bytes` bytes of `src`, after every recorded op has run.
    fn read_bytes(&self, src: &wgpu::Buffer, bytes: usize) -> Result<Vec<u8>> {
        let size = (bytes.div_ceil(4) * 4) as u64;
        if size == 0 {
            return self.flush().map(|()| vec![]);
        }
        let mut staging = self.staging.lock().unwrap();
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        let staging = self.grown(&mut staging, "staging", size.next_power_of_two(), usage);
        // The copy goes in the submission of the step's last dispatches: one wait.
        self.recorder.lock().unwrap().flush_and_copy(
            &self.device,
            &self.queue,
            src,
            staging,
            size,
        )?;
        let (tx, rx) = mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()?
            .map_err(|e| anyhow!("wgpu: reading a buffer back: {e}"))?;
        let out = staging.get_mapped_range(..size)?.to_vec();
        staging.unmap();
        Ok(out[..bytes].to_vec())
    }

    /// Threads per output column of the wide GEMV over rows of `k` weights (a multiple of
    /// 8). A GPU hides memory latency with as many loads in flight as it can hold: 64,
    /// or fewer where that would leave a thread less than 4 pieces of 8 weights. CPU
    /// implementations run a workgroup as one SIMD loop, best over few long lanes: 4.
    fn gemv_lanes(&self, k: usize) -> u32 {
        if self.cpu_adapter {
            return 4;
        }
        (1u32 << (k / 8 / 4).max(1).ilog2()).clamp(4, 64)
    }

    /// Records `gemv_wide` over the rows of `p` (matmul's parameters), GEMV_MAX_ROWS at a
    /// time, with the shader's `epilogue` options.
    fn gemv_wide(
        &self,
        p: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        w: DType,
        epilogue: GemvEpilogue,
        op: impl Fn() -> String,
    ) {
        let entry = (&shader::MATMUL, "gemv_wide");
        self.gemv_wide_entry(entry, p, &[], buffers, w, epilogue, op);
    }

    /// [`WgpuBackend::gemv_wide`] through `entry` (the plain GEMV or one with its own
    /// epilogue), with `tail` after the params it adds (row0, eps).
    #[allow(clippy::too_many_arguments)]
    fn gemv_wide_entry(
        &self,
        (kernel, entry): (&Kernel, &'static str),
        p: &[u32],
        tail: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        w: DType,
        epilogue: GemvEpilogue,
        op: impl Fn() -> String,
    ) {
        let (m, n, k) = (p[0] as usize, p[1] as usize, p[2] as usize);
        let lanes = self.gemv_lanes(k);
        let pipeline = |rows: usize| {
            let constants = [
                ("WIDE_LANES", lanes),
                ("SILU_MUL", u32::from(epilogue.silu_mul)),
                ("NORM_X", u32::from(epilogue.norm_eps.is_some())),
                ("ADD_OUT", u32::from(epilogue.add_out)),
                ("ONE_ROW", u32::from(rows == 1)),
            ];
            self.pipeline(kernel, entry, w, &constants)
        };
        // A workgroup takes WG / lanes columns of each of its two column sets.
        let cols = (WG / lanes) as usize * if epilogue.silu_mul { 1 } else { 2 };
        for row0 in (0..m).step_by(GEMV_MAX_ROWS) {
            let rows = (m - row0).min(GEMV_MAX_ROWS);
            let mut p = p.to_vec();
            p[0] = rows as u32;
            p.push(row0 as u32);
            p.push(epilogue.norm_eps.unwrap_or(0.0).to_bits());
            p.extend_from_slice(tail);
            self.record(pipeline(rows), &p, buffers, grid(n.div_ceil(cols)), || {
                format!("{} lanes={lanes}", op())
            });
        }
    }

    /// `gemv_wide` of x (f32) times `w` into rows of `out` (f32) `ld` apart from column
    /// `col`, with `epilogue`; `n` output columns (the ffn width with SiLU·mul). Named in
    /// the op profile by its epilogue.
    #[allow(clippy::too_many_arguments)]
    fn wide_product(
        &self,
        x: &WgpuBuffer,
        w: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        (m, n, k): (usize, usize, usize),
        out: &WgpuBuffer,
        (ld, col): (usize, usize),
        epilogue: GemvEpilogue,
    ) {
        assert_eq!(x.dtype, DType::F32, "matmul reads f32 activations");
        assert_eq!(out.dtype, DType::F32, "matmul writes f32");
        let p = words(&[m, n, k, ld, col, bias.is_some() as usize]);
        let buffers = [
            (5, &x.buf),
            (6, &w.buf),
            (3, bias.map_or(&self.dummy, |b| &b.buf)),
            (4, &out.buf),
        ];
        self.gemv_wide(&p, &buffers, w.dtype, epilogue, || {
            let norm = if epilogue.norm_eps.is_some() {
                "_rms_norm"
            } else {
                ""
            };
            let silu = if epilogue.silu_mul { "_silu_mul" } else { "" };
            let add = if epilogue.add_out { "_add" } else { "" };
            format!("gemv_wide{norm}{silu}{add} {} n={n} k={k}", w.dtype)
        });
    }

    /// The largest buffer a kernel may bind: both limits apply to every buffer here.
    fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    fn check_binding(&self, bytes: u64) -> Result<()> {
        let max = self.max_binding();
        ensure!(
            bytes <= max,
            "a buffer of {bytes} bytes exceeds this adapter's limit of {max} bytes per buffer \
             (max_storage_buffer_binding_size {}, max_buffer_size {})",
            self.limits.max_storage_buffer_binding_size,
            self.limits.max_buffer_size
        );
        Ok(())
    }
}

/// The dtype the inputs of an `m`-row product of `k` with `weights` are rounded to on
/// cooperative matrices: f16 for 16-bit and block weights in products past the one-pass
/// GEMV's rows (batched decode and prefill), with k whole pieces of 8; f32 (as given)
/// otherwise. f32 weights keep f32 products, so an f32 model still compares exactly with
/// the CPU's.
pub fn cooperative_product_inputs(m: usize, k: usize, weights: DType) -> DType {
    if m > GEMV_MAX_ROWS && k.is_multiple_of(8) && weights != DType::F32 {
        DType::F16
    } else {
        DType::F32
    }
}

/// Whether prefill attention runs on cooperative matrices (`prefill_coop`) where the
/// adapter has them: a 16-bit cache (an f32 one keeps f32 products, for exact
/// comparisons) and head_dim a multiple of 16 up to 128 (the kernel's tiles).
fn takes_coop_prefill(head_dim: usize, cache: DType) -> bool {
    matches!(cache, DType::F16 | DType::BF16) && head_dim <= 128 && head_dim.is_multiple_of(16)
}

/// How `gemm_coop` lays out a workgroup (its override constants): COOP_WM x COOP_WN
/// subgroups, each COOP_FR fragments of rows by 32 columns.
#[derive(Clone, Copy, Debug)]
struct CoopTiles {
    wm: u32,
    wn: u32,
    fr: u32,
}

/// Workgroups a split-k product of few rows aims for, so that a decode batch's product
/// of a 4096-wide output (32 tiles of 128 columns) keeps a GPU's cores busy: 8 runs of k
/// for it, 2 for a 28,672-wide gate/up product. Unmeasured on a GPU: a first figure.
const COOP_SPLIT_WORKGROUPS: usize = 256;
/// Fewest k steps (of gemm_coop's 32) in a run of a split-k product.
const COOP_MIN_RUN_STEPS: usize = 4;

impl CoopTiles {
    /// The tiles of an `m`-row product: up to GEMV_CHUNKED_ROWS (decode batches), one row of
    /// 16 x 32 subgroup tiles as tall as `m` needs, 128 columns; past it 64 x 128 outputs
    /// a workgroup, 2 x 4 subgroups of 32 x 32. Both within the kernel's limits of 64 rows,
    /// 128 columns and 16 fragments a subgroup; unmeasured on a GPU.
    fn for_rows(c: shader::CooperativeMatrix, m: usize) -> CoopTiles {
        if m <= GEMV_CHUNKED_ROWS {
            CoopTiles {
                wm: 16 / c.side,
                wn: 4,
                fr: m.div_ceil(16) as u32,
            }
        } else {
            CoopTiles {
                wm: 2,
                wn: 4,
                fr: 32 / c.side,
            }
        }
    }

    fn rows(self, c: shader::CooperativeMatrix) -> usize {
        (self.wm * self.fr * c.side) as usize
    }

    fn cols(self) -> usize {
        self.wn as usize * 32
    }

    /// Runs of k an (m, n, k) product takes: one where its tiles fill the GPU, else as
    /// many as bring them to COOP_SPLIT_WORKGROUPS, each of COOP_MIN_RUN_STEPS steps at
    /// least.
    fn splits(self, c: shader::CooperativeMatrix, m: usize, n: usize, k: usize) -> usize {
        let tiles = n.div_ceil(self.cols()) * m.div_ceil(self.rows(c));
        let most = k.div_ceil(32 * COOP_MIN_RUN_STEPS);
        COOP_SPLIT_WORKGROUPS.div_ceil(tiles).clamp(1, most.max(1))
    }

    fn constants(self, c: shader::CooperativeMatrix) -> [(&'static str, u32); 4] {
        [
            ("COOP_SG", c.subgroup_size),
            ("COOP_WM", self.wm),
            ("COOP_WN", self.wn),
            ("COOP_FR", self.fr),
        ]
    }
}

/// What `gemv_wide` does besides the product (its override constants).
#[derive(Clone, Copy, Default)]
struct GemvEpilogue {
    /// The weights are `[gate; up]`, `p`'s n is the ffn width, the output silu(gate) * up.
    silu_mul: bool,
    /// Each row of x is divided by its root mean square (RMSNorm with this epsilon).
    norm_eps: Option<f32>,
    /// The product is added to the output.
    add_out: bool,
}

/// The GGUF formats whose blocks (an f16 scale and quants) are not word-aligned, so the
/// device stores them in pairs ([`scale_pairs`]).
fn paired(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q6K)
}

/// Where the f16 scale of a [`paired`] format's block starts: first in Q8_0 and Q4_0, last
/// in Q6_K.
fn scale_offset(dtype: DType) -> usize {
    if dtype == DType::Q6K {
        dtype.block_bytes() - 2
    } else {
        0
    }
}

/// Bytes a buffer of `numel` elements of `dtype` takes on the device.
fn stored_bytes(dtype: DType, numel: usize) -> usize {
    if paired(dtype) {
        numel.div_ceil(2 * dtype.block_len()) * 2 * dtype.block_bytes()
    } else {
        dtype.bytes_for(numel)
    }
}

/// GGUF blocks of `block_bytes` (an f16 scale at `scale_at` and quants: Q8_0's 34 and
/// Q4_0's 18 bytes with the scale first, Q6_K's 210 with it last) regrouped in pairs of two
/// blocks that start on 4-byte words: both scales, then each block's other bytes in their
/// order. An odd last block is paired with zeros.
fn scale_pairs(blocks: &[u8], block_bytes: usize, scale_at: usize) -> Result<Vec<u8>> {
    ensure!(
        blocks.len().is_multiple_of(block_bytes),
        "upload of {} bytes is not whole blocks of {block_bytes}",
        blocks.len()
    );
    let zeros = vec![0; block_bytes];
    let mut out = Vec::with_capacity(blocks.len().div_ceil(2 * block_bytes) * 2 * block_bytes);
    for pair in blocks.chunks(2 * block_bytes) {
        let (a, b) = pair.split_at(block_bytes);
        let b = if b.is_empty() { &zeros[..] } else { b };
        let scale = scale_at..scale_at + 2;
        out.extend_from_slice(&a[scale.clone()]);
        out.extend_from_slice(&b[scale]);
        for block in [a, b] {
            out.extend_from_slice(&block[..scale_at]);
            out.extend_from_slice(&block[scale_at + 2..]);
        }
    }
    Ok(out)
}

/// `groups` workgroups spread over x and y (a dimension holds at most 65535).
fn grid(groups: usize) -> [u32; 3] {
    let groups = u32::try_from(groups).expect("dispatch too large");
    if groups <= GRID_X {
        [groups, 1, 1]
    } else {
        [GRID_X, groups.div_ceil(GRID_X), 1]
    }
}

/// moe.wgsl's parameters: the shape, a flag (moe_route's `renormalize`, moe_combine's
/// `add`), `n` outputs, and where moe_down's outputs start.
fn moe_params(shape: MoeShape, flag: bool, n: usize, y_off: usize) -> Vec<u32> {
    words(&[
        shape.rows,
        shape.experts,
        shape.experts_per_token,
        shape.dim,
        shape.ffn,
        flag as usize,
        n,
        y_off,
    ])
}

fn words(v: &[usize]) -> Vec<u32> {
    v.iter()
        .map(|&x| u32::try_from(x).expect("size exceeds u32"))
        .collect()
}

impl Backend for WgpuBackend {
    type Buffer = WgpuBuffer;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn activation_dtype(&self, _weights: DType) -> DType {
        DType::F32
    }

    /// Matrices keep f32/f16/bf16 and the GGUF blocks the shaders dequantize
    /// ([`shader::BLOCKS`]); any other block format becomes f16 at load.
    fn weight_dtype(&self, stored: DType, _activation: DType) -> DType {
        match stored {
            DType::F32 | DType::F16 | DType::BF16 => stored,
            q if shader::BLOCKS.contains(&q) => q,
            _ => DType::F16,
        }
    }

    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
    }

    fn max_buffer_bytes(&self) -> Option<usize> {
        Some(usize::try_from(self.max_binding()).unwrap_or(usize::MAX))
    }

    fn alloc(&self, dtype: DType, numel: usize) -> Result<WgpuBuffer> {
        ensure!(
            !dtype.is_quantized() || shader::BLOCKS.contains(&dtype),
            "the wgpu backend keeps no {dtype} buffers (such weights are converted at load)"
        );
        // Whole 16-byte units, so that copies and 16-bit pairs never run past the end.
        let size = (stored_bytes(dtype, numel).max(1).div_ceil(16) * 16) as u64;
        self.check_binding(size)?;
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Ok(WgpuBuffer { buf, dtype, numel })
    }

    /// Q8_0, Q4_0 and Q6_K come as GGUF blocks and are stored in pairs ([`scale_pairs`]);
    /// every other dtype is stored as it comes.
    fn upload(&self, dst: &mut WgpuBuffer, bytes: &[u8]) -> Result<()> {
        let held = dst.dtype.bytes_for(dst.numel);
        ensure!(
            bytes.len() <= held,
            "upload of {} bytes into a buffer of {held}",
            bytes.len()
        );
        let pairs;
        let (bytes, held) = if paired(dst.dtype) {
            pairs = scale_pairs(bytes, dst.dtype.block_bytes(), scale_offset(dst.dtype))?;
            (&pairs[..], stored_bytes(dst.dtype, dst.numel))
        } else {
            (bytes, held)
        };
        // Queue writes run before the next submission: recorded ops must go first.
        self.flush()?;
        let whole = bytes.len() / 4 * 4;
        for (i, piece) in bytes[..whole].chunks(UPLOAD_WAIT_BYTES).enumerate() {
            let at = (i * UPLOAD_WAIT_BYTES) as u64;
            self.queue.write_buffer(&dst.buf, at, piece);
            let unwaited = self
                .unwaited_upload
                .fetch_add(piece.len(), Ordering::Relaxed);
            if unwaited + piece.len() >= UPLOAD_WAIT_BYTES {
                self.queue.submit([]);
                self.wait()?;
            }
        }
        if whole < bytes.len() {
            // The last partial word: padded with zeros only when it ends the data.
            ensure!(
                bytes.len().div_ceil(4) * 4 >= held,
                "upload of {} bytes ends inside a 4-byte word of held data",
                bytes.len()
            );
            let mut tail = [0u8; 4];
            tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
            self.queue.write_buffer(&dst.buf, whole as u64, &tail);
        }
        Ok(())
    }

    fn download_f32(&self, src: &WgpuBuffer, numel: usize) -> Result<Vec<f32>> {
        ensure!(numel <= src.numel, "download past the buffer's end");
        let bytes = self.read_bytes(&src.buf, src.dtype.bytes_for(numel))?;
        Ok(match src.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec(&bytes),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::I32 => bytemuck::pod_collect_to_vec::<u8, i32>(&bytes)
                .into_iter()
                .map(|v| v as f32)
                .collect(),
            other => bail!("no f32 download of {other} buffers"),
        })
    }

    fn download_i32(&self, src: &WgpuBuffer, n: usize) -> Result<Vec<i32>> {
        ensure!(
            src.dtype == DType::I32,
            "download_i32 of a {} buffer",
            src.dtype
        );
        ensure!(n <= src.numel, "download past the buffer's end");
        Ok(bytemuck::pod_collect_to_vec(
            &self.read_bytes(&src.buf, 4 * n)?,
        ))
    }

    fn start_op_profile(&self) -> Result<()> {
        ensure!(
            self.device
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY),
            "{}: no op profile without the adapter feature TIMESTAMP_QUERY",
            self.name
        );
        let mut rec = self.recorder.lock().unwrap();
        rec.flush(&self.device, &self.queue)?;
        rec.start_profile(&self.device);
        Ok(())
    }

    fn op_profile(&self) -> Vec<(String, u64, f64)> {
        self.recorder.lock().unwrap().profile()
    }

    fn synchronize(&self) -> Result<()> {
        self.flush()?;
        self.wait()
    }

    fn embedding(
        &self,
        table: &WgpuBuffer,
        ids: &WgpuBuffer,
        n: usize,
        dim: usize,
        vocab_rows: std::ops::Range<usize>,
        out: &mut WgpuBuffer,
    ) {
        assert_eq!(out.dtype, DType::F32);
        assert!(
            vocab_rows.len() * dim <= table.numel,
            "embedding table too small"
        );
        self.dispatch(
            &shader::EMBEDDING,
            "embedding",
            table.dtype,
            &words(&[n, dim, vocab_rows.start, vocab_rows.len()]),
            &[(1, &table.buf), (2, &ids.buf), (3, &out.buf)],
            (n * dim).div_ceil(WG as usize),
        );
    }

    fn rms_norm(
        &self,
        x: &WgpuBuffer,
        weight: &WgpuBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut WgpuBuffer,
    ) {
        let p = [rows as u32, dim as u32, eps.to_bits()];
        self.dispatch(
            &shader::NORM,
            "rms_norm",
            DType::F32,
            &p,
            &[(1, &x.buf), (2, &weight.buf), (3, &out.buf)],
            rows,
        );
    }

    fn add_rms_norm(
        &self,
        residual: &mut WgpuBuffer,
        x: &WgpuBuffer,
        weight: &WgpuBuffer,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &mut WgpuBuffer,
    ) {
        let p = [rows as u32, dim as u32, eps.to_bits()];
        // Rows of whole vectors that a workgroup holds in registers take the wide kernel.
        let (entry, bindings) = if dim.is_multiple_of(4) && dim <= 4 * NORM_WIDE_VECS * WG as usize
        {
            ("add_rms_norm_wide", [6, 7, 8, 9])
        } else {
            ("add_rms_norm", [1, 2, 3, 4])
        };
        self.dispatch(
            &shader::NORM,
            entry,
            DType::F32,
            &p,
            &[
                (bindings[0], &x.buf),
                (bindings[1], &weight.buf),
                (bindings[2], &out.buf),
                (bindings[3], &residual.buf),
            ],
            rows,
        );
    }

    fn matmul(
        &self,
        x: &WgpuBuffer,
        w: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        m: usize,
        n: usize,
        k: usize,
        out: MatmulOut<'_, Self>,
    ) {
        assert_eq!(x.dtype, DType::F32, "matmul reads f32 activations");
        assert_eq!(out.buf.dtype, DType::F32, "matmul writes f32");
        let p = words(&[
            m,
            n,
            k,
            out.row_stride,
            out.col_offset,
            bias.is_some() as usize,
        ]);
        let buffers = [
            (1, &x.buf),
            (2, &w.buf),
            (3, bias.map_or(&self.dummy, |b| &b.buf)),
            (4, &out.buf.buf),
        ];
        let op = |entry: &str| format!("{entry} {} n={n} k={k}", w.dtype);
        // The kernels for k a multiple of 8 read x and w through their 16-byte bindings.
        let wide = [
            (5, &x.buf),
            (6, &w.buf),
            (3, bias.map_or(&self.dummy, |b| &b.buf)),
            (4, &out.buf.buf),
        ];
        let at = (out.row_stride, out.col_offset);
        if self.takes_wide_gemv(m, k, w.dtype) {
            self.wide_product(x, w, bias, (m, n, k), out.buf, at, GemvEpilogue::default());
        } else if let Some(c) = self.cooperative_product(m, k, w.dtype) {
            self.coop_product(c, x, w, bias, (m, n, k), out.buf, at, false);
        } else if m <= GEMV_MAX_ROWS {
            self.dispatch(
                &shader::MATMUL,
                "gemv",
                w.dtype,
                &p,
                &buffers,
                n.div_ceil(GEMV_COLS),
            );
        } else if k.is_multiple_of(8) {
            let grid = [n.div_ceil(128) as u32, m.div_ceil(128) as u32, 1];
            let pipeline = self.pipeline(&shader::MATMUL, "gemm_wide", w.dtype, &[]);
            self.record(pipeline, &p, &wide, grid, || op("gemm_wide"));
        } else {
            let grid = [n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1];
            let pipeline = self.pipeline(&shader::MATMUL, "gemm", w.dtype, &[]);
            self.record(pipeline, &p, &buffers, grid, || op("gemm"));
        }
    }

    /// Decode steps write `silu(gate) * up` from the gate/up GEMV (one dispatch and one
    /// barrier less per layer than a separate `silu_mul`), then run the down product.
    fn gated_mlp(
        &self,
        x: &WgpuBuffer,
        gate_up: &WgpuBuffer,
        down: &WgpuBuffer,
        m: usize,
        k: usize,
        ffn: usize,
        n: usize,
        scratch: MlpScratch<'_, Self>,
        out: MatmulOut<'_, Self>,
    ) {
        if !self.takes_wide_gemv(m, k, gate_up.dtype) {
            return crate::gated_mlp_in_two_products(
                self, x, gate_up, down, m, k, ffn, n, scratch, out,
            );
        }
        let silu = GemvEpilogue {
            silu_mul: true,
            ..GemvEpilogue::default()
        };
        let act = &*scratch.act;
        self.wide_product(x, gate_up, None, (m, ffn, k), act, (ffn, 0), silu);
        self.matmul(scratch.act, down, None, m, n, ffn, out);
    }

    fn folds_norm_weights(&self) -> bool {
        true
    }

    /// Decode steps take the norm in the GEMV's reads of x (no norm kernel, no barrier).
    fn rms_norm_matmul(
        &self,
        x: &WgpuBuffer,
        unit: &WgpuBuffer,
        eps: f32,
        w: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        m: usize,
        n: usize,
        k: usize,
        normed: &mut WgpuBuffer,
        out: MatmulOut<'_, Self>,
    ) {
        if !self.takes_wide_gemv(m, k, w.dtype) {
            return crate::rms_norm_then_matmul(self, x, unit, eps, w, bias, m, n, k, normed, out);
        }
        let normed_x = GemvEpilogue {
            norm_eps: Some(eps),
            ..GemvEpilogue::default()
        };
        let at = (out.row_stride, out.col_offset);
        self.wide_product(x, w, bias, (m, n, k), out.buf, at, normed_x);
    }

    /// Decode steps rotate the query and key heads and write the keys and values to the
    /// cache in the QKV GEMV's epilogue (no `rope_kv_write` dispatch), where the weights
    /// and the cache share a dtype and the rotation covers whole heads.
    fn rms_norm_qkv_rope_kv_write(
        &self,
        x: &WgpuBuffer,
        unit: &WgpuBuffer,
        eps: f32,
        w: &WgpuBuffer,
        bias: Option<&WgpuBuffer>,
        m: usize,
        k: usize,
        normed: &mut WgpuBuffer,
        qkv: &mut WgpuBuffer,
        rope: RopeKvWrite<'_, Self>,
    ) {
        let layout = rope.layout;
        let n = layout.row_len();
        let fused = self.takes_wide_gemv(m, k, w.dtype)
            && rope.rotary_dim == layout.head_dim
            && layout.head_dim.is_multiple_of(4)
            && w.dtype == rope.k_cache.dtype
            && w.dtype.block_len() == 1;
        if !fused {
            return crate::rms_norm_qkv_then_rope_kv_write(
                self, x, unit, eps, w, bias, m, k, normed, qkv, rope,
            );
        }
        assert_eq!(x.dtype, DType::F32, "matmul reads f32 activations");
        assert_eq!(qkv.dtype, DType::F32, "matmul writes f32");
        assert_eq!(rope.k_cache.dtype, rope.v_cache.dtype);
        let p = words(&[m, n, k, n, 0, bias.is_some() as usize]);
        let tail = words(&[layout.num_heads, layout.num_kv_heads, layout.head_dim]);
        let buffers = [
            (5, &x.buf),
            (6, &w.buf),
            (3, bias.map_or(&self.dummy, |b| &b.buf)),
            (4, &qkv.buf),
            (7, &rope.positions.buf),
            (8, &rope.cos_sin.buf),
            (9, &rope.slot_mapping.buf),
            (10, &rope.k_cache.buf),
            (11, &rope.v_cache.buf),
        ];
        let normed_x = GemvEpilogue {
            norm_eps: Some(eps),
            ..GemvEpilogue::default()
        };
        let entry = (&shader::QKV_ROPE, "gemv_wide_rope");
        self.gemv_wide_entry(entry, &p, &tail, &buffers, w.dtype, normed_x, || {
            format!("gemv_wide_rms_norm_rope_kv {} n={n} k={k}", w.dtype)
        });
    }

    /// Decode steps add the product to `acc` in the GEMV's writes.
    fn matmul_add(
        &self,
        x: &WgpuBuffer,
        w: &WgpuBuffer,
        m: usize,
        n: usize,
        k: usize,
        product: &mut WgpuBuffer,
        acc: &mut WgpuBuffer,
    ) {
        if let Some(c) = self.cooperative_product(m, k, w.dtype) {
            return self.coop_product(c, x, w, None, (m, n, k), acc, (n, 0), true);
        }
        if !self.takes_wide_gemv(m, k, w.dtype) {
            return crate::matmul_then_add(self, x, w, m, n, k, product, acc);
        }
        let add = GemvEpilogue {
            add_out: true,
            ..GemvEpilogue::default()
        };
        self.wide_product(x, w, None, (m, n, k), acc, (n, 0), add);
    }

    /// Decode steps run the gate/up GEMV on the residual stream with the norm in its reads
    /// and SiLU·mul in its writes, then the down GEMV adding into the stream: two
    /// dispatches for the norm and the MLP.
    fn rms_norm_gated_mlp_add(
        &self,
        residual: &mut WgpuBuffer,
        unit: &WgpuBuffer,
        eps: f32,
        gate_up: &WgpuBuffer,
        down: &WgpuBuffer,
        m: usize,
        k: usize,
        ffn: usize,
        scratch: MlpScratch<'_, Self>,
        normed: &mut WgpuBuffer,
        product: &mut WgpuBuffer,
        accumulate: bool,
    ) {
        if !self.takes_wide_gemv(m, k, gate_up.dtype) || !accumulate {
            return crate::rms_norm_gated_mlp_then_add(
                self, residual, unit, eps, gate_up, down, m, k, ffn, scratch, normed, product,
                accumulate,
            );
        }
        let normed_silu = GemvEpilogue {
            silu_mul: true,
            norm_eps: Some(eps),
            add_out: false,
        };
        let act = &*scratch.act;
        self.wide_product(
            residual,
            gate_up,
            None,
            (m, ffn, k),
            act,
            (ffn, 0),
            normed_silu,
        );
        self.matmul_add(scratch.act, down, m, k, ffn, product, residual);
    }

    fn add_assign(&self, acc: &mut WgpuBuffer, x: &WgpuBuffer, numel: usize) {
        self.dispatch(
            &shader::ELEMENTWISE,
            "add_assign",
            DType::F32,
            &words(&[numel, 0]),
            &[(1, &x.buf), (3, &acc.buf)],
            numel.div_ceil(WG as usize),
        );
    }

    fn silu_mul(&self, gate_up: &WgpuBuffer, rows: usize, ffn: usize, out: &mut WgpuBuffer) {
        self.dispatch(
            &shader::ELEMENTWISE,
            "silu_mul",
            DType::F32,
            &words(&[rows * ffn, ffn]),
            &[(1, &gate_up.buf), (3, &out.buf)],
            (rows * ffn).div_ceil(WG as usize),
        );
    }

    fn qk_norm(
        &self,
        qkv: &mut WgpuBuffer,
        layout: QkvLayout,
        rows: usize,
        q_weight: &WgpuBuffer,
        k_weight: &WgpuBuffer,
        eps: f32,
    ) {
        let p = [
            rows as u32,
            layout.head_dim as u32,
            eps.to_bits(),
            layout.num_heads as u32,
            layout.num_kv_heads as u32,
            layout.row_len() as u32,
        ];
        self.dispatch(
            &shader::NORM,
            "qk_norm",
            DType::F32,
            &p,
            &[(2, &q_weight.buf), (3, &qkv.buf), (5, &k_weight.buf)],
            rows * (layout.num_heads + layout.num_kv_heads),
        );
    }

    fn rope(
        &self,
        qkv: &mut WgpuBuffer,
        layout: QkvLayout,
        positions: &WgpuBuffer,
        rows: usize,
        cos_sin: &WgpuBuffer,
        rotary_dim: usize,
    ) {
        let heads = layout.num_heads + layout.num_kv_heads;
        let p = words(&[
            rows,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            rotary_dim,
            layout.row_len(),
        ]);
        self.dispatch(
            &shader::ROPE,
            "rope",
            DType::F32,
            &p,
            &[(1, &positions.buf), (2, &cos_sin.buf), (3, &qkv.buf)],
            (rows * heads * rotary_dim / 2).div_ceil(WG as usize),
        );
    }

    fn kv_write(
        &self,
        qkv: &WgpuBuffer,
        layout: QkvLayout,
        slot_mapping: &WgpuBuffer,
        rows: usize,
        _cache: CacheLayout,
        k_cache: &mut WgpuBuffer,
        v_cache: &mut WgpuBuffer,
    ) {
        assert_eq!(k_cache.dtype, v_cache.dtype);
        assert!(
            layout.head_dim.is_multiple_of(2),
            "kv_write writes element pairs"
        );
        let p = words(&[
            rows,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            0,
            layout.row_len(),
        ]);
        self.dispatch(
            &shader::ROPE,
            "kv_write",
            k_cache.dtype,
            &p,
            &[
                (4, &slot_mapping.buf),
                (5, &k_cache.buf),
                (6, &v_cache.buf),
                (7, &qkv.buf),
            ],
            (rows * layout.kv_len() / 2).div_ceil(WG as usize),
        );
    }

    fn rope_kv_write(
        &self,
        qkv: &mut WgpuBuffer,
        layout: QkvLayout,
        positions: &WgpuBuffer,
        rows: usize,
        cos_sin: &WgpuBuffer,
        rotary_dim: usize,
        slot_mapping: &WgpuBuffer,
        cache: CacheLayout,
        k_cache: &mut WgpuBuffer,
        v_cache: &mut WgpuBuffer,
    ) {
        if !rotary_dim.is_multiple_of(4) || !layout.head_dim.is_multiple_of(2) {
            self.rope(qkv, layout, positions, rows, cos_sin, rotary_dim);
            return self.kv_write(qkv, layout, slot_mapping, rows, cache, k_cache, v_cache);
        }
        assert_eq!(k_cache.dtype, v_cache.dtype);
        let p = words(&[
            rows,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            rotary_dim,
            layout.row_len(),
        ]);
        let heads = layout.num_heads + 2 * layout.num_kv_heads;
        self.dispatch(
            &shader::ROPE,
            "rope_kv_write",
            k_cache.dtype,
            &p,
            &[
                (1, &positions.buf),
                (2, &cos_sin.buf),
                (3, &qkv.buf),
                (4, &slot_mapping.buf),
                (5, &k_cache.buf),
                (6, &v_cache.buf),
            ],
            (rows * heads * layout.head_dim / 2).div_ceil(WG as usize),
        );
    }

    fn attention_workspace_len(&self, layout: QkvLayout, max_seqs: usize) -> usize {
        max_seqs * layout.num_heads * DECODE_SPLITS * (layout.head_dim + 2)
    }

    fn paged_attention(
        &self,
        qkv: &WgpuBuffer,
        layout: QkvLayout,
        rows: usize,
        meta: &AttentionMetadata<'_, Self>,
        cache: CacheLayout,
        k_cache: &WgpuBuffer,
        v_cache: &WgpuBuffer,
        scale: f32,
        workspace: &mut WgpuBuffer,
        out: &mut WgpuBuffer,
    ) {
        assert!(layout.head_dim as u32 <= WG, "head_dim above {WG}");
        let mut p = words(&[
            rows,
            meta.num_seqs,
            layout.num_heads,
            layout.num_kv_heads,
            layout.head_dim,
            layout.row_len(),
            cache.block_size,
            meta.max_blocks_per_seq,
        ]);
        p.extend([scale.to_bits(), DECODE_SPLITS as u32]);
        let group = layout.num_heads / layout.num_kv_heads;
        // The decode kernel holds a query group of up to 8 heads and 2048 elements, and
        // reads the cache 8 elements at a time.
        let decode = meta.max_query_len == 1
            && rows == meta.num_seqs
            && group <= 8
            && group * layout.head_dim <= 2048
            && layout.head_dim.is_multiple_of(8);
        let tiled = layout.head_dim <= 128 && layout.head_dim.is_multiple_of(8);
        if !decode {
            // Prefill and mixed steps: tiles of PREFILL_ROWS query rows share each key tile
            // where head_dim allows (16-byte cache bindings; on cooperative matrices where
            // the cache is 16-bit), else one row a workgroup.
            let coop = self
                .features
                .cooperative_matrix
                .filter(|_| takes_coop_prefill(layout.head_dim, k_cache.dtype));
            let q_tiles = meta.max_query_len.div_ceil(PREFILL_ROWS);
            let tile_groups = meta.num_seqs * q_tiles * layout.num_heads;
            let (kernel, entry, constants, kv, groups) = match coop {
                Some(c) => (
                    &shader::ATTENTION_COOP,
                    "prefill_coop",
                    vec![("COOP_SG", c.subgroup_size)],
                    [9, 10],
                    tile_groups,
                ),
                None if tiled => (&shader::ATTENTION, "prefill", vec![], [9, 10], tile_groups),
                None => (
                    &shader::ATTENTION,
                    "attention",
                    vec![],
                    [5, 6],
                    rows * layout.num_heads,
                ),
            };
            // Read by the tiled kernels, ignored by `attention`.
            p.push(q_tiles as u32);
            let buffers = [
                (1, &qkv.buf),
                (2, &meta.query_start_loc.buf),
                (3, &meta.seq_lens.buf),
                (4, &meta.block_tables.buf),
                (7, &out.buf),
                (kv[0], &k_cache.buf),
                (kv[1], &v_cache.buf),
            ];
            if groups > 0 {
                let pipeline = self.pipeline(kernel, entry, k_cache.dtype, &constants);
                self.record(pipeline, &p, &buffers, grid(groups), || {
                    format!("{entry} {}", k_cache.dtype)
                });
            }
            return;
        }
        assert!(
            workspace.numel >= self.attention_workspace_len(layout, meta.num_seqs),
            "attention workspace too small"
        );
        // Output elements per thread: fewer registers where the group's block is small.
        let outs = (group * layout.head_dim).div_ceil(WG as usize) as u32;
        let tiles = shader::decode_tiles(
            layout.head_dim as u32,
            self.limits.max_compute_workgroup_storage_size,
        );
        let pipeline = self.pipeline(
            &shader::ATTENTION,
            "decode",
            k_cache.dtype,
            &[
                ("OUTS", outs),
                ("TN", tiles.keys),
                ("TILE_VECS", tiles.vecs),
            ],
        );
        self.record(
            pipeline,
            &p,
            &[
                (1, &qkv.buf),
                (3, &meta.seq_lens.buf),
                (4, &meta.block_tables.buf),
                (7, &out.buf),
                (8, &workspace.buf),
                (9, &k_cache.buf),
                (10, &v_cache.buf),
            ],
            grid(meta.num_seqs * layout.num_kv_heads * DECODE_SPLITS),
            || format!("decode {}", k_cache.dtype),
        );
        self.dispatch(
            &shader::ATTENTION,
            "decode_reduce",
            k_cache.dtype,
            &p,
            &[(3, &meta.seq_lens.buf), (7, &out.buf), (8, &workspace.buf)],
            meta.num_seqs * layout.num_heads,
        );
    }

    fn argmax(&self, logits: &WgpuBuffer, rows: usize, vocab: usize, out: &mut WgpuBuffer) {
        self.dispatch(
            &shader::SAMPLING,
            "argmax",
            DType::F32,
            &words(&[rows, vocab]),
            &[(1, &logits.buf), (2, &out.buf)],
            rows,
        );
    }

    /// One workgroup per row (`sample` in sampling.wgsl); the row's bins sum 11-bit parts
    /// of its masses in 32 bits, which holds for vocabularies below 2^21.
    fn sample(
        &self,
        logits: &mut WgpuBuffer,
        rows: usize,
        vocab: usize,
        params: &WgpuBuffer,
        edits: &WgpuBuffer,
        masks: &WgpuBuffer,
        out: &mut WgpuBuffer,
    ) {
        assert!(vocab < 1 << 21, "sampling over a vocabulary of {vocab}");
        self.dispatch(
            &shader::SAMPLING,
            "sample",
            DType::F32,
            &words(&[rows, vocab]),
            &[
                (1, &logits.buf),
                (2, &out.buf),
                (3, &params.buf),
                (4, &edits.buf),
                (5, &masks.buf),
            ],
            rows,
        );
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn gather_rows(
        &self,
        x: &WgpuBuffer,
        indices: &WgpuBuffer,
        n: usize,
        dim: usize,
        out: &mut WgpuBuffer,
    ) {
        self.dispatch(
            &shader::ELEMENTWISE,
            "gather_rows",
            DType::F32,
            &words(&[n * dim, dim]),
            &[(1, &x.buf), (2, &indices.buf), (3, &out.buf)],
            (n * dim).div_ceil(WG as usize),
        );
    }

    fn segment_sum(
        &self,
        x: &WgpuBuffer,
        query_start_loc: &WgpuBuffer,
        num_seqs: usize,
        dim: usize,
        out: &mut WgpuBuffer,
    ) {
        self.dispatch(
            &shader::ELEMENTWISE,
            "segment_sum",
            DType::F32,
            &words(&[num_seqs * dim, dim]),
            &[(1, &x.buf), (2, &query_start_loc.buf), (3, &out.buf)],
            (num_seqs * dim).div_ceil(WG as usize),
        );
    }

    fn moe_route(
        &self,
        logits: &WgpuBuffer,
        shape: MoeShape,
        renormalize: bool,
        ids: &mut WgpuBuffer,
        weights: &mut WgpuBuffer,
    ) {
        self.dispatch(
            &shader::MOE,
            "moe_route",
            DType::F32,
            &moe_params(shape, renormalize, 0, 0),
            &[(1, &logits.buf), (3, &ids.buf), (4, &weights.buf)],
            shape.rows.div_ceil(WG as usize),
        );
    }

    fn moe_workspace_len(&self, shape: MoeShape) -> usize {
        shape.slots() * (shape.ffn + shape.dim)
    }

    fn moe_experts(
        &self,
        x: &WgpuBuffer,
        ids: &WgpuBuffer,
        weights: &WgpuBuffer,
        shape: MoeShape,
        gate_up: &WgpuBuffer,
        down: &WgpuBuffer,
        workspace: &mut WgpuBuffer,
        out: &mut WgpuBuffer,
        add: bool,
    ) {
        let slots = shape.slots();
        let (acts, ys) = (slots * shape.ffn, slots * shape.dim);
        self.dispatch(
            &shader::MOE,
            "moe_gate_up",
            gate_up.dtype,
            &moe_params(shape, false, acts, 0),
            &[
                (1, &x.buf),
                (2, &gate_up.buf),
                (3, &ids.buf),
                (5, &workspace.buf),
            ],
            acts.div_ceil(WG as usize),
        );
        self.dispatch(
            &shader::MOE,
            "moe_down",
            down.dtype,
            &moe_params(shape, false, ys, acts),
            &[(2, &down.buf), (3, &ids.buf), (5, &workspace.buf)],
            ys.div_ceil(WG as usize),
        );
        let n = shape.rows * shape.dim;
        self.dispatch(
            &shader::MOE,
            "moe_combine",
            DType::F32,
            &moe_params(shape, add, n, acts),
            &[(1, &workspace.buf), (4, &weights.buf), (5, &out.buf)],
            n.div_ceil(WG as usize),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiles the host picks for every row count stay within the arrays `gemm_coop`
    /// sizes for its largest tile (matmul_coop.wgsl: 64 x 128 outputs, 16 accumulators
    /// and 8 fragments of x a subgroup, 2048 f32 of fragments on their way out), for both
    /// fragment sides, and cover the rows.
    #[test]
    fn cooperative_tiles_fit_the_kernel() {
        for side in [8, 16] {
            for subgroup_size in [8, 32] {
                let c = shader::CooperativeMatrix {
                    side,
                    subgroup_size,
                };
                for m in (GEMV_MAX_ROWS + 1..=70).chain([1024]) {
                    let t = CoopTiles::for_rows(c, m);
                    assert!(t.rows(c) <= 64 && t.cols() <= 128, "{t:?} {c:?}");
                    assert!(t.fr <= 8 && t.fr * (32 / side) <= 16, "{t:?} {c:?}");
                    assert!(t.wm * t.wn * side * side <= 2048, "{t:?} {c:?}");
                    assert!(
                        m > 64 || t.rows(c) >= m,
                        "{m} rows in one tile: {t:?} {c:?}"
                    );
                }
            }
        }
    }

    /// Decode products of a 4096-wide output split k; a prefill's many tiles and a short
    /// k do not; no run is shorter than COOP_MIN_RUN_STEPS steps.
    #[test]
    fn few_tiles_split_k() {
        let c = shader::CooperativeMatrix {
            side: 16,
            subgroup_size: 32,
        };
        let splits = |m, n, k| CoopTiles::for_rows(c, m).splits(c, m, n, k);
        assert_eq!(splits(16, 4096, 4096), 8);
        assert_eq!(splits(16, 28672, 4096), 2);
        assert_eq!(splits(1024, 4096, 4096), 1);
        assert_eq!(splits(16, 64, 100), 1);
        assert_eq!(splits(16, 64, 1024), 8);
        // The partial sums stay within 16 MiB (4 Mi floats).
        for m in (GEMV_MAX_ROWS + 1..=2048).step_by(7) {
            for n in (1..=70_000).step_by(997) {
                let s = splits(m, n, 1 << 14);
                assert!(s == 1 || s * m * n <= 4 << 20, "{m} x {n}: {s} runs");
            }
        }
    }

    #[test]
    fn q8_0_blocks_pair_up_scales_first_and_pad_an_odd_last_block() {
        // Three blocks: scale bytes 10+b, quants 100+b.
        let blocks: Vec<u8> = (0..3u8)
            .flat_map(|b| [10 + b, 0].into_iter().chain([100 + b; 32]))
            .collect();
        let pairs = scale_pairs(&blocks, 34, 0).unwrap();
        assert_eq!(pairs.len(), 2 * 68);
        assert_eq!(pairs.len(), stored_bytes(DType::Q8_0, 3 * 32));
        assert_eq!(&pairs[..4], &[10, 0, 11, 0]);
        assert!(pairs[4..36].iter().all(|&q| q == 100));
        assert!(pairs[36..68].iter().all(|&q| q == 101));
        assert_eq!(&pairs[68..72], &[12, 0, 0, 0]);
        assert!(pairs[72..104].iter().all(|&q| q == 102));
        assert!(pairs[104..].iter().all(|&q| q == 0));
        assert!(scale_pairs(&blocks[..40], 34, 0).is_err());
        assert_eq!(stored_bytes(DType::Q4_0, 3 * 32), 2 * 36);
    }

    #[test]
    fn q6_k_blocks_pair_up_their_trailing_scales() {
        // Two blocks: quants 100+b, scale bytes 10+b and 20+b.
        let blocks: Vec<u8> = (0..2u8)
            .flat_map(|b| [100 + b; 208].into_iter().chain([10 + b, 20 + b]))
            .collect();
        let pairs = scale_pairs(&blocks, 210, scale_offset(DType::Q6K)).unwrap();
        assert_eq!(pairs.len(), stored_bytes(DType::Q6K, 2 * 256));
        assert_eq!(&pairs[..4], &[10, 20, 11, 21]);
        assert!(pairs[4..212].iter().all(|&q| q == 100));
        assert!(pairs[212..].iter().all(|&q| q == 101));
    }
}
