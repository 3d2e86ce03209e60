//! Block-device I/O behind a narrow trait, so the engine runs unchanged on real O_DIRECT
//! files/devices and on the simulated drive (`faulty`).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// Alignment O_DIRECT needs for buffers on every device we support (4Kn included).
pub const IO_ALIGN: usize = 4096;

/// A drive as the engine sees it: positioned reads and writes plus a durability barrier.
pub trait BlockFile: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`. Not durable until `sync` returns.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every write that completed before this call durable (fdatasync / FLUSH).
    fn sync(&self) -> io::Result<()>;
    /// Size of the device in bytes.
    fn len_bytes(&self) -> u64;
    /// A regular file (not a block device): blocks written for the first time may cost the
    /// file system an allocation, so `format` writes the spare data blocks once up front.
    fn is_regular_file(&self) -> bool {
        false
    }
}

/// A heap buffer aligned to [`IO_ALIGN`], zero-initialised, as O_DIRECT requires.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); no interior mutability.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (capacity rounded up to a multiple of IO_ALIGN).
    pub fn new(len: usize) -> AlignedBuf {
        let cap = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        let layout = Layout::from_size_align(cap, IO_ALIGN)
            .expect("IO_ALIGN is a power of two and cap fits");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        AlignedBuf { ptr, len, layout }
    }

    /// Usable capacity (the allocation size).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Changes the visible length without reallocating; `len` must be <= capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity(),
            "AlignedBuf::set_len beyond capacity"
        );
        self.len = len;
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout in `new`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for capacity >= len bytes, initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

thread_local! {
    // Bounce buffer for callers whose slices are not aligned: grows once, then is reused,
    // so unaligned I/O costs a copy but no allocation per I/O.
    static BOUNCE: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    BOUNCE.with(|cell| {
        let mut slot = cell.borrow_mut();
        let buf = match slot.as_mut() {
            Some(b) if b.capacity() >= len => b,
            _ => slot.insert(AlignedBuf::new(len)),
        };
        buf.set_len(len);
        f(&mut buf[..])
    })
}

fn is_aligned(p: *const u8) -> bool {
    (p as usize).is_multiple_of(IO_ALIGN)
}

/// A regular file or block device opened with O_DIRECT (no page cache: the engine's
/// durability reasoning assumes writes go to the device, and the page cache would double memory use).
pub struct DirectFile {
    file: File,
    len: u64,
    path: PathBuf,
    regular: bool,
}

impl DirectFile {
    /// Opens `path` with O_DIRECT. With `create_size_bytes`, a missing file is created
    /// (sparse) at that size; an existing regular file smaller than that is refused, because
    /// the caller expects that much capacity. Block devices keep their own size.
    pub fn open(path: &Path, create_size_bytes: Option<u64>) -> io::Result<DirectFile> {
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", path.display()));
        let mut opts = OpenOptions::new();
        opts.read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC);
        if create_size_bytes.is_some() {
            // A drive holds every VM's disk: only the daemon's user reads it.
            opts.create(true).mode(0o600);
        }
        let mut file = opts.open(path).map_err(ctx)?;
        let meta = file.metadata().map_err(ctx)?;
        let regular = meta.file_type().is_file();
        if regular && meta.permissions().mode() & 0o077 != 0 {
            log::warn!(
                "{}: drive file was readable by others (mode {:o}); now 0600",
                path.display(),
                meta.permissions().mode() & 0o777
            );
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(ctx)?;
        }
        let len = if meta.file_type().is_block_device() {
            file.seek(SeekFrom::End(0)).map_err(ctx)?
        } else {
            let mut len = meta.len();
            if let Some(size) = create_size_bytes {
                if len == 0 {
                    file.set_len(size).map_err(ctx)?;
                    len = size;
                } else if len < size {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "{} exists with {len} bytes, smaller than the requested {size}; \
                             remove it or give its real size",
                            path.display()
                        ),
                    ));
                }
            }
            len
        };
        Ok(DirectFile {
            file,
            len,
            path: path.to_path_buf(),
            regular,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl BlockFile for DirectFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if is_aligned(buf.as_ptr()) {
            return self.file.read_exact_at(buf, offset);
        }
        with_bounce(buf.len(), |b| {
            self.file.read_exact_at(b, offset)?;
            buf.copy_from_slice(b);
            Ok(())
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if is_aligned(buf.as_ptr()) {
            return self.file.write_all_at(buf, offset);
        }
        with_bounce(buf.len(), |b| {
            b.copy_from_slice(buf);
            self.file.write_all_at(b, offset)
        })
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn len_bytes(&self) -> u64 {
        self.len
    }
    fn is_regular_file(&self) -> bool {
        self.regular
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        let mut b = AlignedBuf::new(10_000);
        assert_eq!(b.len(), 10_000);
        assert_eq!(b.capacity(), 12_288);
        assert!(is_aligned(b.as_ptr()));
        assert!(b.iter().all(|&x| x == 0));
        b[9_999] = 7;
        b.set_len(12_288);
        assert_eq!(b[9_999], 7);
    }

    fn round_trip(dir: &Path) {
        let path = dir.join("drive.img");
        let f = DirectFile::open(&path, Some(1 << 20)).expect("open");
        assert_eq!(f.len_bytes(), 1 << 20);
        // Unaligned caller buffer: goes through the bounce buffer.
        let mut v = vec![0u8; 4096 + 1];
        let data = &mut v[1..];
        data.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        f.write_at(data, 8192).expect("write");
        f.sync().expect("sync");
        let mut back = AlignedBuf::new(4096);
        f.read_at(&mut back, 8192).expect("read");
        assert_eq!(&back[..], &data[..]);
        drop(f);
        let f = DirectFile::open(&path, None).expect("reopen");
        assert_eq!(f.len_bytes(), 1 << 20);
        assert!(DirectFile::open(&path, Some(2 << 20)).is_err());
    }

    #[test]
    fn direct_file_round_trip_tempdir() {
        let dir = tempfile::tempdir().expect("tempdir");
        round_trip(dir.path());
    }

    #[test]
    fn direct_file_round_trip_dev_shm() {
        if !Path::new("/dev/shm").is_dir() {
            return;
        }
        let dir = tempfile::tempdir_in("/dev/shm").expect("tempdir in /dev/shm");
        round_trip(dir.path());
    }
}
