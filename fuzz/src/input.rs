//! A cursor over the fuzzer's bytes: structured harnesses read fields from it, and an
//! exhausted input reads as zeros, so every byte string is a valid (if short) input.

pub struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// What is left, consumed.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }

    /// Up to `n` bytes (fewer when the input runs out).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        head
    }

    pub fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    pub fn u16(&mut self) -> u16 {
        let mut a = [0u8; 2];
        let b = self.bytes(2);
        a[..b.len()].copy_from_slice(b);
        u16::from_le_bytes(a)
    }

    pub fn u32(&mut self) -> u32 {
        let mut a = [0u8; 4];
        let b = self.bytes(4);
        a[..b.len()].copy_from_slice(b);
        u32::from_le_bytes(a)
    }
}
