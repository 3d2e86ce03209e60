//! A simulated drive that loses or tears unsynced writes on power loss and rots bits at
//! rest, deterministically from a seed: used by the crash tests here and the cluster simulator.

use crate::file::BlockFile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// Unit in which a write can tear: a torn write persists a random subset of these.
pub const TORN_SECTOR_BYTES: usize = 512;

/// What a crash does to writes not yet covered by a sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashMode {
    /// Power loss: each is dropped, kept whole, or torn into a random subset of its
    /// `tear_bytes` units (512: sector atomicity; 4096: a device with atomic 4 KiB writes).
    PowerLoss { tear_bytes: usize },
    /// The process dies (kill -9) and the machine stays up: every write it issued persists.
    ProcessKill,
}

struct State {
    mode: CrashMode,
    /// What reads see: the durable image plus every write since the last sync.
    current: Vec<u8>,
    /// What survives power loss.
    durable: Vec<u8>,
    /// Writes not yet covered by a sync, oldest first.
    pending: Vec<(u64, Vec<u8>)>,
    /// Bumped at each crash; handles of an older incarnation get errors (the process died).
    incarnation: u64,
    /// Crash automatically when this many more writes have been issued.
    crash_after: Option<(u64, u64)>,
    failing: bool,
    writes: u64,
    syncs: u64,
}

/// An in-memory drive with power-loss semantics. Cloning the handle shares the drive.
///
/// After [`FaultyFile::crash`], this handle and every other handle of the drive fail all
/// I/O (the process that used them is dead); call [`FaultyFile::reattach`] to get a handle
/// for the "rebooted" machine, which sees the post-crash durable image.
#[derive(Clone)]
pub struct FaultyFile {
    state: Arc<Mutex<State>>,
    incarnation: u64,
    len: u64,
}

fn dead() -> io::Error {
    io::Error::other("simulated drive lost power; reattach after the crash")
}

impl FaultyFile {
    /// A blank (all zero) drive of `len_bytes`.
    pub fn new(len_bytes: u64) -> FaultyFile {
        let len = usize::try_from(len_bytes).expect("simulated drive must fit in memory");
        FaultyFile {
            state: Arc::new(Mutex::new(State {
                mode: CrashMode::PowerLoss {
                    tear_bytes: TORN_SECTOR_BYTES,
                },
                current: vec![0; len],
                durable: vec![0; len],
                pending: Vec::new(),
                incarnation: 0,
                crash_after: None,
                failing: false,
                writes: 0,
                syncs: 0,
            })),
            incarnation: 0,
            len: len_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the images half-updated in a way that
        // matters to a simulation, so recover from poisoning instead of cascading panics.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A handle for the current incarnation (after a crash: the rebooted machine's view).
    pub fn reattach(&self) -> FaultyFile {
        let inc = self.lock().incarnation;
        FaultyFile {
            state: self.state.clone(),
            incarnation: inc,
            len: self.len,
        }
    }

    /// What later crashes do (default: power loss with 512-byte sector atomicity).
    pub fn set_crash_mode(&self, mode: CrashMode) {
        self.lock().mode = mode;
    }

    /// A crash in the current mode; by default power loss: each unsynced write is dropped,
    /// kept whole, or torn (a random subset of its 512-byte sectors persists), in issue
    /// order. Deterministic given `rng_seed`.
    pub fn crash(&self, rng_seed: u64) {
        let mut st = self.lock();
        Self::crash_locked(&mut st, rng_seed);
    }

    fn crash_locked(st: &mut State, rng_seed: u64) {
        let mut rng = StdRng::seed_from_u64(rng_seed);
        let pending = std::mem::take(&mut st.pending);
        let tear = match st.mode {
            CrashMode::PowerLoss { tear_bytes } => tear_bytes.max(1),
            CrashMode::ProcessKill => 0,
        };
        for (off, data) in pending {
            let off = off as usize;
            let fate = if tear == 0 { 1 } else { rng.gen_range(0..3u8) };
            match fate {
                0 => {}
                1 => st.durable[off..off + data.len()].copy_from_slice(&data),
                _ => {
                    for (i, sector) in data.chunks(tear).enumerate() {
                        if rng.gen_bool(0.5) {
                            let o = off + i * tear;
                            st.durable[o..o + sector.len()].copy_from_slice(sector);
                        }
                    }
                }
            }
        }
        st.current.clone_from(&st.durable);
        st.incarnation += 1;
        st.crash_after = None;
    }

    /// Arms a crash that happens just before the `writes`-th write from now is applied
    /// (that write is lost), so a test can crash at a precise point, e.g. mid-checkpoint.
    pub fn crash_after_writes(&self, writes: u64, rng_seed: u64) {
        self.lock().crash_after = Some((writes, rng_seed));
    }

    /// True once an armed crash has fired (or any crash happened) since this handle was made.
    pub fn crashed(&self) -> bool {
        self.lock().incarnation != self.incarnation
    }

    /// Flips bit `bit` (0..8) of the byte at `offset`, at rest (durable and visible).
    pub fn rot(&self, offset: u64, bit: u8) {
        let mut st = self.lock();
        let o = offset as usize;
        st.current[o] ^= 1 << (bit % 8);
        st.durable[o] ^= 1 << (bit % 8);
    }

    /// Makes every I/O fail (a dead or unplugged drive) until cleared.
    pub fn set_failing(&self, failing: bool) {
        self.lock().failing = failing;
    }

    /// Writes issued and syncs done so far (all incarnations).
    pub fn counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.writes, st.syncs)
    }

    /// Number of writes that would be at risk if power failed now.
    pub fn unsynced_writes(&self) -> usize {
        self.lock().pending.len()
    }

    fn check(&self, st: &State, offset: u64, len: usize) -> io::Result<()> {
        if st.incarnation != self.incarnation {
            return Err(dead());
        }
        if st.failing {
            return Err(io::Error::other("simulated drive failure"));
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "I/O at {offset}+{len} beyond simulated drive of {} bytes",
                    self.len
                ),
            ));
        }
        Ok(())
    }
}

impl BlockFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.lock();
        self.check(&st, offset, buf.len())?;
        let o = offset as usize;
        buf.copy_from_slice(&st.current[o..o + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut st = self.lock();
        self.check(&st, offset, buf.len())?;
        st.writes += 1;
        if let Some((left, seed)) = st.crash_after {
            if left <= 1 {
                Self::crash_locked(&mut st, seed);
                return Err(dead());
            }
            st.crash_after = Some((left - 1, seed));
        }
        let o = offset as usize;
        st.current[o..o + buf.len()].copy_from_slice(buf);
        st.pending.push((offset, buf.to_vec()));
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut st = self.lock();
        self.check(&st, 0, 0)?;
        st.syncs += 1;
        let pending = std::mem::take(&mut st.pending);
        for (off, data) in pending {
            let o = off as usize;
            st.durable[o..o + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    fn len_bytes(&self) -> u64 {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synced_writes_survive_unsynced_may_not() {
        let f = FaultyFile::new(1 << 16);
        f.write_at(&[1u8; 4096], 0).unwrap();
        f.sync().unwrap();
        f.write_at(&[2u8; 4096], 4096).unwrap();
        f.crash(7);
        let mut b = [0u8; 4096];
        assert!(f.read_at(&mut b, 0).is_err(), "old incarnation is dead");
        let g = f.reattach();
        g.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [1u8; 4096]);
        g.read_at(&mut b, 4096).unwrap();
        assert!(b.chunks(512).all(|s| s.iter().all(|&x| x == s[0])));
    }

    #[test]
    fn crash_is_deterministic_and_tears_sectors() {
        let image = |seed| {
            let f = FaultyFile::new(1 << 16);
            for i in 0..8u8 {
                f.write_at(&[i + 1; 8192], u64::from(i) * 8192).unwrap();
            }
            f.crash(seed);
            let g = f.reattach();
            let mut b = vec![0u8; 1 << 16];
            g.read_at(&mut b, 0).unwrap();
            b
        };
        assert_eq!(image(3), image(3));
        let torn = (0..20u64).any(|s| {
            image(s)
                .chunks(8192)
                .any(|w| w.contains(&0) && w.iter().any(|&x| x != 0))
        });
        assert!(torn, "some seed must tear a write");
    }

    #[test]
    fn rot_and_crash_after() {
        let f = FaultyFile::new(8192);
        f.write_at(&[0u8; 4096], 0).unwrap();
        f.sync().unwrap();
        f.rot(10, 3);
        let mut b = [0u8; 4096];
        f.read_at(&mut b, 0).unwrap();
        assert_eq!(b[10], 8);
        f.crash_after_writes(2, 1);
        f.write_at(&[5u8; 512], 0).unwrap();
        assert!(f.write_at(&[6u8; 512], 512).is_err());
        assert!(f.crashed());
    }
}
