//! Tensor parallelism (Megatron-style): which slice of each weight a rank holds, and the
//! shape of the model each rank runs.
//!
//! The q/k/v and gate/up products are split by output rows (whole heads, whole MLP
//! columns), so attention and the activation run on a rank's own slice; the o and down
//! products are split by input columns, so each rank's output is a partial sum that one
//! all-reduce completes. Embeddings, norms and the output projection stay whole on every
//! rank. Where the ranks outnumber the KV heads, each KV head is held by as many ranks as
//! share its query heads (replicated, as vLLM does). A mixture of experts splits every
//! expert as a dense MLP (gate/up by rows, down by columns of the expert's width) and keeps
//! the router whole, so every rank routes each token alike and the all-reduce after the
//! layer sums the experts' partial outputs.

use crate::checkpoint::{HostTensor, Role};
use crate::config::ModelConfig;
use anyhow::{bail, ensure, Result};
use std::borrow::Cow;
use std::ops::Range;

/// Rank `rank` of a tensor-parallel group of `size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub size: usize,
}

impl TpRank {
    /// The whole model on one device.
    pub const SINGLE: TpRank = TpRank { rank: 0, size: 1 };

    /// The model this rank runs: its share of the heads, KV heads and MLP width.
    pub fn shard_config(&self, cfg: &ModelConfig) -> Result<ModelConfig> {
        let n = self.size;
        if n == 1 {
            return Ok(cfg.clone());
        }
        ensure!(self.rank < n, "tensor-parallel rank {} of {n}", self.rank);
        let mut counts = vec![
            ("attention heads", cfg.num_heads),
            ("MLP columns (intermediate_size)", cfg.intermediate_size),
        ];
        if let Some(m) = &cfg.moe {
            let what = "expert MLP columns (moe_intermediate_size)";
            counts.push((what, m.expert_intermediate_size));
        }
        for (what, count) in counts {
            ensure!(
                count.is_multiple_of(n),
                "--tensor-parallel-size {n} does not divide the model's {count} {what}"
            );
        }
        let kv = cfg.num_kv_heads;
        ensure!(
            kv.is_multiple_of(n) || n.is_multiple_of(kv),
            "--tensor-parallel-size {n} neither divides the model's {kv} KV heads nor is a \
             multiple of them"
        );
        Ok(ModelConfig {
            num_heads: cfg.num_heads / n,
            num_kv_heads: kv.div_ceil(n),
            intermediate_size: cfg.intermediate_size / n,
            moe: cfg.moe.as_ref().map(|m| crate::config::MoeConfig {
                expert_intermediate_size: m.expert_intermediate_size / n,
                ..m.clone()
            }),
            ..cfg.clone()
        })
    }

    /// This rank's share of `len` items.
    fn share(&self, len: usize) -> Range<usize> {
        let part = len / self.size;
        self.rank * part..(self.rank + 1) * part
    }

    /// Which part of the whole model's weight in `role` this rank holds (`full` is the
    /// whole model's config).
    pub fn cut(&self, role: Role, full: &ModelConfig) -> Result<Cut> {
        if self.size == 1 {
            return Ok(Cut::Whole);
        }
        let hd = full.head_dim;
        Ok(match role {
            Role::Q | Role::QBias => Cut::Rows(self.share(full.num_heads * hd)),
            Role::K | Role::V | Role::KBias | Role::VBias => {
                let kv = full.num_kv_heads;
                if kv.is_multiple_of(self.size) {
                    Cut::Rows(self.share(kv * hd))
                } else {
                    // The KV head of this rank's query heads, held whole.
                    let head = self.rank / (self.size / kv);
                    Cut::Rows(head * hd..(head + 1) * hd)
                }
            }
            Role::Gate | Role::Up => Cut::Rows(self.share(full.intermediate_size)),
            Role::O => Cut::Columns(self.share(full.num_heads * hd)),
            Role::Down => Cut::Columns(self.share(full.intermediate_size)),
            Role::ExpertGate(_) | Role::ExpertUp(_) => Cut::Rows(self.share(expert_width(full)?)),
            Role::ExpertDown(_) => Cut::Columns(self.share(expert_width(full)?)),
            Role::Embed
            | Role::FinalNorm
            | Role::LmHead
            | Role::AttnNorm
            | Role::FfnNorm
            | Role::QNorm
            | Role::KNorm
            | Role::Router => Cut::Whole,
        })
    }
}

fn expert_width(cfg: &ModelConfig) -> Result<usize> {
    match &cfg.moe {
        Some(m) => Ok(m.expert_intermediate_size),
        None => bail!("expert weights in a model without experts"),
    }
}

/// The part of a weight one rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    Whole,
    /// Output rows (or the values of a vector).
    Rows(Range<usize>),
    /// Input columns of a matrix.
    Columns(Range<usize>),
}

impl Cut {
    /// This part of the whole tensor `t`.
    pub fn apply<'a>(&self, t: HostTensor<'a>) -> Result<HostTensor<'a>> {
        match self {
            Cut::Whole => Ok(t),
            Cut::Rows(r) => rows(t, r.clone()),
            Cut::Columns(c) => columns(t, c.clone()),
        }
    }

    /// The shape of this part of a tensor of `shape`.
    pub fn shape(&self, shape: &[usize]) -> Vec<usize> {
        let mut out = shape.to_vec();
        match self {
            Cut::Whole => {}
            Cut::Rows(r) => out[0] = r.len(),
            Cut::Columns(c) => out[1] = c.len(),
        }
        out
    }

    /// The element of the whole tensor of `shape` (row-major) that element `i` of this part
    /// is.
    pub fn source_index(&self, shape: &[usize], i: usize) -> usize {
        let cols: usize = shape[1..].iter().product();
        match self {
            Cut::Whole => i,
            Cut::Rows(r) => r.start * cols + i,
            Cut::Columns(c) => i / c.len() * cols + c.start + i % c.len(),
        }
    }
}

/// Rows `range` of a matrix (or values `range` of a vector): a view of the stored bytes.
fn rows(t: HostTensor<'_>, range: Range<usize>) -> Result<HostTensor<'_>> {
    let total = t.shape[0];
    ensure!(
        range.end <= total,
        "rows {range:?} of a tensor of shape {:?}",
        t.shape
    );
    let cols: usize = t.shape[1..].iter().product();
    let (start, end) = (
        t.dtype.bytes_for(range.start * cols),
        t.dtype.bytes_for(range.end * cols),
    );
    let data = match t.data {
        Cow::Borrowed(d) => Cow::Borrowed(&d[start..end]),
        Cow::Owned(d) => Cow::Owned(d[start..end].to_vec()),
    };
    let mut shape = t.shape;
    shape[0] = range.len();
    Ok(HostTensor {
        dtype: t.dtype,
        shape,
        data,
        mapped: t.mapped,
    })
}

/// Columns `range` of a matrix, copied row by row; a block format is cut at whole blocks.
fn columns(t: HostTensor<'_>, range: Range<usize>) -> Result<HostTensor<'_>> {
    ensure!(
        t.shape.len() == 2 && range.end <= t.shape[1],
        "columns {range:?} of a tensor of shape {:?}",
        t.shape
    );
    let (n, k) = (t.shape[0], t.shape[1]);
    let block = t.dtype.block_len();
    ensure!(
        range.start.is_multiple_of(block) && range.end.is_multiple_of(block),
        "columns {range:?} cut {} blocks of {block}: this split needs another --tensor-parallel-size",
        t.dtype
    );
    let row_bytes = t.dtype.bytes_for(k);
    let (start, end) = (t.dtype.bytes_for(range.start), t.dtype.bytes_for(range.end));
    let mut data = Vec::with_capacity(n * (end - start));
    for row in t.data.chunks_exact(row_bytes) {
        data.extend_from_slice(&row[start..end]);
    }
    Ok(HostTensor {
        dtype: t.dtype,
        shape: vec![n, range.len()],
        data: Cow::Owned(data),
        mapped: t.mapped,
    })
}

#[cfg(test)]
mod tests {
    use super::TpRank;
    use crate::checkpoint::{HostTensor, Role};
    use crate::config::{Arch, ModelConfig};
    use crate::synthetic::SyntheticSpec;
    use crate::Checkpoint;
    use ingot_backend::DType;
    use std::borrow::Cow;

    fn matrix(rows: usize, cols: usize) -> (Vec<f32>, HostTensor<'static>) {
        let vals: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let t = HostTensor {
            dtype: DType::F32,
            shape: vec![rows, cols],
            data: Cow::Owned(bytemuck::cast_slice(&vals).to_vec()),
            mapped: &[],
        };
        (vals, t)
    }

    fn tiny_config(arch: Arch) -> ModelConfig {
        // A directory per call: tests run side by side.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("ingot-tp-{arch:?}-{}-{call}", std::process::id()));
        SyntheticSpec::tiny(arch).write(&dir).unwrap();
        let cfg = Checkpoint::open(&dir).unwrap().config().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        cfg
    }

    #[test]
    fn ranks_take_their_rows_and_columns() {
        let cfg = tiny_config(Arch::Llama);
        let tp = TpRank { rank: 1, size: 2 };
        let local = tp.shard_config(&cfg).unwrap();
        assert_eq!(
            (local.num_heads, local.num_kv_heads, local.intermediate_size),
            (2, 1, 48)
        );
        let (q, k) = (cfg.q_size(), cfg.hidden_size);

        let (vals, t) = matrix(q, k);
        let s = tp.cut(Role::Q, &cfg).unwrap().apply(t).unwrap();
        assert_eq!(s.shape, [q / 2, k]);
        assert_eq!(s.to_f32(), vals[q / 2 * k..]);

        let (vals, t) = matrix(k, q);
        let s = tp.cut(Role::O, &cfg).unwrap().apply(t).unwrap();
        assert_eq!(s.shape, [k, q / 2]);
        let expect: Vec<f32> = vals.chunks(q).flat_map(|r| r[q / 2..].to_vec()).collect();
        assert_eq!(s.to_f32(), expect);

        let (vals, t) = matrix(cfg.vocab_size, k);
        assert_eq!(
            tp.cut(Role::Embed, &cfg)
                .unwrap()
                .apply(t)
                .unwrap()
                .to_f32(),
            vals
        );
    }

    /// Four ranks over two KV heads: ranks 0 and 1 hold KV head 0, ranks 2 and 3 head 1,
    /// each with its own quarter of the query heads.
    #[test]
    fn ranks_past_the_kv_heads_share_them() {
        let cfg = ModelConfig {
            num_heads: 8,
            ..tiny_config(Arch::Llama)
        };
        assert_eq!(cfg.num_kv_heads, 2);
        let hd = cfg.head_dim;
        for rank in 0..4 {
            let tp = TpRank { rank, size: 4 };
            let local = tp.shard_config(&cfg).unwrap();
            assert_eq!((local.num_heads, local.num_kv_heads), (2, 1));
            let head = rank / 2;
            assert_eq!(
                tp.cut(Role::K, &cfg).unwrap(),
                super::Cut::Rows(head * hd..(head + 1) * hd)
            );
            assert_eq!(
                tp.cut(Role::Q, &cfg).unwrap(),
                super::Cut::Rows(rank * 2 * hd..(rank + 1) * 2 * hd)
            );
        }
    }

    #[test]
    fn splits_that_do_not_divide_are_refused() {
        let cfg = ModelConfig {
            num_heads: 6,
            num_kv_heads: 3,
            ..tiny_config(Arch::Llama)
        };
        let err = TpRank { rank: 0, size: 2 }.shard_config(&cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--tensor-parallel-size 2 neither divides the model's 3 KV heads nor is a \
             multiple of them"
        );
        let cfg = tiny_config(Arch::Llama);
        let err = TpRank { rank: 0, size: 8 }.shard_config(&cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "--tensor-parallel-size 8 does not divide the model's {} attention heads",
                cfg.num_heads
            )
        );
        let cfg = tiny_config(Arch::Mixtral);
        let err = TpRank { rank: 0, size: 32 }.shard_config(&cfg);
        assert!(err.is_err(), "32 ranks over 4 heads");
        let mut cfg = tiny_config(Arch::Qwen3Moe);
        cfg.moe.as_mut().unwrap().expert_intermediate_size = 30;
        let err = TpRank { rank: 0, size: 4 }.shard_config(&cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "--tensor-parallel-size 4 does not divide the model's 30 expert MLP columns \
             (moe_intermediate_size)"
        );
    }
}
