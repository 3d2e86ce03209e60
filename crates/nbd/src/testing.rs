//! In-memory device and resolver for tests and examples, with hooks to delay and fail I/O,
//! an allocation map, so block status has holes and zeroes to report, and declared dirty
//! bitmaps for the `qemu:dirty-bitmap:` contexts.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::dev::{
    BlockDev, DevError, Extent, ResolveError, Resolver, STATE_DIRTY, STATE_HOLE, STATE_ZERO,
};

/// Granularity of `MemDev`'s allocation map.
pub const MEM_BLOCK_BYTES: u64 = 4096;

/// What `MemDev` knows about one `MEM_BLOCK_BYTES` block. `Hole` and `Zero` blocks read
/// as zeroes (the device keeps that true), `Data` blocks may hold anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alloc {
    /// Never written, trimmed, or zeroed with trimming allowed: `HOLE | ZERO`.
    Hole,
    /// Zeroed without trimming (NBD_CMD_FLAG_NO_HOLE): `ZERO`.
    Zero,
    /// Written: flags 0.
    Data,
}

impl Alloc {
    fn flags(self) -> u32 {
        match self {
            Alloc::Hole => STATE_HOLE | STATE_ZERO,
            Alloc::Zero => STATE_ZERO,
            Alloc::Data => 0,
        }
    }
}

/// The bytes and their allocation map, under one lock so they always agree.
#[derive(Debug)]
struct Store {
    bytes: Vec<u8>,
    map: Vec<Alloc>,
}

impl Store {
    /// Marks the blocks `[offset, offset + len)` touches: `whole` for blocks it covers
    /// entirely (the export's last, short block counts as whole when covered to the
    /// end), `partial` for the ones it only touches (`None`: they keep their state).
    fn mark(&mut self, offset: u64, len: u64, whole: Alloc, partial: Option<Alloc>) {
        let size = self.bytes.len() as u64;
        let end = offset + len;
        let mut b = offset / MEM_BLOCK_BYTES;
        while b * MEM_BLOCK_BYTES < end {
            let start = b * MEM_BLOCK_BYTES;
            let stop = (start + MEM_BLOCK_BYTES).min(size);
            let state = &mut self.map[b as usize];
            if offset <= start && stop <= end {
                *state = whole;
            } else if let Some(p) = partial {
                *state = p;
            }
            b += 1;
        }
    }
}

/// A declared dirty bitmap: its name and its dirty `[start, end)` ranges, sorted, merged
/// and non-empty.
type DirtyBitmap = (String, Vec<(u64, u64)>);

/// A RAM-backed `BlockDev`. Unaligned I/O is fine. Flush is a no-op that is counted.
/// Block status reports its allocation map at 4 KiB granularity: never written, trimmed
/// or zeroed with trimming allowed → `HOLE | ZERO`; zeroed with NO_HOLE → `ZERO`; any
/// byte written → data (0). Dirty bitmaps are declared by tests (`set_dirty_bitmap`) and
/// reported at byte granularity.
#[derive(Debug)]
pub struct MemDev {
    data: RwLock<Store>,
    gates: Mutex<HashMap<u64, Arc<Semaphore>>>,
    fail_next: Mutex<Option<DevError>>,
    panic_next: std::sync::atomic::AtomicBool,
    flushes: AtomicU64,
    description: Option<String>,
    extents_next: Mutex<Option<Vec<Extent>>>,
    extents_max: AtomicUsize,
    /// In the order declared.
    bitmaps: RwLock<Vec<DirtyBitmap>>,
    fail_dirty_next: Mutex<Option<DevError>>,
}

impl MemDev {
    pub fn new(size_bytes: usize) -> Self {
        Self {
            data: RwLock::new(Store {
                bytes: vec![0u8; size_bytes],
                map: vec![Alloc::Hole; size_bytes.div_ceil(MEM_BLOCK_BYTES as usize)],
            }),
            gates: Mutex::new(HashMap::new()),
            fail_next: Mutex::new(None),
            panic_next: std::sync::atomic::AtomicBool::new(false),
            flushes: AtomicU64::new(0),
            description: None,
            extents_next: Mutex::new(None),
            extents_max: AtomicUsize::new(usize::MAX),
            bitmaps: RwLock::new(Vec::new()),
            fail_dirty_next: Mutex::new(None),
        }
    }

    pub fn with_description(mut self, text: &str) -> Self {
        self.description = Some(text.to_owned());
        self
    }

    /// Operations starting at `offset` block until `open(offset)`.
    pub fn gate(&self, offset: u64) {
        let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        g.insert(offset, Arc::new(Semaphore::new(0)));
    }

    /// Releases operations held by `gate(offset)`.
    pub fn open(&self, offset: u64) {
        let mut g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = g.remove(&offset) {
            s.close();
        }
    }

    /// The next operation fails with `e`.
    pub fn fail_next(&self, e: DevError) {
        *self.fail_next.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }

    /// The next operation panics (to test that the server still answers).
    pub fn panic_next(&self) {
        self.panic_next.store(true, Ordering::Relaxed);
    }

    /// The next block status answers exactly `runs`, right or wrong (to test that the
    /// server checks what devices say).
    pub fn extents_next(&self, runs: Vec<Extent>) {
        *self.extents_next.lock().unwrap_or_else(|p| p.into_inner()) = Some(runs);
    }

    /// Block status answers at most `n` runs (a prefix of the range), as a device that
    /// stops early may; clients must ask again from where the answer ended.
    pub fn set_extents_max(&self, n: usize) {
        self.extents_max.store(n.max(1), Ordering::Relaxed);
    }

    /// Declares dirty bitmap `name` (offered as `qemu:dirty-bitmap:name`), dirty exactly
    /// on the union of the `(offset, length)` ranges and clean elsewhere; replaces an
    /// earlier bitmap of that name in place. Names are offered in the order declared.
    pub fn set_dirty_bitmap(&self, name: &str, dirty: Vec<(u64, u64)>) {
        let mut ranges: Vec<(u64, u64)> = dirty
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(offset, len)| (offset, offset.saturating_add(len)))
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
        for (start, end) in ranges {
            match merged.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => merged.push((start, end)),
            }
        }
        let mut bitmaps = self.bitmaps.write().unwrap_or_else(|p| p.into_inner());
        match bitmaps.iter_mut().find(|(n, _)| n == name) {
            Some(b) => b.1 = merged,
            None => bitmaps.push((name.to_owned(), merged)),
        }
    }

    /// Forgets dirty bitmap `name`: no longer offered, and asking for it fails (as a
    /// snapshot deleted after a client selected it).
    pub fn remove_dirty_bitmap(&self, name: &str) {
        let mut bitmaps = self.bitmaps.write().unwrap_or_else(|p| p.into_inner());
        bitmaps.retain(|(n, _)| n != name);
    }

    /// The next dirty status (only) fails with `e`.
    pub fn fail_dirty_next(&self, e: DevError) {
        *self
            .fail_dirty_next
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(e);
    }

    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// A copy of the whole contents.
    pub fn contents(&self) -> Vec<u8> {
        self.data
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .bytes
            .clone()
    }

    async fn enter(&self, offset: u64) -> Result<(), DevError> {
        let gate = {
            let g = self.gates.lock().unwrap_or_else(|p| p.into_inner());
            g.get(&offset).cloned()
        };
        if let Some(s) = gate {
            // Closed means opened: the error is the release signal.
            let _ = s.acquire().await;
        }
        if self.panic_next.swap(false, Ordering::Relaxed) {
            panic!("MemDev: injected panic at offset {offset}");
        }
        match self
            .fail_next
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, DevError> {
        let size = self.size_bytes();
        let end = offset.checked_add(len as u64).filter(|&e| e <= size);
        match end {
            Some(end) => Ok(offset as usize..end as usize),
            None => Err(DevError::new(
                crate::DevErrorKind::Invalid,
                format!("range {offset}+{len} beyond {size}"),
            )),
        }
    }

    /// Zeroes the range; the blocks it covers entirely become `whole`.
    fn fill_zero(&self, offset: u64, len: u32, whole: Alloc) -> Result<(), DevError> {
        let r = self.range(offset, len as usize)?;
        let mut store = self.data.write().unwrap_or_else(|p| p.into_inner());
        store.bytes[r].fill(0);
        store.mark(offset, u64::from(len), whole, None);
        Ok(())
    }
}

impl BlockDev for MemDev {
    fn size_bytes(&self) -> u64 {
        self.data
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .bytes
            .len() as u64
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, DevError> {
        self.enter(offset).await?;
        let r = self.range(offset, len as usize)?;
        let d = self.data.read().unwrap_or_else(|p| p.into_inner());
        Ok(Bytes::copy_from_slice(&d.bytes[r]))
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), DevError> {
        self.enter(offset).await?;
        let r = self.range(offset, data.len())?;
        let mut store = self.data.write().unwrap_or_else(|p| p.into_inner());
        store.bytes[r].copy_from_slice(&data);
        store.mark(offset, data.len() as u64, Alloc::Data, Some(Alloc::Data));
        Ok(())
    }

    async fn flush(&self) -> Result<(), DevError> {
        self.enter(u64::MAX).await?;
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> Result<(), DevError> {
        self.enter(offset).await?;
        self.fill_zero(offset, len, Alloc::Hole)
    }

    async fn write_zeroes(&self, offset: u64, len: u32, may_trim: bool) -> Result<(), DevError> {
        self.enter(offset).await?;
        let whole = if may_trim { Alloc::Hole } else { Alloc::Zero };
        self.fill_zero(offset, len, whole)
    }

    async fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>, DevError> {
        self.enter(offset).await?;
        if let Some(runs) = self
            .extents_next
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Ok(runs);
        }
        let max = self.extents_max.load(Ordering::Relaxed);
        let r = self.range(offset, len as usize)?;
        let (start, end) = (r.start as u64, r.end as u64);
        let store = self.data.read().unwrap_or_else(|p| p.into_inner());
        let mut runs: Vec<Extent> = Vec::new();
        let mut pos = start;
        while pos < end {
            let block = pos / MEM_BLOCK_BYTES;
            let stop = ((block + 1) * MEM_BLOCK_BYTES).min(end);
            let flags = store.map[block as usize].flags();
            // At most `len` in all, so each run fits in u32.
            let length = (stop - pos) as u32;
            if let Some(last) = runs.last_mut().filter(|l| l.flags == flags) {
                last.length += length;
            } else if runs.len() == max {
                break;
            } else {
                runs.push(Extent { length, flags });
            }
            pos = stop;
        }
        Ok(runs)
    }

    fn dirty_bitmaps(&self) -> Vec<String> {
        let bitmaps = self.bitmaps.read().unwrap_or_else(|p| p.into_inner());
        bitmaps.iter().map(|(name, _)| name.clone()).collect()
    }

    async fn dirty_status(
        &self,
        bitmap: &str,
        offset: u64,
        len: u32,
    ) -> Result<Vec<Extent>, DevError> {
        self.enter(offset).await?;
        if let Some(e) = self
            .fail_dirty_next
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            return Err(e);
        }
        let max = self.extents_max.load(Ordering::Relaxed);
        let r = self.range(offset, len as usize)?;
        let (start, end) = (r.start as u64, r.end as u64);
        let bitmaps = self.bitmaps.read().unwrap_or_else(|p| p.into_inner());
        let Some((_, dirty)) = bitmaps.iter().find(|(n, _)| n == bitmap) else {
            return Err(DevError::new(
                crate::DevErrorKind::Invalid,
                format!("no dirty bitmap {bitmap}"),
            ));
        };
        // The ranges are merged, so clean and dirty runs alternate.
        let mut runs: Vec<Extent> = Vec::new();
        let mut pos = start;
        for &(d_start, d_end) in dirty {
            if d_end <= pos {
                continue;
            }
            if d_start >= end {
                break;
            }
            for (to, flags) in [(d_start, 0), (d_end.min(end), STATE_DIRTY)] {
                if to > pos && runs.len() < max {
                    // At most `len` in all, so each run fits in u32.
                    let length = (to - pos) as u32;
                    runs.push(Extent { length, flags });
                    pos = to;
                }
            }
            if runs.len() == max {
                break;
            }
        }
        if pos < end && runs.len() < max {
            let length = (end - pos) as u32;
            runs.push(Extent { length, flags: 0 });
        }
        Ok(runs)
    }

    fn description(&self) -> Option<String> {
        self.description.clone()
    }
}

/// A fixed table of exports, plus names that resolve to an error.
#[derive(Debug, Default)]
pub struct MemResolver {
    exports: HashMap<String, Arc<MemDev>>,
    refusals: HashMap<String, ResolveError>,
}

impl MemResolver {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_export(mut self, name: &str, dev: Arc<MemDev>) -> Self {
        self.exports.insert(name.to_owned(), dev);
        self
    }

    /// `name` resolves to `err` (e.g. `ResolveError::Elsewhere`).
    pub fn with_refusal(mut self, name: &str, err: ResolveError) -> Self {
        self.refusals.insert(name.to_owned(), err);
        self
    }
}

impl Resolver for MemResolver {
    type Dev = MemDev;

    async fn list(&self) -> Vec<String> {
        let mut names: Vec<String> = self.exports.keys().cloned().collect();
        names.sort();
        names
    }

    async fn resolve(&self, export: &str) -> Result<Arc<MemDev>, ResolveError> {
        if let Some(dev) = self.exports.get(export) {
            return Ok(Arc::clone(dev));
        }
        Err(self
            .refusals
            .get(export)
            .cloned()
            .unwrap_or(ResolveError::Unknown))
    }
}
