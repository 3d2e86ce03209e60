//! The daemon's start-up and its command line: opens this node's drives, joins the cluster
//! through etcd, serves peers (RPC), clients (NBD) and operators (HTTP API + /metrics)
//! until the node stops. `converged`'s `main` is [`main`].

use crate::config::Config;
use crate::node::{Allocator, LocalDrives, Node, Replicas, RpcHandler};
use crate::{
    api, auth, config, creds, etcd_upkeep, export, members, orphans, qos, repair, rotate,
    secret_files, tiering, usage, vhost, wear,
};
use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use converge_control::etcd::Etcd;
use converge_control::model::{Cluster, ControlError};
use converge_rpc::Hello;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "converged",
    version,
    about = "converge node daemon: contributes this node's drives to the cluster and serves volumes over NBD"
)]
struct Args {
    /// Config file (TOML): node id, addresses, etcd endpoints, drives.
    #[arg(long, short)]
    config: PathBuf,
    /// Check the config and the drives, then exit without joining the cluster.
    #[arg(long)]
    check: bool,
}

/// Raises the soft limit on open files to the hard limit: each drive, client and peer
/// connection holds a descriptor, and the default soft limit (1024) is reached by a busy node
/// long before the hard one (often 512 Ki or more).
use std::os::unix::fs::PermissionsExt;

fn raise_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write only the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            let was = lim.rlim_cur;
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                log::debug!("open files limit raised from {was} to {}", lim.rlim_max);
            }
        }
    }
}

/// The etcd client's settings, with the [etcd] section's files read.
fn etcd_security(
    c: &config::EtcdTlsConfig,
) -> Result<converge_control::etcd::EtcdSecurity, String> {
    let mut sec = match &c.ca_file {
        Some(ca) => converge_control::etcd::EtcdSecurity::from_pem_files(
            ca,
            c.cert_file.as_deref(),
            c.key_file.as_deref(),
        )
        .map_err(|e| e.to_string())?,
        None => converge_control::etcd::EtcdSecurity::default(),
    };
    if let Some(key) = &c.key_file {
        secret_files::check(key, "etcd client key")?;
    }
    if let (Some(user), Some(pw)) = (&c.username, &c.password_file) {
        secret_files::check(pw, "etcd password file")?;
        let password = std::fs::read_to_string(pw)
            .map_err(|e| format!("etcd password file {}: {e}", pw.display()))?;
        sec = sec.with_user(user.clone(), password.trim_end_matches(['\n', '\r']));
    }
    Ok(sec)
}

/// `converged`: reads the command line and the config, runs the node until it stops, and
/// exits with its status (3: this node was removed from the cluster).
pub fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_millis()
        .init();
    let args = Args::parse();
    // The config first: it says how many threads the runtime gets.
    let cfg = match Config::load(&args.config) {
        Ok(c) => c,
        Err(e) => {
            log::error!("{e}");
            eprintln!("converged: error: {e}");
            std::process::exit(1);
        }
    };
    raise_open_files_limit();
    // Whatever converged creates (drive files, sockets) is its user's alone unless it says
    // otherwise.
    // SAFETY: umask only sets the process's file mode creation mask.
    unsafe {
        libc::umask(0o077);
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cfg.threads {
        rt.worker_threads(n);
    }
    let rt = match rt.enable_all().thread_name("converged").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("converged: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(run(args, cfg)) {
        log::error!("{e:#}");
        eprintln!("converged: error: {e:#}");
        let removed = e
            .downcast_ref::<ControlError>()
            .is_some_and(|c| matches!(c, ControlError::NodeRemoved { .. }));
        std::process::exit(if removed { EXIT_REMOVED } else { 1 });
    }
}

/// Exit status of a node whose id was removed from the cluster: starting again cannot
/// help (the systemd unit does not restart on it).
const EXIT_REMOVED: i32 = 3;

async fn run(args: Args, cfg: Config) -> Result<()> {
    // A node that saw its own removal left a mark: etcd refuses its certificate now, so it
    // could not ask etcd.
    if creds::removed_mark(&cfg.tls_dir).is_some() {
        return Err(ControlError::NodeRemoved { id: cfg.node_id }.into());
    }
    let security = etcd_security(&cfg.etcd_tls).map_err(|e| anyhow!("etcd settings: {e}"))?;
    if cfg.admin_token_file.exists() {
        secret_files::check(&cfg.admin_token_file, "admin token file")
            .map_err(|e| anyhow!("{e}"))?;
    }
    if cfg.etcd_endpoints.iter().any(|e| e.starts_with("http://")) {
        log::warn!(
            "etcd at {:?} without TLS: anyone on the network path reads and writes the \
             control plane (epochs, placements, token hashes, the internal token); use \
             https:// endpoints with client certificates (docs/SECURITY.md, \"etcd\")",
            cfg.etcd_endpoints
        );
    }
    let etcd =
        Etcd::with_security(cfg.etcd_endpoints.clone(), security).map_err(|e| anyhow!("{e}"))?;
    let cluster = Cluster::new(etcd.clone());
    let cluster_rec = match cluster
        .init_or_load(&cfg.cluster_name, cfg.slab_size_bytes)
        .await
    {
        Ok(r) => r,
        Err(e) => {
            // Down through its removal, a node finds etcd refusing it; a peer can say why.
            if let Some(peer) = creds::removed_say_remembered_peers(&cfg).await {
                log::warn!(
                    "etcd does not answer this node, and node {peer} refuses its certificate \
                     as that of a removed node"
                );
                creds::mark_removed(&cfg.tls_dir, cfg.node_id.0);
                return Err(ControlError::NodeRemoved { id: cfg.node_id }.into());
            }
            bail!(
                "joining the cluster through etcd {:?}: {e}",
                cfg.etcd_endpoints
            );
        }
    };
    // A removed node stays out: before its drives are opened or recorded again.
    if cluster
        .is_removed(cfg.node_id)
        .await
        .map_err(|e| anyhow!("{e}"))?
    {
        return Err(ControlError::NodeRemoved { id: cfg.node_id }.into());
    }
    if cluster_rec.slab_size_bytes != cfg.slab_size_bytes {
        log::warn!(
            "config slab_size {} differs from the cluster's {}; using the cluster's",
            cfg.slab_size_bytes,
            cluster_rec.slab_size_bytes
        );
    }
    let mut cfg = cfg;
    cfg.slab_size_bytes = cluster_rec.slab_size_bytes;
    auth::bootstrap(&cluster, &cfg).await?;
    // Every port speaks TLS with this node's certificate: no certificate, no node. Every
    // handshake checks the revocation list, kept current from etcd from here on.
    let (revocations, revocation_state) = creds::load(&cluster).await?;
    let tls = converge_pki::NodeTls::load(&cfg.tls_dir, cfg.node_id.0)
        .map_err(|e| anyhow!("this node's TLS identity: {e}"))?
        .with_revocations(revocations.clone());
    if let Some(why) = tls.own_cert().ok().and_then(|me| revocations.refusal(&me)) {
        bail!(
            "this node's certificate is refused by the cluster ({why}): issue a new one with \
             `converge cert node` or `converge node join-token --replace`"
        );
    }
    if cfg.nbd_tcp.is_some() && !tls.has_clients_ca() {
        log::warn!(
            "no {} in {}: NBD/TCP takes only client certificates of the cluster CA (as made \
             before the clients CA), which also reach etcd until revoked; see \
             docs/SECURITY.md, \"Migrating\"",
            converge_pki::CLIENTS_CA_CERT,
            cfg.tls_dir.display()
        );
    }
    let tls_err = |e: converge_pki::PkiError| anyhow!("TLS settings: {e}");
    let peer_server = tls.peer_server().map_err(tls_err)?;
    let peer_client = tls.peer_client().map_err(tls_err)?;
    let api_server = tls.api_server().map_err(tls_err)?;
    let nbd_tls = tls.nbd_server().map_err(tls_err)?;
    let https_client = tls.https_client().map_err(tls_err)?;
    let opened = tiering::open_drives(&cfg, cluster_rec.cluster_id)?;
    if args.check {
        if let Some(p) = &cfg.etcd_crl_file {
            println!("etcd's revocation list is kept in {}", p.display());
        }
        if let Some(port) = cfg.etcd_client_port {
            println!(
                "when it gains a certificate, the connections to etcd's client port {port} \
                 on this host are reset"
            );
        }
        println!(
            "config and {} drives are fine",
            opened.tiers.len() + opened.caches.len()
        );
        return Ok(());
    }
    let lost = tiering::lost_cache_drives(&cluster, cfg.node_id, &opened).await;
    if !lost.is_empty() {
        let limit = Duration::from_secs(cfg.knobs.node_lease_ttl_s * 3 + 60);
        tiering::fence_out(&cluster, cfg.node_id, &lost, limit).await;
    }
    let drive_recs = opened.records.clone();
    let cache_paths = drive_recs
        .iter()
        .filter(|d| opened.caches.contains_key(&d.id))
        .map(|d| (d.id, d.path.clone()))
        .collect();
    let drives = opened.tiers.clone();

    // Bind everything before announcing ourselves, so peers never see a node that cannot
    // be reached.
    let rpc_listener = tokio::net::TcpListener::bind(cfg.rpc_addr)
        .await
        .with_context(|| format!("binding the peer RPC address {}", cfg.rpc_addr))?;
    let api_listener = tokio::net::TcpListener::bind(cfg.api_addr)
        .await
        .with_context(|| format!("binding the API address {}", cfg.api_addr))?;
    if cfg.nbd_socket.exists() {
        std::fs::remove_file(&cfg.nbd_socket)
            .with_context(|| format!("removing the old socket {}", cfg.nbd_socket.display()))?;
    }
    if let Some(dir) = cfg.nbd_socket.parent() {
        if !dir.exists() {
            std::fs::create_dir_all(dir).ok();
            // The socket's group must be able to reach it.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).ok();
        }
    }
    // Bound under the process's umask (0077: only this user), then opened to the group,
    // so there is no moment when others may connect: an NBD client reads and writes every
    // volume. Put qemu's user in the daemon's group to let it attach.
    let nbd_listener = tokio::net::UnixListener::bind(&cfg.nbd_socket)
        .with_context(|| format!("binding the NBD socket {}", cfg.nbd_socket.display()))?;
    std::fs::set_permissions(&cfg.nbd_socket, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting the mode of {}", cfg.nbd_socket.display()))?;
    let nbd_tcp = match cfg.nbd_tcp {
        Some(a) => Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("binding the NBD TCP address {a}"))?,
        ),
        None => None,
    };

    let lease_sent = tokio::time::Instant::now();
    let lease = etcd
        .lease_grant(cfg.knobs.node_lease_ttl_s.max(3) as i64)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let tenure = Arc::new(converge_volume::Tenure::new());
    tenure.extend(lease_sent + Node::lease_margin(cfg.knobs.node_lease_ttl_s.max(3)));
    let local = Arc::new(LocalDrives::new(drives.clone(), cluster.clone()));
    let hello = Hello::new(cluster_rec.cluster_id, cfg.node_id);
    let sampler = Arc::new(converge_engine::shards::AccessSampler::new());
    // The tier's policy is simulated at the caches' size together, in their mode (the
    // cache loop keeps the mode current: `tiering::infos`).
    sampler.set_tier(
        opened.caches.values().map(|c| c.log_bytes()).sum(),
        cfg.knobs.cache_low_watermark_pct,
        cfg.knobs.cache_high_watermark_pct,
        opened
            .caches
            .values()
            .next()
            .map_or(converge_types::CacheMode::ReadWrite, |c| c.mode()),
    );
    for t in drives.values() {
        t.set_sampler(sampler.clone());
    }
    let node = Arc::new(Node {
        sampler,
        replicas: Arc::new(Replicas::new(
            cfg.node_id,
            local.clone(),
            cluster.clone(),
            hello,
            cfg.knobs.clone(),
            peer_client,
            revocations.clone(),
        )),
        allocator: Arc::new(Allocator::new(
            cluster.clone(),
            cfg.node_id,
            cfg.knobs.placement_locality_pct,
        )),
        cfg: cfg.clone(),
        cluster: cluster.clone(),
        cluster_rec: cluster_rec.clone(),
        lease: Mutex::new(lease),
        tenure,
        drives,
        caches: opened.caches.clone(),
        cache_paths,
        fenced: Default::default(),
        volumes: tokio::sync::Mutex::new(Default::default()),
        qos_gate: Default::default(),
        wear: Default::default(),
        jobs: repair::Jobs::default(),
        throttle: converge_volume::resync::Throttle::new(cfg.knobs.resync_bytes_per_s),
        scrub_throttle: converge_volume::resync::Throttle::new(cfg.knobs.scrub_bytes_per_s),
        scrub_stats: Default::default(),
        failed_reported: Mutex::new(Default::default()),
        orphans_freed: Default::default(),
        takeovers_deferred: Default::default(),
        auth: auth::Auth::new(cluster.clone(), &cfg),
        revocations: revocations.clone(),
        https: https_client,
        me: Default::default(),
        vhost: Default::default(),
        members: Default::default(),
    });
    let _ = node.me.set(Arc::downgrade(&node));
    for d in &drive_recs {
        cluster.put_drive(d).await.map_err(|e| anyhow!("{e}"))?;
        // It opened and recovered: whatever failure was recorded is over (its old copies
        // were rebuilt elsewhere and are orphans now).
        cluster
            .set_drive_failed(d.id, None)
            .await
            .map_err(|e| anyhow!("{e}"))?;
    }
    // A drive of this node that did not open (replaced by a blank one, or taken out of the
    // configuration while the node was down) failed as far as its copies go: they are
    // rebuilt elsewhere.
    let present: Vec<_> = drive_recs.iter().map(|d| d.id).collect();
    for d in cluster
        .fail_missing_drives(cfg.node_id, &present)
        .await
        .map_err(|e| anyhow!("{e}"))?
    {
        log::warn!(
            "drive {d} of this node is not in its configuration or did not open as itself \
             (replaced?): recorded failed, its copies are rebuilt on other drives"
        );
    }
    cluster
        .register_node(&node.node_record(), lease)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    creds::register_own(&cluster, &tls, cfg.node_id.0).await?;
    let revocation_watch = {
        // Whom to ask whether this node was removed if etcd stops answering it.
        let at_start: Vec<_> = match cluster.live_nodes().await {
            Ok(nodes) => nodes.into_iter().map(|n| (n.id, n.rpc_addr)).collect(),
            Err(e) => {
                log::warn!("reading the live nodes: {e}");
                Vec::new()
            }
        };
        creds::remember_peers(&cfg.tls_dir, cluster_rec.cluster_id, &at_start);
        let watch = creds::watch(
            cluster.clone(),
            cfg.node_id,
            revocations.clone(),
            cfg.etcd_crl_file
                .clone()
                .map(|p| creds::CrlFile::new(p, tls.clone(), cfg.etcd_client_port)),
            revocation_state,
            creds::RemovalProbe::new(node.replicas.clone(), at_start),
        );
        let node = node.clone();
        tokio::spawn(async move {
            watch.await;
            // `converge node remove` finished: nothing of the cluster is here any more.
            log::warn!(
                "node {} was removed from the cluster (converge node remove); stopping",
                node.cfg.node_id
            );
            creds::mark_removed(&node.cfg.tls_dir, node.cfg.node_id.0);
            node.drop_all_volumes().await;
            std::process::exit(0);
        })
    };
    log::info!(
        "node {} ({}) joined cluster {} ({}) with {} drives; rpc {}, api {}, nbd {}",
        cfg.node_id,
        cfg.name,
        cluster_rec.name,
        cluster_rec.cluster_id,
        drive_recs.len(),
        cfg.rpc_addr,
        cfg.api_addr,
        cfg.nbd_socket.display()
    );

    let rpc = tokio::spawn(converge_rpc::serve(
        rpc_listener,
        cluster_rec.cluster_id,
        cfg.node_id,
        Arc::new(RpcHandler {
            local,
            node: node.clone(),
        }),
        cfg.knobs.clone(),
        Some(converge_rpc::ServerTls {
            config: peer_server,
            revocations: revocations.clone(),
        }),
    ));
    let api = tokio::spawn(api::serve(api_listener, node.clone(), api_server));
    let exports = Arc::new(export::Exports { node: node.clone() });
    let nbd_cfg = converge_nbd::ServerConfig {
        inflight_max: cfg.knobs.nbd_inflight_max,
        ..Default::default()
    };
    let nbd = tokio::spawn(converge_nbd::serve_unix(
        nbd_listener,
        exports.clone(),
        nbd_cfg.clone(),
    ));
    // NBD over TCP: mutual TLS (a client certificate of the cluster's CA) unless the
    // operator turned it off for a trusted network.
    let nbd_tcp_cfg = converge_nbd::ServerConfig {
        tls: if cfg.nbd_tcp_insecure {
            None
        } else {
            Some(nbd_tls)
        },
        // A client whose certificate is revoked is disconnected, not only refused next time.
        client_watch: Some(Arc::new(creds::NbdClientWatch(revocations.clone()))),
        ..nbd_cfg
    };
    if nbd_tcp.is_some() && cfg.nbd_tcp_insecure {
        log::warn!(
            "NBD on {} without TLS (nbd_tcp_insecure = true): anyone who reaches it reads \
             and writes every volume",
            cfg.nbd_tcp.map(|a| a.to_string()).unwrap_or_default()
        );
    }
    let nbd_tcp = nbd_tcp.map(|l| tokio::spawn(converge_nbd::serve_tcp(l, exports, nbd_tcp_cfg)));
    let vhost_restore = tokio::spawn(vhost::restore(node.clone()));
    let keepalive = tokio::spawn(keep_alive(node.clone()));
    let membership = tokio::spawn(members::run(node.clone()));
    let repairer = tokio::spawn(repair::run(node.clone()));
    let publisher = tokio::spawn(repair::publish(node.clone()));
    let caches = tokio::spawn(tiering::run(node.clone()));
    let rotator = tokio::spawn(rotate::run(node.clone()));
    let usage = tokio::spawn(usage::publish(node.clone()));
    let qos = tokio::spawn(qos::run(node.clone()));
    let wear = tokio::spawn(wear::run(node.clone()));
    let upkeep = tokio::spawn(etcd_upkeep::run(node.clone()));
    // Copies deleted or moved away while this node was down are freed now.
    let sweep = {
        let node = node.clone();
        tokio::spawn(async move { orphans::reclaim_logged(&node, "start-up").await })
    };

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let (mut rpc, mut api, mut nbd) = (rpc, api, nbd);
    tokio::select! {
        _ = term.recv() => log::info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => log::info!("SIGINT: shutting down"),
        r = &mut rpc => bail!("peer RPC server stopped: {r:?}"),
        r = &mut api => bail!("API server stopped: {r:?}"),
        r = &mut nbd => bail!("NBD server stopped: {r:?}"),
    }
    keepalive.abort();
    revocation_watch.abort();
    membership.abort();
    sweep.abort();
    repairer.abort();
    publisher.abort();
    caches.abort();
    rotator.abort();
    usage.abort();
    qos.abort();
    wear.abort();
    upkeep.abort();
    nbd.abort();
    if let Some(t) = nbd_tcp {
        t.abort();
    }
    vhost_restore.abort();
    {
        // Guests lose their vhost-user disks (qemu reconnects when the node is back).
        let node = node.clone();
        let _ = tokio::task::spawn_blocking(move || vhost::stop_all(&node)).await;
    }
    // No new I/O from here: destage the caches so a removed cache drive costs nothing.
    rpc.abort();
    tiering::shutdown(&node, Duration::from_secs(60)).await;
    // The destage's writes counted too: a clean restart keeps every byte of the count.
    wear::record(&node).await;
    api.abort();
    // Every acked write is already durable; leaving the cluster promptly lets others see
    // this node as down now rather than when the lease expires.
    let _ = std::fs::remove_file(&cfg.nbd_socket);
    if let Err(e) = etcd.lease_revoke(node.lease()).await {
        log::warn!("could not revoke the node lease: {e}");
    }
    log::info!("stopped");
    Ok(())
}

/// Keep the node lease alive, and with it this node's tenure (the time it may serve as an
/// owner). If the lease expired (etcd unreachable too long), take a new one and register
/// again. The tenure ends by itself when keepalives stop being confirmed, whether or not
/// etcd can be asked: a partitioned owner stops serving before its lease can expire.
async fn keep_alive(node: Arc<Node>) {
    let ttl = node.cfg.knobs.node_lease_ttl_s.max(3);
    let period = Duration::from_millis(ttl * 1000 / 3);
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        wait = period;
        if node.fenced.load(std::sync::atomic::Ordering::Acquire) {
            continue;
        }
        let lease = node.lease();
        let sent = tokio::time::Instant::now();
        match node.cluster.etcd().lease_keepalive(lease).await {
            Ok(left) if left > 0 => {
                let left = (left as u64).min(ttl);
                node.tenure.extend(sent + Node::lease_margin(left));
            }
            Ok(_) => {
                // Our ownerships were bound to the lease: other nodes may serve those
                // volumes now (and have fenced us). Stop serving them; clients re-route.
                node.tenure.revoke();
                node.drop_all_volumes().await;
                log::warn!("node lease expired; registering again");
                match node.grant_lease().await {
                    Ok(l) => {
                        if let Err(e) = node.cluster.register_node(&node.node_record(), l).await {
                            log::error!("registering again failed: {e}");
                        }
                    }
                    Err(e) => log::error!("etcd lease grant failed: {e}"),
                }
            }
            Err(e) => {
                log::warn!(
                    "etcd keepalive failed: {e}; this node serves volumes for {:?} more",
                    node.tenure.left().unwrap_or_default()
                );
                // Try again soon: the tenure runs out either way.
                wait = Duration::from_millis(500).min(period);
            }
        }
    }
}
