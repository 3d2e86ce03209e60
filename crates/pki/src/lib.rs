//! converge-pki: the cluster's certificate authority and the TLS settings of every port.
//!
//! One CA per cluster, made by `converge cluster init`. Every node holds a key of its own
//! and a certificate the CA signed for it, naming the node (`node-<id>.converge`) and the
//! host names and addresses clients reach it by. Clients that attach volumes over NBD/TCP
//! get client certificates (`client-<name>.converge`). Who checks what:
//!
//! * peer RPC: mutual TLS; each side checks that the other's certificate names the node id
//!   it claims (a client certificate, or node 2's certificate claiming to be node 1, is
//!   refused);
//! * HTTP API: the node proves itself with its certificate; callers prove themselves with
//!   tokens (converged's `auth`);
//! * NBD over TCP: mutual TLS; the client's certificate must be an NBD client's, signed by
//!   the cluster's *clients CA* (`clients-ca.crt`), which etcd and peers do not trust: an NBD
//!   client certificate opens volumes and nothing else (docs/adr/0013). Client certificates
//!   the cluster CA made before the clients CA existed are still taken here;
//! * every handshake that checks a certificate also checks the cluster's revocation list
//!   ([`Revocations`]): a removed node's certificates and revoked serials are refused.
//!
//! Keys are ECDSA P-256. A private key never leaves the host that generated it: a joining
//! node sends only its public key ([`PublicKey`]) and gets its certificate back.

pub mod keys;
mod revoke;

pub use revoke::{
    cert_info, cert_info_pem, check_serial, crl_serials, cut_socket, io_says_removed, says_removed,
    CertInfo, Revocations, Revoked, Watchman,
};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber, SignatureAlgorithm,
};
/// The rustls this crate builds its settings with.
pub use rustls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The CA certificate in a PKI directory.
pub const CA_CERT: &str = "ca.crt";
/// The CA's private key: only on the hosts that sign (where `cluster init` ran).
pub const CA_KEY: &str = "ca.key";
/// This node's certificate.
pub const NODE_CERT: &str = "node.crt";
/// This node's private key.
pub const NODE_KEY: &str = "node.key";
/// The certificate of the CA that signs NBD client certificates (and nothing else): nodes
/// trust it on the NBD/TCP port only.
pub const CLIENTS_CA_CERT: &str = "clients-ca.crt";
/// The clients CA's private key, beside `ca.key`.
pub const CLIENTS_CA_KEY: &str = "clients-ca.key";
/// Names under this domain are converge's own (`node-<id>.converge`,
/// `client-<name>.converge`): a certificate's host names may not use it, or a node's
/// certificate could name another node.
pub const RESERVED_DOMAIN: &str = ".converge";

/// How long a CA certificate is valid.
pub const CA_DAYS: i64 = 3650;
/// How long a node certificate is valid (renew with `converge cert node`, then restart).
pub const NODE_DAYS: i64 = 730;
/// How long a client certificate is valid.
pub const CLIENT_DAYS: i64 = 365;
/// Longest client name.
pub const CLIENT_NAME_MAX: usize = 48;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Bad { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn rcgen_err(what: &str) -> impl FnOnce(rcgen::Error) -> PkiError + '_ {
    move |e| PkiError::Invalid(format!("{what}: {e}"))
}

fn tls_err(what: &str) -> impl FnOnce(rustls::Error) -> PkiError + '_ {
    move |e| PkiError::Invalid(format!("{what}: {e}"))
}

/// The name a node's certificate carries, and the name peers check it against.
pub fn node_name(node: u32) -> String {
    format!("node-{node}.converge")
}

/// The name a client certificate carries.
pub fn client_name(name: &str) -> String {
    format!("client-{name}.converge")
}

/// A client name: 1 to 48 of `a-z 0-9 -`, not starting with `-`.
pub fn check_client_name(name: &str) -> Result<(), PkiError> {
    let ok = !name.is_empty()
        && name.len() <= CLIENT_NAME_MAX
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(PkiError::Invalid(format!(
            "client name {name:?}: use 1 to {CLIENT_NAME_MAX} of a-z, 0-9 and '-' (e.g. qemu-host4)"
        )))
    }
}

/// Lowercase hex SHA-256 of `bytes` (a certificate's DER: its fingerprint).
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The SHA-256 fingerprint of the first certificate in `pem`.
pub fn fingerprint_pem(pem: &[u8]) -> Result<String, PkiError> {
    let der = CertificateDer::from_pem_slice(pem)
        .map_err(|e| PkiError::Invalid(format!("not a PEM certificate: {e}")))?;
    Ok(sha256_hex(&der))
}

fn the_algorithm() -> &'static SignatureAlgorithm {
    &rcgen::PKCS_ECDSA_P256_SHA256
}

/// A public key sent by a host that wants a certificate: an uncompressed P-256 point.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey(Vec<u8>);

impl PublicKey {
    /// Length of an uncompressed P-256 point.
    pub const LEN: usize = 65;

    pub fn from_raw(raw: &[u8]) -> Result<PublicKey, PkiError> {
        if raw.len() != Self::LEN || raw[0] != 4 {
            return Err(PkiError::Invalid(format!(
                "a public key is an uncompressed P-256 point ({} bytes starting 0x04); got {} bytes",
                Self::LEN,
                raw.len()
            )));
        }
        Ok(PublicKey(raw.to_vec()))
    }

    pub fn raw(&self) -> &[u8] {
        &self.0
    }
}

impl PublicKeyData for PublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }
    fn algorithm(&self) -> &'static SignatureAlgorithm {
        the_algorithm()
    }
}

/// A freshly generated private key (ECDSA P-256).
pub struct NewKey(KeyPair);

impl NewKey {
    pub fn generate() -> Result<NewKey, PkiError> {
        KeyPair::generate_for(the_algorithm())
            .map(NewKey)
            .map_err(rcgen_err("generating a key"))
    }

    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.0.public_key_raw().to_vec())
    }

    /// The private key, PKCS#8 PEM.
    pub fn pem(&self) -> String {
        self.0.serialize_pem()
    }
}

/// Who a certificate is for.
#[derive(Clone, Debug)]
pub enum Subject {
    /// A node: its id and the host names / IP addresses clients use to reach it.
    Node { id: u32, hosts: Vec<String> },
    /// An NBD client (a hypervisor host, a backup tool).
    Client { name: String },
    /// An etcd member: its server certificate for the addresses it listens on. Usable as a
    /// client certificate too (etcd's gateway connects to itself with it), and without a
    /// common name (etcd takes a client certificate's CN as a user name when auth is on).
    Etcd { hosts: Vec<String> },
}

/// Which of the cluster's two certificate authorities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaKind {
    /// `ca.crt`/`ca.key`: signs nodes and etcd members; what peers, etcd and API clients
    /// trust.
    Cluster,
    /// `clients-ca.crt`/`clients-ca.key`: signs NBD client certificates; trusted by the
    /// NBD/TCP port only.
    Clients,
}

impl CaKind {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            CaKind::Cluster => (CA_CERT, CA_KEY),
            CaKind::Clients => (CLIENTS_CA_CERT, CLIENTS_CA_KEY),
        }
    }
}

/// One of the cluster's certificate authorities (its key included): the cluster CA signs
/// node and etcd certificates, the clients CA NBD client certificates.
pub struct Ca {
    key: KeyPair,
    cert_pem: String,
    kind: CaKind,
}

/// The CA's name and usages: the same on every load, so a CA read back from its files
/// signs exactly as the one that was created.
fn ca_params(kind: CaKind) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "converge");
    dn.push(
        DnType::CommonName,
        match kind {
            CaKind::Cluster => "converge cluster CA",
            CaKind::Clients => "converge NBD clients CA",
        },
    );
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn validity(p: &mut CertificateParams, days: i64) -> Result<(), PkiError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| PkiError::Invalid("the clock is before 1970".into()))?
        .as_secs() as i64;
    let at = |t: i64| {
        time::OffsetDateTime::from_unix_timestamp(t)
            .map_err(|e| PkiError::Invalid(format!("certificate validity: {e}")))
    };
    // An hour of slack for clocks that disagree a little.
    p.not_before = at(now - 3600)?;
    p.not_after = at(now + days * 86_400)?;
    let mut serial: [u8; 16] = rand::random();
    serial[0] &= 0x7f;
    p.serial_number = Some(SerialNumber::from_slice(&serial));
    Ok(())
}

impl Ca {
    /// A new cluster CA with a new key.
    pub fn generate() -> Result<Ca, PkiError> {
        Ca::generate_kind(CaKind::Cluster)
    }

    /// A new CA of `kind` with a new key.
    pub fn generate_kind(kind: CaKind) -> Result<Ca, PkiError> {
        let key =
            KeyPair::generate_for(the_algorithm()).map_err(rcgen_err("generating the CA key"))?;
        let mut params = ca_params(kind);
        validity(&mut params, CA_DAYS)?;
        let cert = params
            .self_signed(&key)
            .map_err(rcgen_err("signing the CA certificate"))?;
        Ok(Ca {
            key,
            cert_pem: cert.pem(),
            kind,
        })
    }

    /// The cluster CA of PKI directory `dir` (its `ca.crt` and `ca.key`).
    pub fn load(dir: &Path) -> Result<Ca, PkiError> {
        Ca::load_kind(dir, CaKind::Cluster)
    }

    /// The clients CA of directory `dir`, made there (beside the cluster CA) if it has none
    /// yet: clusters made before it existed get one on the first `converge cert client`.
    /// `made` says whether it was just made (then the nodes need its certificate).
    pub fn load_or_make_clients(dir: &Path) -> Result<(Ca, bool), PkiError> {
        if dir.join(CLIENTS_CA_KEY).exists() {
            return Ok((Ca::load_kind(dir, CaKind::Clients)?, false));
        }
        // Only where the cluster CA is: the same people hold both keys.
        Ca::load(dir)?;
        let ca = Ca::generate_kind(CaKind::Clients)?;
        ca.write(dir)?;
        Ok((ca, true))
    }

    /// The CA of `kind` in directory `dir`.
    pub fn load_kind(dir: &Path, kind: CaKind) -> Result<Ca, PkiError> {
        let (cert_file, key_file) = kind.files();
        let key_path = dir.join(key_file);
        let cert_path = dir.join(cert_file);
        let key_pem = std::fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
        let cert_pem = std::fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| PkiError::Bad {
            path: key_path.clone(),
            message: format!("not a private key: {e}"),
        })?;
        let der =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| PkiError::Bad {
                path: cert_path.clone(),
                message: format!("not a PEM certificate: {e}"),
            })?;
        // The key must be the certificate's: check by signing a throwaway certificate and
        // verifying it against the CA certificate.
        let ca = Ca {
            key,
            cert_pem,
            kind,
        };
        let probe = NewKey::generate()?;
        let issued = ca.issue(
            &Subject::Client {
                name: "probe".into(),
            },
            &probe.public_key(),
        )?;
        let roots = roots_of(&[der])?;
        let issued_der = CertificateDer::from_pem_slice(issued.as_bytes())
            .map_err(|e| PkiError::Invalid(format!("probe certificate: {e}")))?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
            .build()
            .map_err(|e| PkiError::Invalid(format!("{e}")))?;
        verifier
            .verify_client_cert(&issued_der, &[], rustls::pki_types::UnixTime::now())
            .map_err(|_| PkiError::Bad {
                path: key_path,
                message: format!("this key is not the key of {}", cert_path.display()),
            })?;
        Ok(ca)
    }

    /// Writes `ca.crt` (0644) and `ca.key` (0600) into `dir` (`clients-ca.*` for the
    /// clients CA); refuses to replace a CA key that is already there (every certificate of
    /// the cluster depends on it).
    pub fn write(&self, dir: &Path) -> Result<(), PkiError> {
        make_dir(dir)?;
        let (cert_file, key_file) = self.kind.files();
        let key_path = dir.join(key_file);
        if key_path.exists() {
            return Err(PkiError::Bad {
                path: key_path,
                message: "a CA key is already there; refusing to replace it (every \
                          certificate of the cluster depends on it)"
                    .into(),
            });
        }
        write_file(&key_path, self.key.serialize_pem().as_bytes(), 0o600)?;
        write_file(&dir.join(cert_file), self.cert_pem.as_bytes(), 0o644)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn kind(&self) -> CaKind {
        self.kind
    }

    /// A certificate revocation list (PEM) of `serials` (hex), signed by this CA: the file
    /// etcd's `--client-crl-file` reads (etcd refuses a connection whose certificate's
    /// serial it lists).
    pub fn crl_pem<'a>(
        &self,
        serials: impl IntoIterator<Item = &'a String>,
    ) -> Result<String, PkiError> {
        revoke::crl_pem(&Issuer::new(ca_params(self.kind), &self.key), serials)
    }

    /// SHA-256 of the CA certificate: what a joining host checks the CA it is given against.
    pub fn fingerprint(&self) -> String {
        fingerprint_pem(self.cert_pem.as_bytes()).unwrap_or_default()
    }

    /// A certificate (PEM) for `subject`'s `public_key`, signed by this CA.
    pub fn issue(&self, subject: &Subject, public_key: &PublicKey) -> Result<String, PkiError> {
        let mut p = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "converge");
        let (days, usages) = match subject {
            Subject::Node { id, hosts } => {
                if *id == 0 {
                    return Err(PkiError::Invalid("node ids start at 1".into()));
                }
                let name = node_name(*id);
                dn.push(DnType::CommonName, name.clone());
                p.subject_alt_names.push(san(&name)?);
                for h in hosts {
                    check_host(h)?;
                    let s = san(h)?;
                    if !p.subject_alt_names.contains(&s) {
                        p.subject_alt_names.push(s);
                    }
                }
                (
                    NODE_DAYS,
                    vec![
                        ExtendedKeyUsagePurpose::ServerAuth,
                        ExtendedKeyUsagePurpose::ClientAuth,
                    ],
                )
            }
            Subject::Etcd { hosts } => {
                if hosts.is_empty() {
                    return Err(PkiError::Invalid(
                        "an etcd certificate needs the addresses etcd listens on".into(),
                    ));
                }
                for h in hosts {
                    check_host(h)?;
                    let s = san(h)?;
                    if !p.subject_alt_names.contains(&s) {
                        p.subject_alt_names.push(s);
                    }
                }
                (
                    NODE_DAYS,
                    vec![
                        ExtendedKeyUsagePurpose::ServerAuth,
                        ExtendedKeyUsagePurpose::ClientAuth,
                    ],
                )
            }
            Subject::Client { name } => {
                check_client_name(name)?;
                let full = client_name(name);
                dn.push(DnType::CommonName, full.clone());
                p.subject_alt_names.push(san(&full)?);
                (CLIENT_DAYS, vec![ExtendedKeyUsagePurpose::ClientAuth])
            }
        };
        p.distinguished_name = dn;
        p.is_ca = IsCa::ExplicitNoCa;
        // Key encipherment means nothing for an ECDSA key, but qemu (gnutls) refuses a
        // certificate whose critical key usage lacks it.
        p.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = usages;
        p.use_authority_key_identifier_extension = true;
        validity(&mut p, days)?;
        let issuer = Issuer::new(ca_params(self.kind), &self.key);
        let cert = p
            .signed_by(public_key, &issuer)
            .map_err(rcgen_err("signing the certificate"))?;
        Ok(cert.pem())
    }
}

/// Is `host` an IP address or DNS name a node's or etcd member's certificate can carry?
/// Names under `.converge` are refused: they are converge's own (`node-7.converge` among a
/// node's host names would let node 3's certificate pass for node 7's).
pub fn check_host(host: &str) -> Result<(), PkiError> {
    san(host)?;
    let lower = host.to_ascii_lowercase();
    let lower = lower.trim_end_matches('.');
    if lower.ends_with(RESERVED_DOMAIN) || lower == &RESERVED_DOMAIN[1..] {
        return Err(PkiError::Invalid(format!(
            "{host:?}: names under {RESERVED_DOMAIN} are converge's own (they name nodes and \
             clients); give the host's real name or address"
        )));
    }
    Ok(())
}

fn san(host: &str) -> Result<SanType, PkiError> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !ok {
        return Err(PkiError::Invalid(format!(
            "{host:?} is neither an IP address nor a DNS name"
        )));
    }
    Ok(SanType::DnsName(
        host.to_ascii_lowercase()
            .try_into()
            .map_err(|e: rcgen::Error| PkiError::Invalid(format!("{host:?}: {e}")))?,
    ))
}

/// Creates `dir` (0700) if it is missing.
pub fn make_dir(dir: &Path) -> Result<(), PkiError> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(dir))?;
    }
    Ok(())
}

/// Writes a whole file with `mode`, through a temporary file and a rename, so a reader
/// never sees half of it and a private key is never readable by others, even briefly.
pub fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), PkiError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io_err(&tmp))?;
    f.write_all(data).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Writes a node's PKI directory: the CA certificate, its certificate and its key.
pub fn write_node_dir(
    dir: &Path,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<(), PkiError> {
    make_dir(dir)?;
    write_file(&dir.join(NODE_KEY), key_pem.as_bytes(), 0o600)?;
    write_file(&dir.join(NODE_CERT), cert_pem.as_bytes(), 0o644)?;
    write_file(&dir.join(CA_CERT), ca_pem.as_bytes(), 0o644)
}

/// Writes the clients CA's certificate into a node's PKI directory: the node's NBD/TCP
/// port trusts it (and only that port).
pub fn write_clients_ca(dir: &Path, clients_ca_pem: &str) -> Result<(), PkiError> {
    make_dir(dir)?;
    write_file(&dir.join(CLIENTS_CA_CERT), clients_ca_pem.as_bytes(), 0o644)
}

/// Writes a client's certificate directory in the layout qemu (`tls-creds-x509`) and
/// libnbd (`tls-certificates=`) read: `ca-cert.pem`, `client-cert.pem`, `client-key.pem`.
/// `ca_pem` holds the cluster CA (the client checks nodes against it) and, for a
/// certificate of the clients CA, that CA too (qemu checks its own certificate against
/// `ca-cert.pem` before it uses it).
pub fn write_client_dir(
    dir: &Path,
    ca_pem: &str,
    cert_pem: &str,
    key_pem: &str,
) -> Result<(), PkiError> {
    make_dir(dir)?;
    write_file(&dir.join("client-key.pem"), key_pem.as_bytes(), 0o600)?;
    write_file(&dir.join("client-cert.pem"), cert_pem.as_bytes(), 0o644)?;
    write_file(&dir.join("ca-cert.pem"), ca_pem.as_bytes(), 0o644)
}

/// The crypto converge uses everywhere (ring), so nothing depends on a process default.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots_of(certs: &[CertificateDer<'static>]) -> Result<Arc<RootCertStore>, PkiError> {
    let mut roots = RootCertStore::empty();
    for c in certs {
        roots
            .add(c.clone())
            .map_err(tls_err("the CA certificate"))?;
    }
    Ok(Arc::new(roots))
}

/// A client configuration that trusts only the CA in `ca_pem` (the CLI, tools, peers'
/// HTTP calls), presenting no certificate.
pub fn client_config(ca_pem: &[u8]) -> Result<Arc<ClientConfig>, PkiError> {
    let ca = CertificateDer::pem_slice_iter(ca_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PkiError::Invalid(format!("CA certificate: {e}")))?;
    if ca.is_empty() {
        return Err(PkiError::Invalid("no certificate in the CA file".into()));
    }
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_err("TLS versions"))?
        .with_root_certificates(roots_of(&ca)?)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// A node's certificate, key and CA, read from its PKI directory: the TLS settings of its
/// ports come from here. Every configuration it builds checks certificates against the
/// revocation list it was given ([`NodeTls::with_revocations`]) at each handshake.
pub struct NodeTls {
    ca: Vec<CertificateDer<'static>>,
    /// The clients CA (NBD/TCP); empty in a PKI directory of before it existed, where NBD
    /// clients are checked against the cluster CA as they were then.
    clients_ca: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    revocations: Arc<Revocations>,
}

impl Clone for NodeTls {
    fn clone(&self) -> Self {
        NodeTls {
            ca: self.ca.clone(),
            clients_ca: self.clients_ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            revocations: self.revocations.clone(),
        }
    }
}

impl NodeTls {
    /// Reads `ca.crt`, `node.crt` and `node.key` from `dir`, and checks that the certificate
    /// is the CA's and names node `node`.
    pub fn load(dir: &Path, node: u32) -> Result<NodeTls, PkiError> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    PkiError::Bad {
                        path: p.clone(),
                        message: format!(
                            "missing: this node has no certificate yet; make one with \
                             `converge cert node --node {node} --host ADDRESS --ca-dir CA_DIR \
                             --out {}` or join with `converge node join`",
                            dir.display()
                        ),
                    }
                } else {
                    io_err(&p)(e)
                }
            })
        };
        let ca_pem = read(CA_CERT)?;
        let cert_pem = read(NODE_CERT)?;
        let key_pem = read(NODE_KEY)?;
        let key_path = dir.join(NODE_KEY);
        if let Ok(md) = std::fs::metadata(&key_path) {
            if md.permissions().mode() & 0o077 != 0 {
                return Err(PkiError::Bad {
                    path: key_path,
                    message: format!(
                        "mode {:o}: a private key must be readable by its owner only \
                         (chmod 600)",
                        md.permissions().mode() & 0o777
                    ),
                });
            }
        }
        let mut tls =
            NodeTls::from_pem(&ca_pem, &cert_pem, &key_pem).map_err(|e| PkiError::Bad {
                path: dir.to_path_buf(),
                message: e.to_string(),
            })?;
        tls.check_node(node).map_err(|e| PkiError::Bad {
            path: dir.join(NODE_CERT),
            message: e.to_string(),
        })?;
        let clients_path = dir.join(CLIENTS_CA_CERT);
        match std::fs::read(&clients_path) {
            Ok(pem) => {
                tls.clients_ca = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| PkiError::Bad {
                        path: clients_path.clone(),
                        message: format!("not a PEM certificate: {e}"),
                    })?;
                if tls.clients_ca.is_empty() {
                    return Err(PkiError::Bad {
                        path: clients_path,
                        message: "holds no certificate".into(),
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&clients_path)(e)),
        }
        Ok(tls)
    }

    /// The same identity, checking every certificate it is shown against `revocations`
    /// (which the node keeps current from etcd).
    pub fn with_revocations(mut self, revocations: Arc<Revocations>) -> NodeTls {
        self.revocations = revocations;
        self
    }

    /// The revocation list the configurations check.
    pub fn revocations(&self) -> &Arc<Revocations> {
        &self.revocations
    }

    /// Whether NBD clients are checked against a clients CA (false: against the cluster
    /// CA, as before the clients CA existed; see docs/SECURITY.md, "Migrating").
    pub fn has_clients_ca(&self) -> bool {
        !self.clients_ca.is_empty()
    }

    /// What this node's own certificate is (serial, node id).
    pub fn own_cert(&self) -> Result<CertInfo, PkiError> {
        cert_info(&self.chain[0])
    }

    /// A certificate revocation list (PEM) of `serials`, signed with this node's key: the
    /// file etcd's `--client-crl-file` reads on the etcd members' hosts. etcd checks only
    /// the serials in it, not who signed it (etcd 3.4's `checkCRL`), and only the cluster
    /// CA's holder could sign as the CA.
    pub fn crl_pem<'a>(
        &self,
        serials: impl IntoIterator<Item = &'a String>,
    ) -> Result<String, PkiError> {
        let key = KeyPair::try_from(&self.key).map_err(rcgen_err("this node's key"))?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "converge");
        let who = self
            .own_cert()
            .ok()
            .and_then(|c| c.node)
            .map_or("a converge node".to_string(), node_name);
        dn.push(DnType::CommonName, format!("revocation list kept by {who}"));
        params.distinguished_name = dn;
        revoke::crl_pem(&Issuer::new(params, &key), serials)
    }

    pub fn from_pem(ca_pem: &[u8], cert_pem: &[u8], key_pem: &[u8]) -> Result<NodeTls, PkiError> {
        let ca = CertificateDer::pem_slice_iter(ca_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PkiError::Invalid(format!("CA certificate: {e}")))?;
        let chain = CertificateDer::pem_slice_iter(cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PkiError::Invalid(format!("node certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem)
            .map_err(|e| PkiError::Invalid(format!("node key: {e}")))?;
        if ca.is_empty() || chain.is_empty() {
            return Err(PkiError::Invalid(
                "a certificate file holds no certificate".into(),
            ));
        }
        let tls = NodeTls {
            ca,
            clients_ca: Vec::new(),
            chain,
            key,
            revocations: Arc::new(Revocations::default()),
        };
        // Building a server config checks that the key matches the certificate.
        tls.api_server()?;
        Ok(tls)
    }

    /// The CA certificates, PEM.
    pub fn ca_der(&self) -> &[CertificateDer<'static>] {
        &self.ca
    }

    /// Is this certificate signed by the CA, usable by a server and a client, and does it
    /// name node `node`?
    pub fn check_node(&self, node: u32) -> Result<(), PkiError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(roots_of(&self.ca)?, provider())
            .build()
            .map_err(|e| PkiError::Invalid(e.to_string()))?;
        verifier
            .verify_client_cert(
                &self.chain[0],
                &self.chain[1..],
                rustls::pki_types::UnixTime::now(),
            )
            .map_err(|e| {
                PkiError::Invalid(format!(
                    "the node certificate is not valid under this cluster's CA: {e}"
                ))
            })?;
        if !cert_names_node(&self.chain[0], node) {
            return Err(PkiError::Invalid(format!(
                "the certificate is not node {node}'s (it does not name {})",
                node_name(node)
            )));
        }
        Ok(())
    }

    /// A server configuration whose callers are checked by `clients` (None: callers
    /// present nothing). Sessions are never resumed: a resumed session skips the
    /// certificate check, and with it the revocation list.
    fn server(
        &self,
        clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    ) -> Result<Arc<ServerConfig>, PkiError> {
        let b = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls_err("TLS versions"))?;
        let b = match clients {
            Some(v) => b.with_client_cert_verifier(v),
            None => b.with_no_client_auth(),
        };
        // The CA goes along with the node's certificate: a joining host pins it by its
        // fingerprint (`pinned_client_config`); everyone else has it already.
        let mut chain = self.chain.clone();
        chain.extend(self.ca.iter().cloned());
        let mut cfg = b
            .with_single_cert(chain, self.key.clone_key())
            .map_err(tls_err("the node certificate and key"))?;
        cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        cfg.send_tls13_tickets = 0;
        Ok(Arc::new(cfg))
    }

    fn client_verifier(
        &self,
        roots: &[CertificateDer<'static>],
        want: revoke::Want,
    ) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, PkiError> {
        let b = WebPkiClientVerifier::builder_with_provider(roots_of(roots)?, provider());
        let b = if want == revoke::Want::NodeIfAny {
            b.allow_unauthenticated()
        } else {
            b
        };
        let inner = b
            .build()
            .map_err(|e| PkiError::Invalid(format!("client verifier: {e}")))?;
        Ok(Arc::new(revoke::CheckedClients::new(
            inner,
            self.revocations.clone(),
            want,
        )))
    }

    /// Peer RPC, answering side: the caller must present a node certificate of the cluster
    /// CA that is not revoked (whether it names the node it claims is checked with
    /// [`cert_names_node`] after the hello).
    pub fn peer_server(&self) -> Result<Arc<ServerConfig>, PkiError> {
        self.server(Some(self.client_verifier(&self.ca, revoke::Want::Node)?))
    }

    /// NBD over TCP: the client must present an NBD client certificate that is not
    /// revoked, of the clients CA or of the cluster CA (as made before the clients CA
    /// existed: they keep working here while a cluster moves its clients over; what they
    /// must lose, etcd, is theirs until revoked).
    pub fn nbd_server(&self) -> Result<Arc<ServerConfig>, PkiError> {
        let roots: Vec<CertificateDer<'static>> =
            self.clients_ca.iter().chain(&self.ca).cloned().collect();
        self.server(Some(self.client_verifier(&roots, revoke::Want::Client)?))
    }

    /// HTTP API: the node proves itself; callers carry tokens, or (the other nodes) present
    /// their node certificate, which must then be the cluster CA's, name a node and not be
    /// revoked. Which node it names is [`peer_node`] of the connection's certificate.
    pub fn api_server(&self) -> Result<Arc<ServerConfig>, PkiError> {
        self.server(Some(
            self.client_verifier(&self.ca, revoke::Want::NodeIfAny)?,
        ))
    }

    fn server_verifier(
        &self,
    ) -> Result<Arc<dyn rustls::client::danger::ServerCertVerifier>, PkiError> {
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots_of(&self.ca)?,
            provider(),
        )
        .build()
        .map_err(|e| PkiError::Invalid(format!("server verifier: {e}")))?;
        Ok(Arc::new(revoke::CheckedServer::new(
            inner,
            self.revocations.clone(),
        )))
    }

    fn node_client(&self) -> Result<Arc<ClientConfig>, PkiError> {
        let mut cfg = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls_err("TLS versions"))?
            .dangerous()
            .with_custom_certificate_verifier(self.server_verifier()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err("the node certificate and key"))?;
        cfg.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(cfg))
    }

    /// Peer RPC, calling side: trusts this CA, refuses a revoked server certificate, and
    /// presents the node's certificate. The server name to check is [`node_name`] of the
    /// node called.
    pub fn peer_client(&self) -> Result<Arc<ClientConfig>, PkiError> {
        self.node_client()
    }

    /// HTTPS to another node's API: trusts this CA, refuses a revoked server certificate,
    /// and presents the node's certificate (the other node takes it for this node's
    /// identity: node-to-node calls need no shared secret).
    pub fn https_client(&self) -> Result<Arc<ClientConfig>, PkiError> {
        self.node_client()
    }
}

/// The node a connection's (verified) client certificate names, if any: the identity a
/// node calls another node's API with.
pub fn peer_node(certs: Option<&[CertificateDer<'_>]>) -> Option<u32> {
    cert_info(certs?.first()?).ok()?.node
}

/// A client configuration for a host that has no CA certificate yet but knows the CA's
/// fingerprint (from a join token): the server must send a CA certificate with that
/// SHA-256 along with its own certificate, which must be valid under it for the name
/// called. Nothing else is trusted.
pub fn pinned_client_config(ca_fingerprint: &str) -> Result<Arc<ClientConfig>, PkiError> {
    let fp = ca_fingerprint.trim().to_ascii_lowercase();
    if fp.len() != 64 || !fp.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(PkiError::Invalid(format!(
            "{ca_fingerprint:?} is not a SHA-256 fingerprint (64 hex digits)"
        )));
    }
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_err("TLS versions"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCa {
            fingerprint: fp,
            provider: provider(),
        }))
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

#[derive(Debug)]
struct PinnedCa {
    fingerprint: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| sha256_hex(c) == self.fingerprint)
            .ok_or_else(|| {
                rustls::Error::General(
                    "the server did not present the CA the join token names: another cluster, \
                     or someone in between"
                        .into(),
                )
            })?;
        let roots = roots_of(&[ca.clone().into_owned()])
            .map_err(|e| rustls::Error::General(format!("the pinned CA certificate: {e}")))?;
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots,
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
        verifier.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Does the (already verified) certificate name node `node`?
pub fn cert_names_node(cert: &CertificateDer<'_>, node: u32) -> bool {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    let Ok(name) = ServerName::try_from(node_name(node)) else {
        return false;
    };
    ee.verify_is_valid_for_subject_name(&name).is_ok()
}

/// The server name to check when calling node `node`.
pub fn node_server_name(node: u32) -> ServerName<'static> {
    ServerName::try_from(node_name(node)).unwrap_or_else(|_| {
        // node_name is always a valid DNS name; this branch is unreachable in practice.
        ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node_dir(ca: &Ca, dir: &Path, id: u32) {
        let key = NewKey::generate().unwrap();
        let cert = ca
            .issue(
                &Subject::Node {
                    id,
                    hosts: vec!["127.0.0.1".into(), "host1.example".into()],
                },
                &key.public_key(),
            )
            .unwrap();
        write_node_dir(dir, ca.cert_pem(), &cert, &key.pem()).unwrap();
    }

    #[test]
    fn a_ca_issues_node_certificates_that_name_the_node_and_load_back() {
        let d = tempfile::tempdir().unwrap();
        let ca = Ca::generate().unwrap();
        ca.write(&d.path().join("ca")).unwrap();
        let ca2 = Ca::load(&d.path().join("ca")).unwrap();
        assert_eq!(ca.fingerprint(), ca2.fingerprint());
        // A CA read back signs certificates that verify under the original certificate.
        node_dir(&ca2, &d.path().join("n3"), 3);
        let tls = NodeTls::load(&d.path().join("n3"), 3).unwrap();
        assert!(cert_names_node(&tls.chain[0], 3));
        assert!(!cert_names_node(&tls.chain[0], 4));
        let wrong = NodeTls::load(&d.path().join("n3"), 4)
            .err()
            .unwrap()
            .to_string();
        assert!(wrong.contains("not node 4's"), "{wrong}");
        for cfg in [tls.peer_server(), tls.nbd_server(), tls.api_server()] {
            cfg.unwrap();
        }
        tls.peer_client().unwrap();
        let mode = std::fs::metadata(d.path().join("n3").join(NODE_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let mode = std::fs::metadata(d.path().join("ca").join(CA_KEY))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn a_ca_key_is_never_replaced_and_a_foreign_key_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let ca = Ca::generate().unwrap();
        ca.write(d.path()).unwrap();
        let e = Ca::generate()
            .unwrap()
            .write(d.path())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("refusing to replace"), "{e}");
        // Another CA's key beside this certificate.
        let other = Ca::generate().unwrap();
        std::fs::write(d.path().join(CA_KEY), other.key.serialize_pem()).unwrap();
        let e = Ca::load(d.path()).err().unwrap().to_string();
        assert!(e.contains("is not the key of"), "{e}");
    }

    #[test]
    fn a_certificate_of_another_ca_or_a_client_certificate_is_not_a_node() {
        let d = tempfile::tempdir().unwrap();
        let ca = Ca::generate().unwrap();
        let other = Ca::generate().unwrap();
        node_dir(&other, d.path(), 1);
        // Put this cluster's CA beside the other CA's node certificate.
        std::fs::write(d.path().join(CA_CERT), ca.cert_pem()).unwrap();
        let e = NodeTls::load(d.path(), 1).err().unwrap().to_string();
        assert!(e.contains("not valid under this cluster's CA"), "{e}");
        let key = NewKey::generate().unwrap();
        let client = ca
            .issue(
                &Subject::Client {
                    name: "qemu-1".into(),
                },
                &key.public_key(),
            )
            .unwrap();
        let der = CertificateDer::from_pem_slice(client.as_bytes()).unwrap();
        assert!(!cert_names_node(&der, 1));
    }

    #[test]
    fn bad_names_and_keys_are_refused() {
        assert!(check_client_name("qemu-host4").is_ok());
        for bad in ["", "-x", "Upper", "a b", &"x".repeat(49)] {
            assert!(check_client_name(bad).is_err(), "{bad:?}");
        }
        assert!(PublicKey::from_raw(&[4; 64]).is_err());
        assert!(PublicKey::from_raw(&[3; 65]).is_err());
        let ca = Ca::generate().unwrap();
        let key = NewKey::generate().unwrap();
        let e = ca
            .issue(
                &Subject::Node {
                    id: 1,
                    hosts: vec!["bad host".into()],
                },
                &key.public_key(),
            )
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("neither an IP address nor a DNS name"), "{e}");
        // A node's certificate may not carry another node's (or any converge) name.
        for reserved in [
            "node-7.converge",
            "NODE-7.CONVERGE.",
            "converge",
            "x.converge",
        ] {
            let e = ca
                .issue(
                    &Subject::Node {
                        id: 3,
                        hosts: vec![reserved.into()],
                    },
                    &key.public_key(),
                )
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("converge's own"), "{reserved}: {e}");
        }
        assert!(check_host("converge.example").is_ok());
    }
}
