//! Host memory buffers of the CPU backend.

use crate::DType;
use half::{bf16, f16};

enum Storage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    Blocks(Vec<u8>),
}

/// A typed host allocation; quantized types hold raw GGUF blocks.
pub struct CpuBuffer {
    dtype: DType,
    numel: usize,
    storage: Storage,
}

impl CpuBuffer {
    pub(crate) fn zeroed(dtype: DType, numel: usize) -> Self {
        let storage = match dtype {
            DType::F32 => Storage::F32(vec![0.0; numel]),
            DType::F16 => Storage::F16(vec![f16::ZERO; numel]),
            DType::BF16 => Storage::BF16(vec![bf16::ZERO; numel]),
            DType::I32 => Storage::I32(vec![0; numel]),
            q => Storage::Blocks(vec![0; q.bytes_for(numel)]),
        };
        CpuBuffer {
            dtype,
            numel,
            storage,
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::F32(v) => bytemuck::cast_slice(v),
            Storage::F16(v) => bytemuck::cast_slice(v),
            Storage::BF16(v) => bytemuck::cast_slice(v),
            Storage::I32(v) => bytemuck::cast_slice(v),
            Storage::Blocks(v) => v,
        }
    }

    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::F32(v) => bytemuck::cast_slice_mut(v),
            Storage::F16(v) => bytemuck::cast_slice_mut(v),
            Storage::BF16(v) => bytemuck::cast_slice_mut(v),
            Storage::I32(v) => bytemuck::cast_slice_mut(v),
            Storage::Blocks(v) => v,
        }
    }

    pub fn f32(&self) -> &[f32] {
        match &self.storage {
            Storage::F32(v) => v,
            _ => panic!("expected an f32 buffer, got {}", self.dtype),
        }
    }

    pub fn f32_mut(&mut self) -> &mut [f32] {
        match &mut self.storage {
            Storage::F32(v) => v,
            _ => panic!("expected an f32 buffer, got {}", self.dtype),
        }
    }

    pub fn i32(&self) -> &[i32] {
        match &self.storage {
            Storage::I32(v) => v,
            _ => panic!("expected an i32 buffer, got {}", self.dtype),
        }
    }

    pub fn i32_mut(&mut self) -> &mut [i32] {
        match &mut self.storage {
            Storage::I32(v) => v,
            _ => panic!("expected an i32 buffer, got {}", self.dtype),
        }
    }

    /// Bytes of one row of `dim` elements.
    pub(crate) fn row_bytes(&self, dim: usize) -> usize {
        self.dtype.bytes_for(dim)
    }
}
