//! vhost-user-blk: a volume as a qemu guest's virtio-blk disk, with no NBD in between.
//!
//! qemu (`-device vhost-user-blk-pci,chardev=…`) connects to a unix socket this crate
//! listens on, shares the guest's memory with it (so the guest needs shared memory:
//! `memory-backend-memfd,share=on`) and hands it the virtqueues. The vhost-user protocol and
//! the rings are the rust-vmm crates' (`vhost-user-backend`, `virtio-queue`, `vm-memory`);
//! what is converge's is [`blk`]: a request's descriptors become calls on a
//! [`BlockDev`] — the same device the NBD server drives, so a disk attached this way has the
//! NBD export's semantics (epochs, redirection to the owner, failover, QoS).
//!
//! Threads: one per queue pops requests and spawns each on the tokio runtime given; a
//! request's task copies data between the guest's memory and the device and completes it
//! (used ring, then the guest's interrupt unless EVENT_IDX says it need not be sent). One
//! more thread speaks the vhost-user protocol, and one accepts the next connection.

pub mod blk;

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use converge_nbd::BlockDev;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Listener;
use vhost_user_backend::bitmap::BitmapMmapRegion;
use vhost_user_backend::{ShutdownHandle, VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_bindings::virtio_blk as vb;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

pub use blk::Stats;

/// The guest's memory, with the page log live migration reads (vm-memory marks a page
/// dirty on every write through it: data read for the guest and the used ring alike).
type Mem = GuestMemoryAtomic<GuestMemoryMmap<BitmapMmapRegion>>;

/// Largest number of queues a guest may use (`num-queues` of qemu's device).
pub const QUEUES_MAX: u16 = 16;
/// Largest ring a guest may give each queue (`queue-size`; qemu's default is 128).
pub const QUEUE_SIZE_MAX: u16 = 1024;
/// Data segments a request may have (advertised): qemu's default ring of 128 less the
/// header and status descriptors; larger requests come with indirect descriptors.
const SEG_MAX: u32 = 126;
/// How long a stopping queue waits for its requests in flight before it gives up on them.
const STOP_WAIT: Duration = Duration::from_secs(120);

/// How a disk is offered.
#[derive(Clone)]
pub struct Options {
    /// Queues offered (1..=QUEUES_MAX); the guest uses at most this many.
    pub queues: u16,
    /// The disk's serial (`VIRTIO_BLK_T_GET_ID`, /dev/disk/by-id), at most 20 bytes used.
    pub serial: String,
    /// Called once per guest connection, when the guest sends its first request: the
    /// guest runs here now (booted, or migrated in).
    pub on_start: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("queues", &self.queues)
            .field("serial", &self.serial)
            .field("on_start", &self.on_start.is_some())
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} queues: a disk has 1 to {QUEUES_MAX}")]
    Queues(u16),
    #[error("socket path {0}: longer than a unix socket address allows (107 bytes)")]
    PathTooLong(PathBuf),
    #[error("binding {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("vhost-user: {0}")]
    Daemon(String),
}

/// Requests popped from one queue and not yet completed.
#[derive(Default)]
struct InFlight {
    count: Mutex<u64>,
    idle: Condvar,
}

impl InFlight {
    fn add(&self) {
        *self.count.lock().expect("in-flight lock") += 1;
    }
    fn done(&self) {
        let mut n = self.count.lock().expect("in-flight lock");
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }
    /// Waits until none is in flight; false if `STOP_WAIT` passed first.
    fn wait_idle(&self) -> bool {
        let n = self.count.lock().expect("in-flight lock");
        let (n, _) = self
            .idle
            .wait_timeout_while(n, STOP_WAIT, |n| *n > 0)
            .expect("in-flight lock");
        *n == 0
    }
}

/// One connection's device: what the vhost-user handler calls.
struct Backend<D: BlockDev> {
    dev: Arc<D>,
    rt: tokio::runtime::Handle,
    mem: Mem,
    queues: u16,
    serial: Arc<[u8]>,
    stats: Arc<Stats>,
    event_idx: AtomicBool,
    inflight: Vec<Arc<InFlight>>,
    on_start: Option<Arc<dyn Fn() + Send + Sync>>,
    started: AtomicBool,
}

impl<D: BlockDev> Backend<D> {
    /// Pops every available request of `vring` and starts it.
    fn process(&self, vring: &VringRwLock<Mem>, queue: usize) -> io::Result<()> {
        let mem = self.mem.memory();
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        loop {
            let chain = {
                let mut st = vring.get_mut();
                let c = st.get_queue_mut().pop_descriptor_chain(mem.clone());
                if c.is_some() {
                    self.inflight[queue].add();
                }
                c
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let segs: Vec<blk::Seg> = chain
                .map(|d| blk::Seg {
                    addr: d.addr().0,
                    len: d.len(),
                    write: d.is_write_only(),
                })
                .collect();
            let (dev, mem, vring, serial, stats, inflight) = (
                self.dev.clone(),
                mem.clone(),
                vring.clone(),
                self.serial.clone(),
                self.stats.clone(),
                self.inflight[queue].clone(),
            );
            self.rt.spawn(async move {
                let cx = blk::Ctx {
                    dev: &*dev,
                    mem: &*mem,
                    serial: &serial,
                    stats: &stats,
                };
                let used = blk::execute(&cx, &segs).await;
                {
                    let mut st = vring.get_mut();
                    if let Err(e) = st.add_used(head, used) {
                        log::warn!("vhost-user-blk: completing request {head}: {e}");
                    }
                    let notify = !event_idx || st.needs_notification().unwrap_or(true);
                    if notify {
                        if let Err(e) = st.signal_used_queue() {
                            log::debug!("vhost-user-blk: interrupting the guest: {e}");
                        }
                    }
                }
                inflight.done();
            });
        }
        Ok(())
    }
}

impl<D: BlockDev> VhostUserBackend for Backend<D> {
    type Bitmap = BitmapMmapRegion;
    type Vring = VringRwLock<Mem>;

    fn num_queues(&self) -> usize {
        usize::from(self.queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(QUEUE_SIZE_MAX)
    }

    fn features(&self) -> u64 {
        let mut f = 1u64 << VIRTIO_F_VERSION_1
            | 1 << VIRTIO_RING_F_INDIRECT_DESC
            | 1 << VIRTIO_RING_F_EVENT_IDX
            | 1 << vb::VIRTIO_BLK_F_SEG_MAX
            | 1 << vb::VIRTIO_BLK_F_BLK_SIZE
            | 1 << vb::VIRTIO_BLK_F_TOPOLOGY
            | 1 << vb::VIRTIO_BLK_F_FLUSH
            | 1 << vb::VIRTIO_BLK_F_MQ
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
            // Live migration: writes into guest memory are logged (`Mem`).
            | VhostUserVirtioFeatures::LOG_ALL.bits();
        if self.dev.read_only() {
            f |= 1 << vb::VIRTIO_BLK_F_RO;
        } else {
            f |= 1 << vb::VIRTIO_BLK_F_DISCARD | 1 << vb::VIRTIO_BLK_F_WRITE_ZEROES;
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::LOG_SHMFD
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let cfg = blk::Config {
            capacity_bytes: self.dev.size_bytes(),
            queues: self.queues,
            seg_max: SEG_MAX,
        }
        .bytes();
        let (start, end) = (offset as usize, offset as usize + size as usize);
        let mut out = vec![0u8; size as usize];
        if start < cfg.len() {
            let n = end.min(cfg.len()) - start;
            out[..n].copy_from_slice(&cfg[start..start + n]);
        }
        out
    }

    fn update_memory(&self, _mem: Mem) -> io::Result<()> {
        // The handler updates the GuestMemoryAtomic this backend shares with it.
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // qemu stops a queue (migration, shutdown, reset) and reads where it ended: a
        // request popped but not completed would be lost, so wait for them.
        if let Some(f) = self.inflight.get(queue_index as usize) {
            if !f.wait_idle() {
                log::error!(
                    "vhost-user-blk: queue {queue_index} stopped with requests still in flight \
                     after {} s",
                    STOP_WAIT.as_secs()
                );
            }
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected events {evset:?}")));
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Err(io::Error::other(format!(
                "no queue for event {device_event}"
            )));
        };
        if !self.started.swap(true, Ordering::Relaxed) {
            if let Some(f) = &self.on_start {
                f();
            }
        }
        // One queue per thread: thread i serves queue i.
        if self.event_idx.load(Ordering::Relaxed) {
            loop {
                vring.disable_notification().map_err(io::Error::other)?;
                self.process(vring, thread_id)?;
                if !vring.enable_notification().map_err(io::Error::other)? {
                    break;
                }
            }
        } else {
            self.process(vring, thread_id)?;
        }
        Ok(())
    }
}

struct Shared {
    stop: AtomicBool,
    connected: AtomicBool,
    /// Ends the current connection (detach while a guest is attached).
    conn: Mutex<Option<ShutdownHandle>>,
}

/// One disk offered on one socket until dropped or [`Server::stop`]ped. One guest at a time
/// is served; when it disconnects (shutdown, reset, migrated away), the next may connect.
pub struct Server {
    path: PathBuf,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    stats: Arc<Stats>,
    queues: u16,
}

impl Server {
    /// Listens on `path` (a stale socket there is replaced; mode 0660) and serves `dev` to
    /// each guest that connects, its requests running on `rt`.
    pub fn start<D: BlockDev>(
        path: &Path,
        dev: Arc<D>,
        opts: Options,
        rt: tokio::runtime::Handle,
    ) -> Result<Server, Error> {
        if opts.queues == 0 || opts.queues > QUEUES_MAX {
            return Err(Error::Queues(opts.queues));
        }
        if path.as_os_str().len() > 107 {
            return Err(Error::PathTooLong(path.to_path_buf()));
        }
        let bind = |source| Error::Bind {
            path: path.to_path_buf(),
            source,
        };
        if path.exists() {
            std::fs::remove_file(path).map_err(bind)?;
        }
        let listener = UnixListener::bind(path).map_err(bind)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(bind)?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            conn: Mutex::new(None),
        });
        let stats = Arc::new(Stats::default());
        let queues = opts.queues;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let thread = {
            let (shared, stats) = (shared.clone(), stats.clone());
            std::thread::Builder::new()
                .name(format!("vhost-{name}"))
                .spawn(move || accept_loop(listener, dev, opts, rt, shared, stats))
                .map_err(|e| Error::Daemon(e.to_string()))?
        };
        Ok(Server {
            path: path.to_path_buf(),
            shared,
            thread: Some(thread),
            stats,
            queues,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// A guest is connected now.
    pub fn connected(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Disconnects the guest (if any: its disk fails), stops listening and removes the
    /// socket. Blocks until the serving threads are gone.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(c) = self.shared.conn.lock().expect("conn lock").take() {
            c.shutdown();
        }
        // Wake the accept: a connection that is closed at once.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

fn accept_loop<D: BlockDev>(
    listener: UnixListener,
    dev: Arc<D>,
    opts: Options,
    rt: tokio::runtime::Handle,
    shared: Arc<Shared>,
    stats: Arc<Stats>,
) {
    let mut listener = Listener::from(listener);
    let serial: Arc<[u8]> = opts.serial.as_bytes().into();
    while !shared.stop.load(Ordering::SeqCst) {
        let mem: Mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let backend = Arc::new(Backend {
            dev: dev.clone(),
            rt: rt.clone(),
            mem: mem.clone(),
            queues: opts.queues,
            serial: serial.clone(),
            stats: stats.clone(),
            event_idx: AtomicBool::new(false),
            inflight: (0..opts.queues).map(|_| Arc::default()).collect(),
            on_start: opts.on_start.clone(),
            started: AtomicBool::new(false),
        });
        let mut daemon = match VhostUserDaemon::new("vhost-user-blk".into(), backend, mem) {
            Ok(d) => d,
            Err(e) => {
                log::error!("vhost-user-blk: {e:?}; no more guests served on this socket");
                return;
            }
        };
        if let Err(e) = daemon.start(&mut listener) {
            if !shared.stop.load(Ordering::SeqCst) {
                log::error!("vhost-user-blk: accepting a guest: {e:?}; stopped");
            }
            stop_workers(&daemon);
            return;
        }
        // A way for `stop` to end this connection, kept before `stop` is looked at: a
        // stop that came meanwhile is seen below, a later one finds the handle.
        *shared.conn.lock().expect("conn lock") = daemon.shutdown_handle();
        if shared.stop.load(Ordering::SeqCst) {
            daemon.request_shutdown();
            let _ = daemon.wait();
            stop_workers(&daemon);
            return;
        }
        shared.connected.store(true, Ordering::Relaxed);
        log::info!("vhost-user-blk: a guest connected");
        let r = daemon.wait();
        shared.conn.lock().expect("conn lock").take();
        shared.connected.store(false, Ordering::Relaxed);
        stop_workers(&daemon);
        use vhost::vhost_user::Error as VuError;
        use vhost_user_backend::Error as DaemonError;
        match r {
            Ok(())
            | Err(DaemonError::HandleRequest(VuError::Disconnected))
            | Err(DaemonError::HandleRequest(VuError::PartialMessage)) => {
                log::info!("vhost-user-blk: the guest disconnected")
            }
            Err(e) => log::warn!("vhost-user-blk: the guest's connection ended: {e:?}"),
        }
    }
}

fn stop_workers<D: BlockDev>(daemon: &VhostUserDaemon<Arc<Backend<D>>>) {
    for h in daemon.get_epoll_handlers() {
        h.send_exit_event();
    }
}
