//! Host memory buffers of the CPU backend.

use crate::DType;
use half::{bf16, f16};
use memmap2::MmapMut;

/// From this size on a buffer is its own anonymous mapping: the kernel hands out zero pages
/// as they are first written, so a large KV cache is resident only where sequences have
/// written it. (Through the allocator, mimalloc zeroed part of each large block up front:
/// ~80 MiB of resident memory for a 1 GB cache that held 7 MB.)
const MAPPED_BYTES: usize = 1 << 20;

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
            Storage::Mapped(MmapMut::map_anon(len)?)
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
