//! A reader for GGUF files: metadata key/values and tensor descriptors over a memory map.

use anyhow::{bail, ensure, Context, Result};
use ingot_backend::DType;
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::Path;

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => self.as_u64().map(|v| v as f32),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor: `dims` as GGUF stores them (fastest-varying first), data in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub offset: usize,
    pub nbytes: usize,
}

pub struct GgufFile {
    mmap: Mmap,
    pub metadata: HashMap<String, Value>,
    pub tensors: HashMap<String, TensorInfo>,
    data_start: usize,
}

/// ggml's type ids for the formats ingot reads.
fn dtype_of(id: u32) -> Result<DType> {
    Ok(match id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        8 => DType::Q8_0,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        other => {
            let name = match other {
                6 => "Q5_0",
                7 => "Q5_1",
                9 => "Q8_1",
                10 => "Q2_K",
                11 => "Q3_K",
                15 => "Q8_K",
                16..=23 => "IQ*",
                _ => "unknown",
            };
            bail!("GGUF tensor type {other} ({name}) is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)")
        }
    })
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .context("GGUF file is truncated")?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // Every element takes at least a byte, so a count beyond the file is corrupt.
        ensure!(
            n as usize <= self.buf.len() - self.pos,
            "GGUF length {n} runs past the end of the file"
        );
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value> {
        let b = |c: &mut Self, n| c.take(n);
        Ok(match ty {
            0 => Value::U8(b(self, 1)?[0]),
            1 => Value::I8(b(self, 1)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            3 => Value::I16(i16::from_le_bytes(b(self, 2)?.try_into().unwrap())),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                ensure!(depth < 4, "GGUF arrays nested too deeply");
                let et = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.value(et, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => bail!("GGUF metadata value type {other} is unknown"),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file =
            std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the file is opened read-only; ingot does not modify model files while running.
        let mmap = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        Self::parse(mmap).with_context(|| format!("{} is not a valid GGUF file", path.display()))
    }

    fn parse(mmap: Mmap) -> Result<GgufFile> {
        let mut c = Cursor { buf: &mmap, pos: 0 };
        ensure!(c.take(4)? == b"GGUF", "bad magic");
        let version = c.u32()?;
        ensure!(
            version == 2 || version == 3,
            "GGUF version {version} is not supported (2 or 3)"
        );
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c
                .value(ty, 0)
                .with_context(|| format!("metadata `{key}`"))?;
            metadata.insert(key, v);
        }
        let mut infos = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()? as usize;
            ensure!(nd <= 4, "tensor `{name}` has {nd} dimensions");
            let dims = (0..nd)
                .map(|_| c.u64().map(|d| d as usize))
                .collect::<Result<Vec<_>>>()?;
            let dtype = dtype_of(c.u32()?).with_context(|| format!("tensor `{name}`"))?;
            let offset = c.u64()? as usize;
            infos.push((name, dims, dtype, offset));
        }
        let align = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(32) as usize;
        ensure!(align > 0 && align.is_power_of_two(), "alignment {align}");
        let data_start = c.pos.div_ceil(align) * align;
        let mut tensors = HashMap::new();
        for (name, dims, dtype, offset) in infos {
            let numel = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .context("tensor size overflows")?;
            ensure!(
                dims.first().is_none_or(|&d| d % dtype.block_len() == 0),
                "tensor `{name}`: rows of {dims:?} are not whole {dtype} blocks"
            );
            let nbytes = dtype.bytes_for(numel);
            let end = data_start
                .checked_add(offset)
                .and_then(|s| s.checked_add(nbytes));
            ensure!(
                end.is_some_and(|e| e <= mmap.len()),
                "tensor `{name}` lies past the end of the file"
            );
            tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    dims,
                    offset,
                    nbytes,
                },
            );
        }
        Ok(GgufFile {
            mmap,
            metadata,
            tensors,
            data_start,
        })
    }

    pub fn mmap(&self) -> &Mmap {
        &self.mmap
    }

    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[self.data_start + t.offset..][..t.nbytes]
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }
}
