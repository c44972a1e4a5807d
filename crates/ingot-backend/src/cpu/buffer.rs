//! Host memory buffers of the CPU backend.

use crate::DType;
use half::{bf16, f16};
use memmap2::MmapMut;

/// From this size on a buffer is its own anonymous mapping, committed when it is made:
/// the KV cache a server reserves is resident from the start, so its memory is what the
/// start-up log says and does not climb as traffic first reaches each block (which reads
/// as a leak). Dropping the buffer returns its memory to the system at once.
const MAPPED_BYTES: usize = 1 << 20;

/// An anonymous mapping of `len` bytes with every page committed.
fn committed_map(len: usize) -> std::io::Result<MmapMut> {
    let mut map = MmapMut::map_anon(len)?;
    // On huge pages where the kernel offers them: committing a 1.4 GiB cache 4 KiB at a
    // time took 3 s of page faults on a 2-core VM. Attention's reads of the cache miss
    // the TLB less, too.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    map.iter_mut().step_by(4096).for_each(|b| *b = 0);
    Ok(map)
}

enum Storage {
    /// 16-byte words, so the bytes can be viewed as any element type.
    Heap(Vec<u128>),
    Mapped(MmapMut),
}

/// A typed host allocation; quantized types hold raw GGUF blocks.
pub struct CpuBuffer {
    dtype: DType,
    numel: usize,
    len: usize,
    storage: Storage,
}

impl CpuBuffer {
    pub(crate) fn zeroed(dtype: DType, numel: usize) -> anyhow::Result<Self> {
        let len = dtype.bytes_for(numel);
        let storage = if len >= MAPPED_BYTES {
            Storage::Mapped(committed_map(len)?)
        } else {
            Storage::Heap(vec![0; len.div_ceil(16)])
        };
        Ok(CpuBuffer {
            dtype,
            numel,
            len,
            storage,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(v) => &bytemuck::cast_slice(v)[..self.len],
            Storage::Mapped(m) => &m[..self.len],
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Heap(v) => &mut bytemuck::cast_slice_mut(v)[..self.len],
            Storage::Mapped(m) => &mut m[..self.len],
        }
    }

    fn expect(&self, dtype: DType) {
        assert_eq!(
            self.dtype, dtype,
            "expected a {dtype} buffer, got {}",
            self.dtype
        );
    }

    pub fn f32(&self) -> &[f32] {
        self.expect(DType::F32);
        bytemuck::cast_slice(self.bytes())
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        self.expect(DType::F32);
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    pub fn f16(&self) -> &[f16] {
        self.expect(DType::F16);
        bytemuck::cast_slice(self.bytes())
    }

    pub fn bf16(&self) -> &[bf16] {
        self.expect(DType::BF16);
        bytemuck::cast_slice(self.bytes())
    }

    pub fn i32(&self) -> &[i32] {
        self.expect(DType::I32);
        bytemuck::cast_slice(self.bytes())
    }

    pub fn i32_mut(&mut self) -> &mut [i32] {
        self.expect(DType::I32);
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// Bytes of one row of `dim` elements.
    pub(crate) fn row_bytes(&self, dim: usize) -> usize {
        self.dtype.bytes_for(dim)
    }
}
