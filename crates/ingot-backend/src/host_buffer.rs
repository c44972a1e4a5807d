//! Host memory that a step's inputs are written into and uploaded from, kept from step to
//! step.
//!
//! On CUDA it is page-locked: an upload from pageable memory is a copy the driver makes
//! through its own staging before the call returns (the 1.5 MB of a step's structured-output
//! masks at 256 rows held the engine thread for most of its `sample` phase), while one from
//! page-locked memory is a DMA the device runs in stream order. The host must then not
//! write the memory until the device has read it: the upload records an event, and every
//! write through [`HostBuffer::as_mut_slice`] (and the growing calls) first waits for it.

/// A growable `u32` buffer in host memory a backend may have page-locked.
#[derive(Default)]
pub struct HostBuffer {
    mem: Mem,
    len: usize,
    /// How many words from the start have been written in this memory, `len` or more:
    /// [`HostBuffer::resize_for_overwrite`] shows them again without zeroing.
    written: usize,
}

enum Mem {
    /// Ordinary memory, the whole vector in use (`len` is its length).
    Vec(Vec<u32>),
    #[cfg(feature = "cuda")]
    Pinned(crate::cuda::PinnedWords),
}

impl Default for Mem {
    fn default() -> Mem {
        Mem::Vec(Vec::new())
    }
}

impl HostBuffer {
    /// An empty buffer in ordinary memory with room for `capacity` words.
    pub fn with_capacity(capacity: usize) -> HostBuffer {
        HostBuffer {
            mem: Mem::Vec(Vec::with_capacity(capacity)),
            len: 0,
            written: 0,
        }
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn pinned(words: crate::cuda::PinnedWords) -> HostBuffer {
        // The page-locked words are zeroed when allocated.
        let written = words.capacity();
        HostBuffer {
            mem: Mem::Pinned(words),
            len: 0,
            written,
        }
    }

    /// The page-locked words, for the upload that must record when the device read them.
    #[cfg(feature = "cuda")]
    pub(crate) fn pinned_words(&self) -> Option<&crate::cuda::PinnedWords> {
        match &self.mem {
            Mem::Pinned(p) => Some(p),
            Mem::Vec(_) => None,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many words it holds without moving.
    pub fn capacity(&self) -> usize {
        match &self.mem {
            Mem::Vec(v) => v.capacity(),
            #[cfg(feature = "cuda")]
            Mem::Pinned(p) => p.capacity(),
        }
    }

    /// Whether uploads from it are the device's DMA (page-locked memory).
    pub fn is_pinned(&self) -> bool {
        match &self.mem {
            Mem::Vec(_) => false,
            #[cfg(feature = "cuda")]
            Mem::Pinned(_) => true,
        }
    }

    pub fn as_slice(&self) -> &[u32] {
        match &self.mem {
            Mem::Vec(v) => v,
            #[cfg(feature = "cuda")]
            Mem::Pinned(p) => &p.words()[..self.len],
        }
    }

    /// The words, to write: waits until the device has read the last upload from them.
    pub fn as_mut_slice(&mut self) -> &mut [u32] {
        match &mut self.mem {
            Mem::Vec(v) => v,
            #[cfg(feature = "cuda")]
            Mem::Pinned(p) => &mut p.words_mut()[..self.len],
        }
    }

    /// Empties it, keeping its memory.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    // Without the cuda feature ordinary memory is the only kind.
    #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
    pub fn truncate(&mut self, len: usize) {
        if let Mem::Vec(v) = &mut self.mem {
            v.truncate(len);
        }
        self.len = self.len.min(len);
    }

    /// Sets its length, new words zero. Past a page-locked buffer's capacity its words move
    /// to ordinary memory: slower uploads, never a failed step.
    pub fn resize(&mut self, len: usize) {
        self.reserve(len);
        match &mut self.mem {
            Mem::Vec(v) => v.resize(len, 0),
            #[cfg(feature = "cuda")]
            Mem::Pinned(p) => {
                let old = self.len;
                if len > old {
                    p.words_mut()[old..len].fill(0);
                }
            }
        }
        self.len = len;
        self.written = self.written.max(len);
    }

    /// Sets its length without zeroing: the words past the old length keep what they last
    /// held (zero where never written), for a caller that overwrites every word it then
    /// reads. The mask job's 256 rows of masks would otherwise be a 1.5 MB memset on one
    /// thread before its workers begin.
    #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
    pub fn resize_for_overwrite(&mut self, len: usize) {
        if len > self.written {
            return self.resize(len);
        }
        if let Mem::Vec(v) = &mut self.mem {
            // SAFETY: `len` is within the `written` words, all initialized in this vector's
            // memory (a move to new memory resets `written`), and a `u32` needs no drop.
            unsafe { v.set_len(len) };
        }
        self.len = len;
    }

    pub fn extend_from_slice(&mut self, words: &[u32]) {
        let start = self.len;
        self.resize(start + words.len());
        self.as_mut_slice()[start..].copy_from_slice(words);
    }

    /// Makes room for `len` words.
    fn reserve(&mut self, len: usize) {
        if len <= self.capacity() {
            return;
        }
        let mut v = Vec::with_capacity(len);
        v.extend_from_slice(self.as_slice());
        self.mem = Mem::Vec(v);
        self.written = self.len;
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pinned", &self.is_pinned())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_zeroed_and_keeps_its_words() {
        let mut b = HostBuffer::default();
        assert!(b.is_empty() && b.as_slice().is_empty());
        b.extend_from_slice(&[1, 2, 3]);
        b.resize(5);
        assert_eq!(b.as_slice(), &[1, 2, 3, 0, 0]);
        b.as_mut_slice()[4] = 9;
        b.truncate(2);
        b.resize(4);
        assert_eq!(b.as_slice(), &[1, 2, 0, 0]);
        let cap = b.capacity();
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.capacity(), cap, "clear keeps the memory");
        b.extend_from_slice(&[5, 6, 7]);
        b.truncate(1);
        b.resize_for_overwrite(3);
        assert_eq!(
            b.as_slice(),
            &[5, 6, 7],
            "the words written before show again"
        );
        b.resize_for_overwrite(5);
        assert_eq!(b.as_slice(), &[5, 6, 7, 0, 9], "what the words last held");
        b.resize_for_overwrite(7);
        assert_eq!(
            b.as_slice(),
            &[5, 6, 7, 0, 9, 0, 0],
            "zero where never written"
        );
        let mut c = HostBuffer::with_capacity(8);
        assert_eq!((c.len(), c.capacity(), c.is_pinned()), (0, 8, false));
        c.extend_from_slice(&[7; 8]);
        assert_eq!(c.capacity(), 8);
    }
}
