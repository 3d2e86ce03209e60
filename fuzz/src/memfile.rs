//! An in-memory drive for the engine harnesses: a shared, read-only base image (built once
//! per process) under a private copy-on-write overlay of 4 KiB pages, so every fuzz input
//! starts from the same image without copying megabytes per run.

use converge_engine::BlockFile;
use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};

const PAGE: usize = 4096;

pub struct CowFile {
    base: Arc<Vec<u8>>,
    pages: Mutex<HashMap<usize, Box<[u8; PAGE]>>>,
}

impl CowFile {
    pub fn new(base: Arc<Vec<u8>>) -> Self {
        assert!(base.len().is_multiple_of(PAGE), "image is whole pages");
        Self {
            base,
            pages: Mutex::new(HashMap::new()),
        }
    }

    /// A blank (all zero) drive.
    pub fn zeroed(len: usize) -> Self {
        Self::new(Arc::new(vec![0u8; len]))
    }

    pub fn len(&self) -> usize {
        self.base.len()
    }

    pub fn is_empty(&self) -> bool {
        self.base.is_empty()
    }

    /// The whole current image (for building base images).
    pub fn image(&self) -> Vec<u8> {
        let mut v = self.base.as_ref().clone();
        for (p, page) in self.pages.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            v[p * PAGE..(p + 1) * PAGE].copy_from_slice(&page[..]);
        }
        v
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.base.len() as u64 => Ok(offset as usize),
            _ => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("I/O at {offset}+{len} beyond {} bytes", self.base.len()),
            )),
        }
    }

    /// Reads what the drive holds now (overlay over base).
    pub fn get(&self, buf: &mut [u8], offset: usize) {
        let pages = self.pages.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done;
            let (p, o) = (at / PAGE, at % PAGE);
            let n = (PAGE - o).min(buf.len() - done);
            let src = match pages.get(&p) {
                Some(page) => &page[o..o + n],
                None => &self.base[at..at + n],
            };
            buf[done..done + n].copy_from_slice(src);
            done += n;
        }
    }

    /// Writes into the overlay.
    pub fn put(&self, buf: &[u8], offset: usize) {
        let mut pages = self.pages.lock().unwrap_or_else(|e| e.into_inner());
        let mut done = 0;
        while done < buf.len() {
            let at = offset + done;
            let (p, o) = (at / PAGE, at % PAGE);
            let n = (PAGE - o).min(buf.len() - done);
            let page = pages.entry(p).or_insert_with(|| {
                let mut b = Box::new([0u8; PAGE]);
                b.copy_from_slice(&self.base[p * PAGE..(p + 1) * PAGE]);
                b
            });
            page[o..o + n].copy_from_slice(&buf[done..done + n]);
            done += n;
        }
    }
}

impl BlockFile for CowFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let at = self.check(offset, buf.len())?;
        self.get(buf, at);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let at = self.check(offset, buf.len())?;
        self.put(buf, at);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.base.len() as u64
    }
}
