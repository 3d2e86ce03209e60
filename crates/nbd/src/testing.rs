//! In-memory device and resolver for tests and examples, with hooks to delay and fail I/O.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::dev::{BlockDev, DevError, ResolveError, Resolver};

/// A RAM-backed `BlockDev`. Unaligned I/O is fine. Flush is a no-op that is counted.
#[derive(Debug)]
pub struct MemDev {
    data: RwLock<Vec<u8>>,
    gates: Mutex<HashMap<u64, Arc<Semaphore>>>,
    fail_next: Mutex<Option<DevError>>,
    panic_next: std::sync::atomic::AtomicBool,
    flushes: AtomicU64,
    description: Option<String>,
}

impl MemDev {
    pub fn new(size_bytes: usize) -> Self {
        Self {
            data: RwLock::new(vec![0u8; size_bytes]),
            gates: Mutex::new(HashMap::new()),
            fail_next: Mutex::new(None),
            panic_next: std::sync::atomic::AtomicBool::new(false),
            flushes: AtomicU64::new(0),
            description: None,
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

    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    /// A copy of the whole contents.
    pub fn contents(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|p| p.into_inner()).clone()
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

    fn fill_zero(&self, offset: u64, len: u32) -> Result<(), DevError> {
        let r = self.range(offset, len as usize)?;
        self.data.write().unwrap_or_else(|p| p.into_inner())[r].fill(0);
        Ok(())
    }
}

impl BlockDev for MemDev {
    fn size_bytes(&self) -> u64 {
        self.data.read().unwrap_or_else(|p| p.into_inner()).len() as u64
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Bytes, DevError> {
        self.enter(offset).await?;
        let r = self.range(offset, len as usize)?;
        let d = self.data.read().unwrap_or_else(|p| p.into_inner());
        Ok(Bytes::copy_from_slice(&d[r]))
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> Result<(), DevError> {
        self.enter(offset).await?;
        let r = self.range(offset, data.len())?;
        self.data.write().unwrap_or_else(|p| p.into_inner())[r].copy_from_slice(&data);
        Ok(())
    }

    async fn flush(&self) -> Result<(), DevError> {
        self.enter(u64::MAX).await?;
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> Result<(), DevError> {
        self.enter(offset).await?;
        self.fill_zero(offset, len)
    }

    async fn write_zeroes(&self, offset: u64, len: u32, _may_trim: bool) -> Result<(), DevError> {
        self.enter(offset).await?;
        self.fill_zero(offset, len)
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
