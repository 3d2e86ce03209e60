//! One virtio-blk request: its descriptors, as addresses in the guest's memory, turned into
//! calls on a [`BlockDev`] and a status byte written back (virtio 1.2, section 5.2.6).
//!
//! A request is a 16-byte header (type, reserved, sector) in the device-readable part of
//! its descriptor chain, then the data (device-readable for writes, device-writable for
//! reads), then one device-writable status byte. With `VIRTIO_F_VERSION_1` (ANY_LAYOUT) the
//! driver may split or merge these across descriptors as it likes, so everything here walks
//! byte ranges over the segment lists rather than assuming one descriptor per part.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::BytesMut;
use converge_nbd::{BlockDev, DevError, DevErrorKind};
use virtio_bindings::virtio_blk as vb;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Sector size of virtio-blk request addresses, whatever the device's block size.
pub const SECTOR: u64 = 512;
/// Reads and writes larger than this are split into requests of this size to the device
/// (the NBD front end's largest request is 32 MiB; Linux sends at most a few MiB).
pub const CHUNK_BYTES: usize = 8 * 1024 * 1024;
/// Largest DISCARD / WRITE_ZEROES range one segment may name, in sectors (advertised in
/// the config space): 1 GiB, one call to the device.
pub const MAX_ZERO_SECTORS: u32 = 2 * 1024 * 1024;
/// Segments per DISCARD / WRITE_ZEROES request (advertised).
pub const MAX_ZERO_SEGS: u32 = 16;

const S_OK: u8 = vb::VIRTIO_BLK_S_OK as u8;
const S_IOERR: u8 = vb::VIRTIO_BLK_S_IOERR as u8;
const S_UNSUPP: u8 = vb::VIRTIO_BLK_S_UNSUPP as u8;

/// One descriptor of a chain: `len` bytes at guest address `addr`, written by the device
/// (`write`) or read by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// Counters of one attachment, bumped by every request.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    /// Requests answered with a status other than OK.
    pub errors: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
}

/// What a request needs besides its segments.
pub struct Ctx<'a, D: BlockDev, M: GuestMemory> {
    pub dev: &'a D,
    pub mem: &'a M,
    /// `VIRTIO_BLK_T_GET_ID`'s answer (at most 20 bytes are sent).
    pub serial: &'a [u8],
    pub stats: &'a Stats,
}

/// Why a request failed, for the log; the guest sees only the status byte.
#[derive(Debug)]
enum Fail {
    /// IOERR: the device failed, or the request is malformed or out of range.
    Io(String),
    /// UNSUPP: a request type this device does not offer.
    Unsupported(u32),
}

impl From<DevError> for Fail {
    fn from(e: DevError) -> Self {
        Fail::Io(match e.kind {
            DevErrorKind::NoSpace => format!("no space: {}", e.message),
            _ => e.message,
        })
    }
}

/// The bytes `[skip, skip + buf.len())` of the segments that pass `pick`, in chain order.
fn gather<M: GuestMemory>(
    mem: &M,
    segs: &[Seg],
    write: bool,
    mut skip: u64,
    buf: &mut [u8],
) -> Result<(), Fail> {
    let mut done = 0usize;
    for s in segs.iter().filter(|s| s.write == write) {
        if done == buf.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(buf.len() - done);
        mem.read_slice(&mut buf[done..done + n], GuestAddress(s.addr + skip))
            .map_err(|e| Fail::Io(format!("guest memory at {:#x}: {e}", s.addr + skip)))?;
        done += n;
        skip = 0;
    }
    if done < buf.len() {
        return Err(Fail::Io("request shorter than its header says".into()));
    }
    Ok(())
}

/// Writes `data` at byte `skip` of the device-writable segments.
fn scatter<M: GuestMemory>(mem: &M, segs: &[Seg], mut skip: u64, data: &[u8]) -> Result<(), Fail> {
    let mut done = 0usize;
    for s in segs.iter().filter(|s| s.write) {
        if done == data.len() {
            break;
        }
        let len = u64::from(s.len);
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = ((len - skip) as usize).min(data.len() - done);
        mem.write_slice(&data[done..done + n], GuestAddress(s.addr + skip))
            .map_err(|e| Fail::Io(format!("guest memory at {:#x}: {e}", s.addr + skip)))?;
        done += n;
        skip = 0;
    }
    if done < data.len() {
        return Err(Fail::Io("read buffers shorter than the data".into()));
    }
    Ok(())
}

/// Serves one request and writes its status byte. Returns the used length to put in the
/// used ring: the bytes written into the guest's buffers (data and status).
pub async fn execute<D: BlockDev, M: GuestMemory>(cx: &Ctx<'_, D, M>, segs: &[Seg]) -> u32 {
    cx.stats.requests.fetch_add(1, Ordering::Relaxed);
    let readable: u64 = segs
        .iter()
        .filter(|s| !s.write)
        .map(|s| u64::from(s.len))
        .sum();
    let writable: u64 = segs
        .iter()
        .filter(|s| s.write)
        .map(|s| u64::from(s.len))
        .sum();
    if writable == 0 {
        // Nowhere to put a status: the driver is broken; complete it with nothing written.
        cx.stats.errors.fetch_add(1, Ordering::Relaxed);
        log::warn!("vhost-user-blk: a request without a status byte; dropped");
        return 0;
    }
    let (status, data_len) = match run(cx, segs, readable, writable).await {
        Ok(n) => (S_OK, n),
        Err(f) => {
            cx.stats.errors.fetch_add(1, Ordering::Relaxed);
            match f {
                Fail::Io(why) => {
                    log::warn!("vhost-user-blk: request failed: {why}");
                    (S_IOERR, 0)
                }
                Fail::Unsupported(t) => {
                    log::debug!("vhost-user-blk: request type {t} unsupported");
                    (S_UNSUPP, 0)
                }
            }
        }
    };
    if scatter(cx.mem, segs, writable - 1, &[status]).is_err() {
        log::warn!("vhost-user-blk: the status byte is outside guest memory");
        return 0;
    }
    data_len + 1
}

/// The request's work; `Ok(n)`: `n` data bytes were written into the guest's buffers.
async fn run<D: BlockDev, M: GuestMemory>(
    cx: &Ctx<'_, D, M>,
    segs: &[Seg],
    readable: u64,
    writable: u64,
) -> Result<u32, Fail> {
    let mut hdr = [0u8; 16];
    gather(cx.mem, segs, false, 0, &mut hdr)?;
    let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4 bytes"));
    let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes"));
    let size = cx.dev.size_bytes();
    let range = |len: u64| -> Result<u64, Fail> {
        let offset = sector
            .checked_mul(SECTOR)
            .ok_or_else(|| Fail::Io(format!("sector {sector} out of range")))?;
        if !len.is_multiple_of(SECTOR) {
            return Err(Fail::Io(format!("{len} bytes: not whole sectors")));
        }
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset),
            _ => Err(Fail::Io(format!(
                "{len} bytes at sector {sector} end past the disk ({size} bytes)"
            ))),
        }
    };
    match kind {
        vb::VIRTIO_BLK_T_IN => {
            let len = writable - 1;
            let offset = range(len)?;
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(CHUNK_BYTES as u64) as u32;
                let data = cx.dev.read(offset + done, n).await?;
                scatter(cx.mem, segs, done, &data)?;
                done += u64::from(n);
            }
            cx.stats.bytes_read.fetch_add(len, Ordering::Relaxed);
            u32::try_from(len).map_err(|_| Fail::Io("read larger than 4 GiB".into()))
        }
        vb::VIRTIO_BLK_T_OUT => {
            let len = readable - 16;
            let offset = range(len)?;
            if cx.dev.read_only() {
                return Err(Fail::Io("the disk is read-only (a snapshot)".into()));
            }
            let mut done = 0u64;
            while done < len {
                let n = (len - done).min(CHUNK_BYTES as u64) as usize;
                let mut buf = BytesMut::zeroed(n);
                gather(cx.mem, segs, false, 16 + done, &mut buf)?;
                cx.dev.write(offset + done, buf.freeze(), false).await?;
                done += n as u64;
            }
            cx.stats.bytes_written.fetch_add(len, Ordering::Relaxed);
            Ok(0)
        }
        vb::VIRTIO_BLK_T_FLUSH => {
            cx.dev.flush().await?;
            Ok(0)
        }
        vb::VIRTIO_BLK_T_GET_ID => {
            let mut id = [0u8; vb::VIRTIO_BLK_ID_BYTES as usize];
            let n = cx.serial.len().min(id.len());
            id[..n].copy_from_slice(&cx.serial[..n]);
            let room = ((writable - 1) as usize).min(id.len());
            scatter(cx.mem, segs, 0, &id[..room])?;
            Ok(room as u32)
        }
        vb::VIRTIO_BLK_T_DISCARD | vb::VIRTIO_BLK_T_WRITE_ZEROES => {
            if cx.dev.read_only() {
                return Err(Fail::Io("the disk is read-only (a snapshot)".into()));
            }
            let body = readable - 16;
            if body == 0 || !body.is_multiple_of(16) || body / 16 > u64::from(MAX_ZERO_SEGS) {
                return Err(Fail::Io(format!(
                    "{body} bytes of ranges: not 1 to 16 segments"
                )));
            }
            for i in 0..body / 16 {
                let mut seg = [0u8; 16];
                gather(cx.mem, segs, false, 16 + 16 * i, &mut seg)?;
                let start = u64::from_le_bytes(seg[0..8].try_into().expect("8 bytes"));
                let count = u32::from_le_bytes(seg[8..12].try_into().expect("4 bytes"));
                let flags = u32::from_le_bytes(seg[12..16].try_into().expect("4 bytes"));
                if count == 0 || count > MAX_ZERO_SECTORS {
                    return Err(Fail::Io(format!("a range of {count} sectors")));
                }
                let len = u64::from(count) * SECTOR;
                let offset = start
                    .checked_mul(SECTOR)
                    .filter(|o| o.checked_add(len).is_some_and(|e| e <= size))
                    .ok_or_else(|| {
                        Fail::Io(format!("{count} sectors at {start} end past the disk"))
                    })?;
                if kind == vb::VIRTIO_BLK_T_DISCARD {
                    cx.dev.trim(offset, len as u32).await?;
                } else {
                    let unmap = flags & vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
                    cx.dev.write_zeroes(offset, len as u32, unmap).await?;
                }
            }
            Ok(0)
        }
        other => Err(Fail::Unsupported(other)),
    }
}

/// The device's configuration space (`struct virtio_blk_config`, little-endian).
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub capacity_bytes: u64,
    pub queues: u16,
    /// Largest number of data segments in one request (queue size - 2).
    pub seg_max: u32,
}

impl Config {
    /// The 60 bytes of the config space up to `write_zeroes_may_unmap` and its padding.
    pub fn bytes(&self) -> [u8; 60] {
        let mut b = [0u8; 60];
        b[0..8].copy_from_slice(&(self.capacity_bytes / SECTOR).to_le_bytes());
        // size_max (8..12): not offered.
        b[12..16].copy_from_slice(&self.seg_max.to_le_bytes());
        // geometry (16..20): not offered.
        // Logical blocks of 512 bytes (what boot firmware expects), physical of 4 KiB (the
        // checksum block: smaller writes cost a read-modify-write).
        b[20..24].copy_from_slice(&512u32.to_le_bytes());
        b[24] = 3; // physical_block_exp: 2^3 logical blocks
        b[25] = 0; // alignment_offset
        b[26..28].copy_from_slice(&8u16.to_le_bytes()); // min_io_size, in logical blocks
        b[28..32].copy_from_slice(&8u32.to_le_bytes()); // opt_io_size
        b[32] = 0; // writeback: writes are durable when acknowledged
        b[34..36].copy_from_slice(&self.queues.to_le_bytes());
        b[36..40].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes()); // max_discard_sectors
        b[40..44].copy_from_slice(&MAX_ZERO_SEGS.to_le_bytes()); // max_discard_seg
        b[44..48].copy_from_slice(&8u32.to_le_bytes()); // discard_sector_alignment
        b[48..52].copy_from_slice(&MAX_ZERO_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
        b[52..56].copy_from_slice(&MAX_ZERO_SEGS.to_le_bytes()); // max_write_zeroes_seg
        b[56] = 1; // write_zeroes_may_unmap
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converge_nbd::testing::MemDev;
    use vm_memory::GuestMemoryMmap;

    const MIB: u64 = 1024 * 1024;

    fn mem() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 * MIB as usize)]).expect("mmap")
    }

    fn header(mem: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) -> Seg {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        mem.write_slice(&h, GuestAddress(at)).expect("header");
        Seg {
            addr: at,
            len: 16,
            write: false,
        }
    }

    fn status(mem: &GuestMemoryMmap<()>, at: u64) -> u8 {
        let mut b = [0u8; 1];
        mem.read_slice(&mut b, GuestAddress(at)).expect("status");
        b[0]
    }

    async fn go(dev: &MemDev, mem: &GuestMemoryMmap<()>, segs: &[Seg]) -> u32 {
        let stats = Stats::default();
        let cx = Ctx {
            dev,
            mem,
            serial: b"vol-a",
            stats: &stats,
        };
        execute(&cx, segs).await
    }

    #[tokio::test]
    async fn a_write_split_over_descriptors_reads_back_through_other_splits() {
        let dev = MemDev::new(MIB as usize);
        let m = mem();
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
        // Header and the first 100 data bytes in one descriptor (ANY_LAYOUT), the rest in
        // two more; status alone.
        let mut first = vec![0u8; 116];
        first[0..4].copy_from_slice(&vb::VIRTIO_BLK_T_OUT.to_le_bytes());
        first[8..16].copy_from_slice(&8u64.to_le_bytes());
        first[16..].copy_from_slice(&pattern[..100]);
        m.write_slice(&first, GuestAddress(0x1000)).expect("w");
        m.write_slice(&pattern[100..5000], GuestAddress(0x10000))
            .expect("w");
        m.write_slice(&pattern[5000..], GuestAddress(0x20000))
            .expect("w");
        let segs = [
            Seg {
                addr: 0x1000,
                len: 116,
                write: false,
            },
            Seg {
                addr: 0x10000,
                len: 4900,
                write: false,
            },
            Seg {
                addr: 0x20000,
                len: 3192,
                write: false,
            },
            Seg {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        assert_eq!(go(&dev, &m, &segs).await, 1);
        assert_eq!(status(&m, 0x3000), S_OK);
        assert_eq!(&dev.contents()[4096..4096 + 8192], &pattern[..]);

        // Read it back into three buffers, the status merged into the last one.
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_IN, 8);
        let segs = [
            h,
            Seg {
                addr: 0x40000,
                len: 512,
                write: true,
            },
            Seg {
                addr: 0x50000,
                len: 7000,
                write: true,
            },
            Seg {
                addr: 0x60000,
                len: 681,
                write: true,
            },
        ];
        assert_eq!(go(&dev, &m, &segs).await, 8193);
        assert_eq!(status(&m, 0x60000 + 680), S_OK);
        let mut back = vec![0u8; 8192];
        m.read_slice(&mut back[..512], GuestAddress(0x40000))
            .expect("r");
        m.read_slice(&mut back[512..7512], GuestAddress(0x50000))
            .expect("r");
        m.read_slice(&mut back[7512..], GuestAddress(0x60000))
            .expect("r");
        assert_eq!(back, pattern);
    }

    #[tokio::test]
    async fn out_of_range_and_partial_sectors_fail_and_change_nothing() {
        let dev = MemDev::new(MIB as usize);
        let m = mem();
        // Last sector + one more: past the end.
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_OUT, MIB / 512 - 1);
        let segs = [
            h,
            Seg {
                addr: 0x10000,
                len: 1024,
                write: false,
            },
            Seg {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        m.write_slice(&[0xAB; 1024], GuestAddress(0x10000))
            .expect("w");
        go(&dev, &m, &segs).await;
        assert_eq!(status(&m, 0x3000), S_IOERR);
        // Not a whole sector.
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_OUT, 0);
        let segs = [
            h,
            Seg {
                addr: 0x10000,
                len: 100,
                write: false,
            },
            Seg {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        go(&dev, &m, &segs).await;
        assert_eq!(status(&m, 0x3000), S_IOERR);
        // A sector number whose byte offset overflows.
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_IN, u64::MAX / 256);
        let segs = [
            h,
            Seg {
                addr: 0x40000,
                len: 513,
                write: true,
            },
        ];
        assert_eq!(go(&dev, &m, &segs).await, 1);
        assert_eq!(status(&m, 0x40000 + 512), S_IOERR);
        // A buffer outside guest memory.
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_OUT, 0);
        let segs = [
            h,
            Seg {
                addr: 64 * MIB,
                len: 512,
                write: false,
            },
            Seg {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        go(&dev, &m, &segs).await;
        assert_eq!(status(&m, 0x3000), S_IOERR);
        assert!(
            dev.contents().iter().all(|&b| b == 0),
            "nothing was written"
        );
    }

    #[tokio::test]
    async fn discard_write_zeroes_flush_get_id_and_unknown_types() {
        let dev = MemDev::new(MIB as usize);
        let m = mem();
        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_OUT, 0);
        m.write_slice(&[0x5A; 16384], GuestAddress(0x10000))
            .expect("w");
        let segs = [
            h,
            Seg {
                addr: 0x10000,
                len: 16384,
                write: false,
            },
            Seg {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        go(&dev, &m, &segs).await;
        assert_eq!(status(&m, 0x3000), S_OK);
        // Two ranges to zero: sectors 8..16 and 24..32.
        for kind in [vb::VIRTIO_BLK_T_WRITE_ZEROES, vb::VIRTIO_BLK_T_DISCARD] {
            let h = header(&m, 0x1000, kind, 0);
            let mut r = [0u8; 32];
            r[0..8].copy_from_slice(&8u64.to_le_bytes());
            r[8..12].copy_from_slice(&8u32.to_le_bytes());
            r[16..24].copy_from_slice(&24u64.to_le_bytes());
            r[24..28].copy_from_slice(&8u32.to_le_bytes());
            m.write_slice(&r, GuestAddress(0x2000)).expect("w");
            let segs = [
                h,
                Seg {
                    addr: 0x2000,
                    len: 32,
                    write: false,
                },
                Seg {
                    addr: 0x3000,
                    len: 1,
                    write: true,
                },
            ];
            go(&dev, &m, &segs).await;
            assert_eq!(status(&m, 0x3000), S_OK, "type {kind}");
        }
        let c = dev.contents();
        assert!(c[..4096].iter().all(|&b| b == 0x5A));
        assert!(c[4096..8192].iter().all(|&b| b == 0));
        assert!(c[8192..12288].iter().all(|&b| b == 0x5A));
        assert!(c[12288..16384].iter().all(|&b| b == 0));

        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_FLUSH, 0);
        go(
            &dev,
            &m,
            &[
                h,
                Seg {
                    addr: 0x3000,
                    len: 1,
                    write: true,
                },
            ],
        )
        .await;
        assert_eq!(status(&m, 0x3000), S_OK);

        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_GET_ID, 0);
        let segs = [
            h,
            Seg {
                addr: 0x4000,
                len: 21,
                write: true,
            },
        ];
        assert_eq!(go(&dev, &m, &segs).await, 21);
        let mut id = [0u8; 21];
        m.read_slice(&mut id, GuestAddress(0x4000)).expect("r");
        assert_eq!(&id[..6], b"vol-a\0");
        assert_eq!(id[20], S_OK);

        let h = header(&m, 0x1000, vb::VIRTIO_BLK_T_SCSI_CMD, 0);
        go(
            &dev,
            &m,
            &[
                h,
                Seg {
                    addr: 0x3000,
                    len: 1,
                    write: true,
                },
            ],
        )
        .await;
        assert_eq!(status(&m, 0x3000), S_UNSUPP);
    }

    #[test]
    fn config_space_layout() {
        let c = Config {
            capacity_bytes: 10 * MIB,
            queues: 4,
            seg_max: 126,
        }
        .bytes();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().expect("8")), 20480);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().expect("4")), 126);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().expect("4")), 512);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().expect("2")), 4);
        assert_eq!(c[56], 1);
    }
}
