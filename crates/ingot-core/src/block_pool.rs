//! The KV cache as a pool of fixed-size blocks, with reference counts and prefix caching.
//!
//! A full block is identified by the hash of its parent block's hash and its own token
//! ids, so equal hashes mean equal prefixes. Freed blocks keep their contents and hash and
//! wait in an LRU queue: a later request with the same prefix takes them back; allocation
//! evicts the least recently freed.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

pub type BlockId = u32;

/// Identity of a full block: its tokens and everything before them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u64);

impl BlockHash {
    pub fn of(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = DefaultHasher::new();
        parent.map(|p| p.0).hash(&mut h);
        tokens.hash(&mut h);
        BlockHash(h.finish())
    }
}

/// The hashes of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|c| {
            let h = BlockHash::of(parent, c);
            parent = Some(h);
            h
        })
        .collect()
}

#[derive(Clone, Debug, Default)]
struct Block {
    ref_count: u32,
    /// Set while the block holds a cached full block.
    hash: Option<BlockHash>,
    /// Position in the free queue while unreferenced.
    free_tick: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Prompt tokens found cached.
    pub hits: u64,
}

pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Unreferenced blocks by the time they were freed: allocation takes the oldest.
    free_queue: BTreeMap<u64, BlockId>,
    tick: u64,
    cached: HashMap<BlockHash, BlockId>,
    prefix_caching: bool,
    pub stats: PrefixCacheStats,
}

impl BlockPool {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> BlockPool {
        assert!(block_size > 0);
        let mut pool = BlockPool {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free_queue: BTreeMap::new(),
            tick: 0,
            cached: HashMap::new(),
            prefix_caching,
            stats: PrefixCacheStats::default(),
        };
        for id in 0..num_blocks as BlockId {
            pool.push_free(id);
        }
        pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be allocated now (including cached ones that would be evicted).
    pub fn num_free(&self) -> usize {
        self.free_queue.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Fraction of blocks referenced by running sequences.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / self.blocks.len() as f64
    }

    fn push_free(&mut self, id: BlockId) {
        self.tick += 1;
        self.free_queue.insert(self.tick, id);
        self.blocks[id as usize].free_tick = Some(self.tick);
    }

    /// The cached blocks holding the longest prefix of `hashes`, without taking them.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        if !self.prefix_caching {
            return vec![];
        }
        hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect()
    }

    /// Counts a prefix-cache query of `queried` tokens of which `hit` were cached.
    pub fn record_query(&mut self, queried: usize, hit: usize) {
        if self.prefix_caching {
            self.stats.queries += queried as u64;
            self.stats.hits += hit as u64;
        }
    }

    /// Takes a reference to each block (cache hits found by [`lookup`](Self::lookup)).
    pub fn take(&mut self, ids: &[BlockId]) {
        for &id in ids {
            let b = &mut self.blocks[id as usize];
            if let Some(t) = b.free_tick.take() {
                self.free_queue.remove(&t);
            }
            b.ref_count += 1;
        }
    }

    /// `n` fresh blocks, evicting the least recently freed cached ones; `None` (and nothing
    /// taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_queue.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free_queue.pop_first().expect("counted above");
            let b = &mut self.blocks[id as usize];
            b.free_tick = None;
            b.ref_count = 1;
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
            }
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference to each block. Unreferenced blocks become free; a sequence's
    /// later blocks are freed first so that they are evicted before its shared prefix.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            assert!(b.ref_count > 0, "block {id} freed twice");
            b.ref_count -= 1;
            if b.ref_count == 0 {
                self.push_free(id);
            }
        }
    }

    /// Registers `id` as holding the full block with `hash`. A block whose hash is already
    /// cached elsewhere stays uncached (the older copy keeps serving hits).
    pub fn cache(&mut self, id: BlockId, hash: BlockHash) {
        if !self.prefix_caching || self.blocks[id as usize].hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    /// Whether every block is unreferenced (nothing leaked).
    pub fn all_free(&self) -> bool {
        self.free_queue.len() == self.blocks.len() && self.blocks.iter().all(|b| b.ref_count == 0)
    }

    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_count
    }

    /// Drops every cached hash (blocks stay free).
    pub fn reset_prefix_cache(&mut self) {
        self.cached.clear();
        self.blocks.iter_mut().for_each(|b| b.hash = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_prefix_is_found_again_until_evicted() {
        let mut pool = BlockPool::new(4, 2, true);
        let tokens = [1, 2, 3, 4, 5];
        let hashes = block_hashes(&tokens, 2);
        assert_eq!(hashes.len(), 2);
        let ids = pool.allocate(3).unwrap();
        pool.cache(ids[0], hashes[0]);
        pool.cache(ids[1], hashes[1]);
        pool.free(&ids);
        assert!(pool.all_free());
        assert_eq!(pool.lookup(&hashes), ids[..2].to_vec());
        // A different second block shares only the first.
        let other = block_hashes(&[1, 2, 9, 9], 2);
        assert_eq!(pool.lookup(&other), vec![ids[0]]);
        // Allocating everything evicts the cached blocks.
        let all = pool.allocate(4).unwrap();
        assert!(pool.lookup(&hashes).is_empty());
        pool.free(&all);
    }

    #[test]
    fn shared_blocks_are_freed_when_the_last_reference_goes() {
        let mut pool = BlockPool::new(2, 4, true);
        let ids = pool.allocate(1).unwrap();
        pool.take(&ids);
        assert_eq!(pool.ref_count(ids[0]), 2);
        pool.free(&ids);
        assert_eq!(pool.num_free(), 1);
        pool.free(&ids);
        assert!(pool.all_free());
        assert!(pool.allocate(3).is_none());
        assert_eq!(pool.num_free(), 2, "a failed allocation takes nothing");
    }
}
