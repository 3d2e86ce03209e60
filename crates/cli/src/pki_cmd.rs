//! `converge cluster init` and `converge cert`: the cluster's two CAs (the cluster CA for
//! nodes and etcd, the clients CA for NBD clients) and the certificates they sign (see
//! docs/SECURITY.md). Everything here works on files, no node needs to be running, except
//! `cert revoke`, which tells the cluster through the API.

use anyhow::{anyhow, bail, Result};
use clap::Subcommand;
use converge_pki::{Ca, CaKind, NewKey, Subject};
use std::path::{Path, PathBuf};

/// The name of etcd's revocation list beside a member's certificate (`cert etcd`).
pub const ETCD_CRL: &str = "revoked.crl";

/// Where an installed node keeps its PKI directory.
pub const DEFAULT_PKI_DIR: &str = "/etc/converge/pki";

#[derive(Subcommand)]
pub enum CertCmd {
    /// Make a node's key and certificate (on the host that holds the CA key), to copy to
    /// the node's PKI directory with its ca.crt.
    Node {
        /// The CA's directory (ca.crt, ca.key).
        #[arg(long, default_value = DEFAULT_PKI_DIR)]
        ca_dir: PathBuf,
        /// The node id (as in its converged.toml).
        #[arg(long)]
        node: u32,
        /// An IP address or DNS name clients use for this node's API and NBD port
        /// (repeat for several).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Where to write ca.crt, node.crt and node.key (made 0700).
        #[arg(long)]
        out: PathBuf,
    },
    /// Make the certificate of an etcd member (server and peer use), for the addresses it
    /// listens on: server.crt and server.key, with ca.crt, for etcd's --cert-file,
    /// --key-file, --peer-cert-file, --peer-key-file and --trusted-ca-file.
    Etcd {
        /// The CA's directory (ca.crt, ca.key).
        #[arg(long, default_value = DEFAULT_PKI_DIR)]
        ca_dir: PathBuf,
        /// An IP address or DNS name the member listens on (repeat for several).
        #[arg(long = "host", required = true)]
        hosts: Vec<String>,
        /// Where to write ca.crt, server.crt and server.key (made 0700).
        #[arg(long)]
        out: PathBuf,
    },
    /// Revoke certificates: every node refuses them from its next handshake (peer RPC,
    /// API, NBD/TCP), and etcd from its next connection (its CRL file). For a leaked NBD
    /// client certificate, a node certificate whose key leaked (issue the node a new one),
    /// or an etcd member's. Needs an admin API token. `node remove` revokes a node's
    /// certificates by itself.
    Revoke {
        /// Certificate files (PEM) to revoke.
        files: Vec<PathBuf>,
        /// Serial numbers to revoke (hex, as `openssl x509 -noout -serial` prints them),
        /// when the file is gone.
        #[arg(long = "serial")]
        serials: Vec<String>,
        /// Why (kept with the revocation).
        #[arg(long)]
        reason: Option<String>,
    },
    /// The revoked certificates (needs an admin API token).
    Revoked,
    /// Make a certificate for an NBD client (a hypervisor host, a backup tool), in the
    /// layout qemu's tls-creds-x509 and libnbd's tls-certificates read: ca-cert.pem,
    /// client-cert.pem, client-key.pem. Signed by the clients CA (clients-ca.crt beside
    /// ca.crt, made on first use), which only the NBD/TCP port trusts.
    Client {
        /// The CA's directory (ca.crt, ca.key).
        #[arg(long, default_value = DEFAULT_PKI_DIR)]
        ca_dir: PathBuf,
        /// What it is for: 1 to 48 of a-z, 0-9 and '-', e.g. qemu-host4.
        #[arg(long)]
        name: String,
        /// Where to write the three files (made 0700).
        #[arg(long)]
        out: PathBuf,
    },
}

fn pki<T>(r: Result<T, converge_pki::PkiError>) -> Result<T> {
    r.map_err(|e| anyhow!("{e}"))
}

/// `converge cluster init`: a new CA in `dir`, and the first node's certificate if asked.
pub fn init(dir: &Path, node: Option<u32>, hosts: &[String]) -> Result<()> {
    if dir.join(converge_pki::CA_KEY).exists() {
        bail!(
            "{} already holds a CA key: this cluster is initialised (a second CA would \
             split it in two). Use `converge cert node` to add nodes",
            dir.display()
        );
    }
    if node.is_some() == hosts.is_empty() {
        bail!("give --node and --host together (the first node's id and addresses), or neither");
    }
    let ca = pki(Ca::generate())?;
    pki(ca.write(dir))?;
    pki(Ca::generate_kind(CaKind::Clients).and_then(|c| c.write(dir)))?;
    println!("cluster CA and NBD clients CA written to {}", dir.display());
    println!(
        "  {}  (share it: clients check nodes against it)",
        dir.join(converge_pki::CA_CERT).display()
    );
    println!(
        "  {}  (keep it secret: whoever holds it can add nodes)",
        dir.join(converge_pki::CA_KEY).display()
    );
    println!(
        "  {} and {}  (sign NBD client certificates; nodes need the .crt)",
        dir.join(converge_pki::CLIENTS_CA_CERT).display(),
        dir.join(converge_pki::CLIENTS_CA_KEY).display()
    );
    println!("  fingerprint (SHA-256): {}", ca.fingerprint());
    if let Some(id) = node {
        node_files(&ca, dir, id, hosts)?;
        println!(
            "node {id}'s certificate and key written to {}",
            dir.display()
        );
    }
    println!(
        "\nnext: for each other node, `converge cert node --ca-dir {} --node ID --host ADDRESS \
         --out DIR` and copy DIR to that node's {DEFAULT_PKI_DIR}; for NBD clients, \
         `converge cert client`",
        dir.display()
    );
    Ok(())
}

fn node_files(ca: &Ca, out: &Path, id: u32, hosts: &[String]) -> Result<()> {
    let key = pki(NewKey::generate())?;
    let cert = pki(ca.issue(
        &Subject::Node {
            id,
            hosts: hosts.to_vec(),
        },
        &key.public_key(),
    ))?;
    pki(converge_pki::write_node_dir(
        out,
        ca.cert_pem(),
        &cert,
        &key.pem(),
    ))
}

/// Copies the clients CA's certificate (if `from` has one) into a node's PKI directory.
fn copy_clients_ca(from: &Path, out: &Path) -> Result<()> {
    let src = from.join(converge_pki::CLIENTS_CA_CERT);
    if from != out && src.exists() {
        let pem = std::fs::read_to_string(&src)?;
        pki(converge_pki::write_clients_ca(out, &pem))?;
    }
    Ok(())
}

/// The client directory's `ca-cert.pem`: the cluster CA (to check nodes) and the clients CA
/// (qemu checks its own certificate against the same file).
fn client_ca_bundle(cluster: &Ca, clients: &Ca) -> String {
    format!("{}{}", cluster.cert_pem(), clients.cert_pem())
}

/// Makes an NBD client's directory (`lab` and `cert client`), signed by the clients CA of
/// `ca_dir` (made if missing: `made`). The certificate's serial.
pub fn client_files(ca_dir: &Path, name: &str, out: &Path) -> Result<(String, bool)> {
    pki(converge_pki::check_client_name(name))?;
    let cluster = pki(Ca::load(ca_dir))?;
    let (clients, made) = pki(Ca::load_or_make_clients(ca_dir))?;
    let key = pki(NewKey::generate())?;
    let cert = pki(clients.issue(
        &Subject::Client {
            name: name.to_string(),
        },
        &key.public_key(),
    ))?;
    pki(converge_pki::write_client_dir(
        out,
        &client_ca_bundle(&cluster, &clients),
        &cert,
        &key.pem(),
    ))?;
    let serial = pki(converge_pki::cert_info_pem(cert.as_bytes()))?.serial;
    Ok((serial, made))
}

/// An empty revocation list for etcd's `--client-crl-file`, signed by the cluster CA, unless
/// `path` exists (etcd refuses every connection while the file it names is missing).
pub fn initial_etcd_crl(ca: &Ca, path: &Path) -> Result<()> {
    if !path.exists() {
        let pem = pki(ca.crl_pem(std::iter::empty()))?;
        pki(converge_pki::write_file(path, pem.as_bytes(), 0o644))?;
    }
    Ok(())
}

/// `converge cert revoke`.
fn revoke(
    files: &[PathBuf],
    serials: &[String],
    reason: Option<&str>,
    json_out: bool,
    api: &dyn Fn() -> Result<String>,
) -> Result<()> {
    if files.is_empty() && serials.is_empty() {
        bail!("name certificate files to revoke, or --serial HEX");
    }
    let mut asks = Vec::new();
    for f in files {
        let pem = std::fs::read(f).map_err(|e| anyhow!("{}: {e}", f.display()))?;
        let info =
            converge_pki::cert_info_pem(&pem).map_err(|e| anyhow!("{}: {e}", f.display()))?;
        asks.push(converge_api::RevokeCert {
            serial: info.serial.clone(),
            subject: Some(info.describe()),
            reason: reason.map(str::to_string),
        });
    }
    for s in serials {
        asks.push(converge_api::RevokeCert {
            serial: pki(converge_pki::check_serial(s))?,
            subject: None,
            reason: reason.map(str::to_string),
        });
    }
    let base = api()?;
    let mut done = Vec::new();
    for a in &asks {
        let body = serde_json::to_value(a)?;
        let r: converge_api::RevokedCert =
            crate::http::call(&base, "POST", "/v1/certs/revoke", Some(&body))?;
        if !json_out {
            println!("revoked {} (serial {})", r.subject, r.serial);
        }
        done.push(r);
    }
    if json_out {
        println!("{}", serde_json::to_string_pretty(&done)?);
    }
    Ok(())
}

pub fn run(c: &CertCmd, json_out: bool, api: &dyn Fn() -> Result<String>) -> Result<()> {
    match c {
        CertCmd::Node {
            ca_dir,
            node,
            hosts,
            out,
        } => {
            let ca = pki(Ca::load(ca_dir))?;
            if out.join(converge_pki::CA_KEY).exists() && out != ca_dir {
                bail!(
                    "{} holds a CA key; write node files elsewhere",
                    out.display()
                );
            }
            node_files(&ca, out, *node, hosts)?;
            copy_clients_ca(ca_dir, out)?;
            println!(
                "node {node}: {} and {} written (with ca.crt) to {}; install them as the \
                 node's [tls] dir (default {DEFAULT_PKI_DIR}) and restart converged",
                converge_pki::NODE_CERT,
                converge_pki::NODE_KEY,
                out.display()
            );
        }
        CertCmd::Etcd { ca_dir, hosts, out } => {
            let ca = pki(Ca::load(ca_dir))?;
            let key = pki(NewKey::generate())?;
            let cert = pki(ca.issue(
                &Subject::Etcd {
                    hosts: hosts.clone(),
                },
                &key.public_key(),
            ))?;
            pki(converge_pki::make_dir(out))?;
            pki(converge_pki::write_file(
                &out.join("server.key"),
                key.pem().as_bytes(),
                0o600,
            ))?;
            pki(converge_pki::write_file(
                &out.join("server.crt"),
                cert.as_bytes(),
                0o644,
            ))?;
            pki(converge_pki::write_file(
                &out.join(converge_pki::CA_CERT),
                ca.cert_pem().as_bytes(),
                0o644,
            ))?;
            initial_etcd_crl(&ca, &out.join(ETCD_CRL))?;
            println!(
                "etcd member certificate for {}: server.crt, server.key, ca.crt and an empty \
                 {ETCD_CRL} (for etcd's --client-crl-file; the converged on that host keeps it \
                 current when its [tls] etcd_crl_file names it) written to {}",
                hosts.join(", "),
                out.display()
            );
        }
        CertCmd::Client { ca_dir, name, out } => {
            let (serial, made) = client_files(ca_dir, name, out)?;
            println!(
                "client {name}: ca-cert.pem, client-cert.pem, client-key.pem written to {} \
                 (serial {serial}; `converge cert revoke {}/client-cert.pem` ends it)\n\
                 qemu: --object tls-creds-x509,id=tls0,dir={},endpoint=client and \
                 tls-creds=tls0 on the nbd drive\nlibnbd tools: \
                 nbds://NODE:PORT/VOLUME?tls-certificates={}",
                out.display(),
                out.display(),
                out.display(),
                out.display()
            );
            if made {
                eprintln!(
                    "made the NBD clients CA ({}): copy it into every node's PKI directory \
                     (default {DEFAULT_PKI_DIR}) and restart the nodes (`converge cluster \
                     rolling-restart`); until then they check NBD clients against the cluster \
                     CA and refuse this certificate",
                    ca_dir.join(converge_pki::CLIENTS_CA_CERT).display()
                );
            }
        }
        CertCmd::Revoke {
            files,
            serials,
            reason,
        } => revoke(files, serials, reason.as_deref(), json_out, api)?,
        CertCmd::Revoked => {
            let v: Vec<converge_api::RevokedCert> =
                crate::http::call(&api()?, "GET", "/v1/certs/revoked", None)?;
            if json_out {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                println!(
                    "{:<34} {:<12} {:<28} REASON",
                    "SERIAL", "REVOKED", "SUBJECT"
                );
                for r in v {
                    println!(
                        "{:<34} {:<12} {:<28} {}",
                        r.serial, r.revoked_unix, r.subject, r.reason
                    );
                }
            }
        }
    }
    Ok(())
}

/// `converge node join`: a key made here, a certificate from the cluster for it.
pub fn join(api: &str, token: &str, dir: &Path, json_out: bool) -> Result<()> {
    let parts: Vec<&str> = token.trim().split('.').collect();
    let [prefix, _, _, fingerprint] = parts.as_slice() else {
        bail!(
            "not a join token (cvj.<id>.<secret>.<fingerprint>, from `converge node join-token`)"
        );
    };
    if *prefix != "cvj" {
        bail!("not a join token (it starts cvj.); API tokens (cvt.) cannot join a node");
    }
    if dir.join(converge_pki::NODE_KEY).exists() {
        bail!(
            "{} already holds a node key: this host has an identity; move it away first if \
             it is to be replaced",
            dir.display()
        );
    }
    crate::http::pin_ca(fingerprint)?;
    let node = fetch_certificate(api, token, dir, Some(fingerprint))?;
    if json_out {
        println!("{}", serde_json::json!({"node": node, "pki": dir}));
    } else {
        println!(
            "node {node}: certificate, key and CA written to {}; set [node] id = {node} and \
             [tls] dir in converged.toml and start converged",
            dir.display(),
        );
    }
    Ok(())
}

/// Makes a key, trades `token` for its certificate at `api` and writes the node's PKI
/// directory; with `fingerprint`, the CA answered must be that one. The node id.
pub fn fetch_certificate(
    api: &str,
    token: &str,
    dir: &Path,
    fingerprint: Option<&str>,
) -> Result<converge_types::NodeId> {
    let key = pki(NewKey::generate())?;
    let public_key_hex: String = key
        .public_key()
        .raw()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let body = serde_json::to_value(converge_api::JoinRequest {
        token: token.trim().to_string(),
        public_key_hex,
    })?;
    let joined: converge_api::Joined = crate::http::call(api, "POST", "/v1/join", Some(&body))?;
    // What came back must be the pinned CA and a certificate for this key and node.
    if let Some(fp) = fingerprint {
        if pki(converge_pki::fingerprint_pem(joined.ca_pem.as_bytes()))? != fp.to_ascii_lowercase()
        {
            bail!(
                "the cluster answered with another CA than the join token names; nothing written"
            );
        }
    }
    let tls = pki(converge_pki::NodeTls::from_pem(
        joined.ca_pem.as_bytes(),
        joined.cert_pem.as_bytes(),
        key.pem().as_bytes(),
    ))?;
    pki(tls.check_node(joined.node.0))?;
    pki(converge_pki::write_node_dir(
        dir,
        &joined.ca_pem,
        &joined.cert_pem,
        &key.pem(),
    ))?;
    if let Some(clients) = &joined.clients_ca_pem {
        pki(converge_pki::write_clients_ca(dir, clients))?;
    }
    Ok(joined.node)
}
