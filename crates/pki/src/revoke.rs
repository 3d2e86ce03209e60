//! Revocation: the certificates the cluster no longer accepts, and the TLS verifiers that
//! ask at every handshake, so that `converge node remove` and `converge cert revoke` end a
//! certificate's use everywhere at once instead of at its expiry (docs/adr/0013).
//!
//! What is refused: every certificate that names a removed node (node ids are never used
//! again, so no certificate for one is good), and every certificate whose serial was
//! revoked. The node keeps [`Revocations`] current from etcd; the verifiers built by
//! [`crate::NodeTls`] read it on each handshake, so a change applies to the next
//! connection without rebuilding any configuration. Sessions are never resumed (a resumed
//! session would skip the check).
//!
//! Connections opened before a revocation are ended by it: each server and client that
//! authenticated a peer by certificate keeps a [`Watchman`] for the connection
//! ([`Revocations::watch_connection`]), which shuts the socket down when the certificate
//! becomes refused. The connection then ends through its own error path (requests in
//! flight finish, their answers are lost), so nothing on the data path polls the list.

use crate::{node_name, PkiError};
use rcgen::{
    CertificateRevocationListParams, Issuer, KeyIdMethod, RevokedCertParams, SerialNumber,
    SigningKey,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use std::collections::BTreeSet;
use std::os::fd::OwnedFd;
use std::sync::{Arc, RwLock};

/// What a certificate says about itself that revocation and authorization need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// The serial number, lowercase hex without leading zero bytes (as etcd and openssl
    /// compare it).
    pub serial: String,
    /// The node it names (`node-<id>.converge`), if it names exactly one and no client.
    pub node: Option<u32>,
    /// The NBD client it names (`client-<name>.converge`), if exactly one and no node.
    pub client: Option<String>,
}

impl CertInfo {
    /// "node 4", "NBD client qemu-host4", or "a certificate" for anything else.
    pub fn describe(&self) -> String {
        match (&self.node, &self.client) {
            (Some(n), _) => format!("node {n}"),
            (_, Some(c)) => format!("NBD client {c}"),
            _ => "a certificate".to_string(),
        }
    }
}

/// Lowercase hex of a serial's big-endian bytes, leading zero bytes dropped.
pub(crate) fn serial_hex(raw: &[u8]) -> String {
    let start = raw.iter().position(|&b| b != 0).unwrap_or(raw.len());
    let hex: String = raw[start..].iter().map(|b| format!("{b:02x}")).collect();
    if hex.is_empty() {
        "00".to_string()
    } else {
        hex
    }
}

fn serial_bytes(hex: &str) -> Option<Vec<u8>> {
    let hex = if hex.len() % 2 == 1 {
        format!("0{hex}")
    } else {
        hex.to_string()
    };
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Is `serial` a serial number as [`CertInfo::serial`] spells it (1 to 40 hex digits)?
pub fn check_serial(serial: &str) -> Result<String, PkiError> {
    let s = serial.trim().trim_start_matches("0x").to_ascii_lowercase();
    let s = s.replace(':', "");
    match serial_bytes(&s) {
        Some(b) if !b.is_empty() && b.len() <= 20 => Ok(serial_hex(&b)),
        _ => Err(PkiError::Invalid(format!(
            "{serial:?} is not a certificate serial number (1 to 40 hex digits, as `openssl x509 \
             -noout -serial` prints it)"
        ))),
    }
}

/// Reads what revocation needs from a certificate (DER).
pub fn cert_info(der: &CertificateDer<'_>) -> Result<CertInfo, PkiError> {
    let ee = webpki::EndEntityCert::try_from(der)
        .map_err(|e| PkiError::Invalid(format!("not an X.509 certificate: {e}")))?;
    let mut nodes = BTreeSet::new();
    let mut clients = BTreeSet::new();
    for name in ee.valid_dns_names() {
        let Some(rest) = name.strip_suffix(crate::RESERVED_DOMAIN) else {
            continue;
        };
        if let Some(id) = rest
            .strip_prefix("node-")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|&id| node_name(id) == name)
        {
            nodes.insert(id);
        } else if let Some(c) = rest.strip_prefix("client-") {
            clients.insert(c.to_string());
        }
    }
    let node = (nodes.len() == 1 && clients.is_empty())
        .then(|| nodes.first().copied())
        .flatten();
    let client = (clients.len() == 1 && nodes.is_empty())
        .then(|| clients.first().cloned())
        .flatten();
    Ok(CertInfo {
        serial: serial_hex(ee.serial()),
        node,
        client,
    })
}

/// [`cert_info`] of the first certificate of a PEM file's text.
pub fn cert_info_pem(pem: &[u8]) -> Result<CertInfo, PkiError> {
    let der = CertificateDer::from_pem_slice(pem)
        .map_err(|e| PkiError::Invalid(format!("not a PEM certificate: {e}")))?;
    cert_info(&der)
}

/// What the cluster refuses: nodes removed (every certificate naming one) and serials.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Revoked {
    pub removed_nodes: BTreeSet<u32>,
    pub serials: BTreeSet<String>,
}

/// The revocation list a node checks at every handshake, shared by every TLS
/// configuration it built; kept current from etcd by the node.
#[derive(Debug)]
pub struct Revocations {
    state: RwLock<Revoked>,
    /// Bumped at every change of `state`: the connections' watchmen look again.
    changes: tokio::sync::watch::Sender<u64>,
}

impl Default for Revocations {
    fn default() -> Revocations {
        Revocations {
            state: RwLock::new(Revoked::default()),
            changes: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Revocations {
    pub fn new(state: Revoked) -> Arc<Revocations> {
        let r = Revocations::default();
        *r.state.write().unwrap_or_else(|p| p.into_inner()) = state;
        Arc::new(r)
    }

    /// Replaces the list (a fresh read from etcd).
    pub fn set(&self, state: Revoked) {
        {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            if *s == state {
                return;
            }
            *s = state;
        }
        self.changed();
    }

    /// Adds to the list (what this node just revoked, before the watch tells it).
    pub fn add(&self, removed_node: Option<u32>, serials: impl IntoIterator<Item = String>) {
        {
            let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
            s.removed_nodes.extend(removed_node);
            s.serials.extend(serials);
        }
        self.changed();
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    pub fn snapshot(&self) -> Revoked {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn node_removed(&self, node: u32) -> bool {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .removed_nodes
            .contains(&node)
    }

    /// Why the certificate `info` describes is refused, if it is.
    pub fn refusal(&self, info: &CertInfo) -> Option<String> {
        let s = self.state.read().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = info.node.filter(|n| s.removed_nodes.contains(n)) {
            return Some(format!("node {n} was removed from the cluster"));
        }
        s.serials.contains(&info.serial).then(|| {
            format!(
                "the certificate of {} (serial {}) is revoked",
                info.describe(),
                info.serial
            )
        })
    }

    /// Why `info`'s certificate is refused, once it is: at once if it is now, else at the
    /// change of the list that refuses it.
    pub async fn until_refused(&self, info: &CertInfo) -> String {
        // Subscribed before looking, so that no change between the two is missed.
        let mut changes = self.changes.subscribe();
        loop {
            if let Some(why) = self.refusal(info) {
                return why;
            }
            if changes.changed().await.is_err() {
                // The sender lives as long as `self`: never.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Watches an open connection whose peer authenticated with `cert`: when the list comes
    /// to refuse it, `cut` is called (see [`cut_socket`]) and the refusal is logged, naming
    /// the connection by `what` ("NBD client 10.0.0.7:51234"). Dropping the watchman stops
    /// the watch; keep it as long as the connection. `None` for a certificate that cannot be
    /// read (the handshake refused those). Needs a tokio runtime. Costs one idle task per
    /// connection, woken only when the list changes.
    pub fn watch_connection(
        self: &Arc<Self>,
        cert: &CertificateDer<'_>,
        what: String,
        cut: impl FnOnce() + Send + 'static,
    ) -> Option<Watchman> {
        let info = cert_info(cert).ok()?;
        let me = self.clone();
        let task = tokio::spawn(async move {
            let why = me.until_refused(&info).await;
            log::warn!("{what}: {why}; connection closed");
            cut();
        });
        Some(Watchman(task.abort_handle()))
    }
}

/// Ends the watch of one connection when dropped (see [`Revocations::watch_connection`]).
#[derive(Debug)]
pub struct Watchman(tokio::task::AbortHandle);

impl Drop for Watchman {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A `cut` for [`Revocations::watch_connection`] that shuts a TCP socket down both ways,
/// given a duplicate of its descriptor (`stream.as_fd().try_clone_to_owned()`): the
/// connection's own reads see the end of the stream and its writes fail, so it ends by
/// its usual path. The duplicate is closed after.
pub fn cut_socket(socket: OwnedFd) -> impl FnOnce() + Send + 'static {
    move || {
        let s = std::net::TcpStream::from(socket);
        if let Err(e) = s.shutdown(std::net::Shutdown::Both) {
            // Already closed by the peer: nothing is left to cut.
            log::debug!("shutting a revoked connection's socket down: {e}");
        }
    }
}

/// What kind of certificate a port wants from its callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    /// A node's, required (peer RPC).
    Node,
    /// A node's, if any (the API: people come with tokens and no certificate).
    NodeIfAny,
    /// An NBD client's, required (NBD over TCP).
    Client,
}

fn refused(why: String) -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
        PkiError::Invalid(why),
    ))))
}

/// The revocation check on a certificate already verified under the port's CA.
fn check(
    der: &CertificateDer<'_>,
    revocations: &Revocations,
    want: Option<Want>,
) -> Result<(), rustls::Error> {
    let info = cert_info(der)
        .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    match want {
        Some(Want::Node | Want::NodeIfAny) if info.node.is_none() => {
            return Err(refused(format!(
                "{} (serial {}) is not a node's certificate",
                info.describe(),
                info.serial
            )))
        }
        Some(Want::Client) if info.client.is_none() => {
            return Err(refused(format!(
                "{} (serial {}) is not an NBD client's certificate",
                info.describe(),
                info.serial
            )))
        }
        _ => {}
    }
    if info.node.is_some_and(|n| revocations.node_removed(n)) {
        // access_denied: the alert that tells a removed node it was removed (see
        // [`says_removed`]).
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ));
    }
    if revocations.refusal(&info).is_some() {
        return Err(rustls::Error::InvalidCertificate(CertificateError::Revoked));
    }
    Ok(())
}

/// Does a TLS error mean "the peer refuses this node's certificate because this node was
/// removed from the cluster"? A node's ports answer the certificate of a removed node with
/// the alert access_denied (a valid certificate, refused by access control), and any other
/// revoked certificate with certificate_revoked. A removed node that etcd no longer
/// answers learns its removal from this: etcd cuts its connections at the revocation,
/// possibly before its watch delivered the removal (`converged`'s `creds::watch`). Only
/// trust it from a peer whose own certificate was verified under the cluster's CA.
pub fn says_removed(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::AlertReceived(rustls::AlertDescription::AccessDenied)
    )
}

/// [`says_removed`] on an I/O error from a TLS stream (tokio-rustls wraps the TLS error).
pub fn io_says_removed(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(says_removed)
}

/// A client-certificate verifier under a CA that also wants the right kind of certificate
/// and refuses revoked ones.
#[derive(Debug)]
pub(crate) struct CheckedClients {
    inner: Arc<dyn ClientCertVerifier>,
    revocations: Arc<Revocations>,
    want: Want,
}

impl CheckedClients {
    pub(crate) fn new(
        inner: Arc<dyn ClientCertVerifier>,
        revocations: Arc<Revocations>,
        want: Want,
    ) -> CheckedClients {
        CheckedClients {
            inner,
            revocations,
            want,
        }
    }
}

impl ClientCertVerifier for CheckedClients {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        check(end_entity, &self.revocations, Some(self.want))?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A server-certificate verifier under the cluster CA that refuses revoked certificates:
/// a node does not talk to a removed node, or to one whose certificate was revoked.
#[derive(Debug)]
pub(crate) struct CheckedServer {
    inner: Arc<dyn ServerCertVerifier>,
    revocations: Arc<Revocations>,
}

impl CheckedServer {
    pub(crate) fn new(
        inner: Arc<dyn ServerCertVerifier>,
        revocations: Arc<Revocations>,
    ) -> CheckedServer {
        CheckedServer { inner, revocations }
    }
}

impl ServerCertVerifier for CheckedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ok = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        check(end_entity, &self.revocations, None)?;
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The serials (as [`CertInfo::serial`] spells them) a CRL file (PEM) lists: what etcd
/// refuses while it reads that file.
pub fn crl_serials(pem: &[u8]) -> Result<BTreeSet<String>, PkiError> {
    let der = rustls::pki_types::CertificateRevocationListDer::from_pem_slice(pem)
        .map_err(|e| PkiError::Invalid(format!("not a PEM revocation list: {e}")))?;
    let crl = webpki::BorrowedCertRevocationList::from_der(der.as_ref())
        .map_err(|e| PkiError::Invalid(format!("not a revocation list: {e}")))?;
    let mut out = BTreeSet::new();
    for r in &crl {
        let r = r.map_err(|e| PkiError::Invalid(format!("a revocation list entry: {e}")))?;
        out.insert(serial_hex(r.serial_number));
    }
    Ok(out)
}

/// A CRL (PEM) listing `serials`, signed by `issuer`.
pub(crate) fn crl_pem<'a>(
    issuer: &Issuer<'_, impl SigningKey>,
    serials: impl IntoIterator<Item = &'a String>,
) -> Result<String, PkiError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| PkiError::Invalid("the clock is before 1970".into()))?
        .as_secs() as i64;
    let at = |t: i64| {
        time::OffsetDateTime::from_unix_timestamp(t)
            .map_err(|e| PkiError::Invalid(format!("revocation list time: {e}")))
    };
    let mut revoked_certs = Vec::new();
    for s in serials {
        let raw = serial_bytes(s).ok_or_else(|| {
            PkiError::Invalid(format!("{s:?} is not a serial number (hex digits)"))
        })?;
        revoked_certs.push(RevokedCertParams {
            serial_number: SerialNumber::from_slice(&raw),
            revocation_time: at(now)?,
            reason_code: None,
            invalidity_date: None,
        });
    }
    let params = CertificateRevocationListParams {
        this_update: at(now - 3600)?,
        // etcd does not look at it; the nodes rewrite the file on every change anyway.
        next_update: at(now + 365 * 86_400)?,
        crl_number: SerialNumber::from_slice(&(now as u64).to_be_bytes()),
        issuing_distribution_point: None,
        revoked_certs,
        key_identifier_method: KeyIdMethod::Sha256,
    };
    params
        .signed_by(issuer)
        .and_then(|c| c.pem())
        .map_err(|e| PkiError::Invalid(format!("signing the revocation list: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Ca, CaKind, NewKey, Subject};

    fn der(ca: &Ca, subject: Subject) -> CertificateDer<'static> {
        let key = NewKey::generate().unwrap();
        let pem = ca.issue(&subject, &key.public_key()).unwrap();
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn certificates_say_which_node_or_client_they_are_for() {
        let ca = Ca::generate().unwrap();
        let clients = Ca::generate_kind(CaKind::Clients).unwrap();
        let n = cert_info(&der(
            &ca,
            Subject::Node {
                id: 12,
                hosts: vec!["10.0.0.12".into(), "host12.example".into()],
            },
        ))
        .unwrap();
        assert_eq!((n.node, n.client.as_deref()), (Some(12), None));
        assert_eq!(n.serial, check_serial(&n.serial).unwrap());
        let c = cert_info(&der(
            &clients,
            Subject::Client {
                name: "qemu-host4".into(),
            },
        ))
        .unwrap();
        assert_eq!((c.node, c.client.as_deref()), (None, Some("qemu-host4")));
        let e = cert_info(&der(
            &ca,
            Subject::Etcd {
                hosts: vec!["10.0.0.1".into()],
            },
        ))
        .unwrap();
        assert_eq!((e.node, e.client), (None, None));
        assert_ne!(n.serial, c.serial);
    }

    #[test]
    fn serials_are_spelled_one_way() {
        assert_eq!(serial_hex(&[0, 0, 0x1a, 0x02]), "1a02");
        assert_eq!(check_serial("1A:02").unwrap(), "1a02");
        assert_eq!(check_serial("0x001a02").unwrap(), "1a02");
        assert_eq!(check_serial("a02").unwrap(), "0a02");
        assert!(check_serial("xyz").is_err());
        assert!(check_serial(&"ab".repeat(21)).is_err());
    }

    #[test]
    fn removed_nodes_and_revoked_serials_are_refused_and_nothing_else() {
        let ca = Ca::generate().unwrap();
        let n4 = cert_info(&der(
            &ca,
            Subject::Node {
                id: 4,
                hosts: vec![],
            },
        ))
        .unwrap();
        let n5 = cert_info(&der(
            &ca,
            Subject::Node {
                id: 5,
                hosts: vec![],
            },
        ))
        .unwrap();
        let r = Revocations::default();
        assert_eq!(r.refusal(&n4), None);
        r.add(Some(4), []);
        assert!(r.refusal(&n4).unwrap().contains("node 4 was removed"));
        assert_eq!(r.refusal(&n5), None);
        r.add(None, [n5.serial.clone()]);
        assert!(r.refusal(&n5).unwrap().contains("revoked"));
        r.set(Revoked::default());
        assert_eq!(r.refusal(&n4), None);
    }

    /// Polls `f` once: `Some` if it is ready.
    fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> Option<F::Output> {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        match std::pin::Pin::new(f).poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }

    #[test]
    fn a_watch_ends_at_the_change_that_refuses_its_certificate_and_at_no_other() {
        let ca = Ca::generate().unwrap();
        let node = |id| cert_info(&der(&ca, Subject::Node { id, hosts: vec![] })).unwrap();
        let (n4, n5, n6) = (node(4), node(5), node(6));
        let r = Revocations::new(Revoked::default());
        let mut w4 = Box::pin(r.until_refused(&n4));
        let mut w5 = Box::pin(r.until_refused(&n5));
        assert_eq!(poll_once(&mut w4), None);
        assert_eq!(poll_once(&mut w5), None);
        // Another node's removal and another serial change nothing for these two.
        r.add(Some(6), [n6.serial.clone()]);
        assert_eq!(poll_once(&mut w4), None);
        assert_eq!(poll_once(&mut w5), None);
        // A fresh read from etcd equal to what is held is no change at all.
        r.set(r.snapshot());
        assert_eq!(poll_once(&mut w4), None);
        // Node 4 removed (any certificate naming it), node 5's serial revoked.
        r.set(Revoked {
            removed_nodes: [4, 6].into(),
            serials: [n6.serial.clone(), n5.serial.clone()].into(),
        });
        assert!(poll_once(&mut w4).unwrap().contains("node 4 was removed"));
        assert!(poll_once(&mut w5).unwrap().contains(&n5.serial));
        // Already refused: at once.
        assert!(poll_once(&mut Box::pin(r.until_refused(&n6))).is_some());
    }

    #[tokio::test]
    async fn a_watched_connection_is_shut_down_when_its_certificate_is_revoked() {
        use std::os::fd::AsFd;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ca = Ca::generate().unwrap();
        let cert = der(
            &ca,
            Subject::Node {
                id: 7,
                hosts: vec![],
            },
        );
        let serial = cert_info(&cert).unwrap().serial;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let r = Revocations::new(Revoked::default());
        let dup = server.as_fd().try_clone_to_owned().unwrap();
        let watchman = r.watch_connection(&cert, "test connection".into(), cut_socket(dup));
        assert!(watchman.is_some());
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).await.unwrap();
        r.add(None, [serial]);
        // The server's side is shut down: its reads end, and the client sees the close.
        // (The bound only keeps a broken build from hanging the suite.)
        let limit = std::time::Duration::from_secs(60);
        let n = tokio::time::timeout(limit, server.read(&mut buf)).await;
        assert_eq!(
            n.expect("the server's socket was not shut down").unwrap(),
            0
        );
        let n = tokio::time::timeout(limit, client.read(&mut buf)).await;
        assert_eq!(n.expect("the client saw no close").unwrap(), 0);
    }

    #[test]
    fn the_serials_of_a_revocation_list_read_back() {
        let ca = Ca::generate().unwrap();
        let serials: BTreeSet<String> = ["1f".to_string(), "abcdef0123".to_string()].into();
        let pem = ca.crl_pem(&serials).unwrap();
        assert_eq!(crl_serials(pem.as_bytes()).unwrap(), serials);
        let empty = ca.crl_pem(&BTreeSet::new()).unwrap();
        assert!(crl_serials(empty.as_bytes()).unwrap().is_empty());
        assert!(crl_serials(b"not a list").is_err());
    }

    #[test]
    fn a_revocation_list_lists_the_serials_it_was_given() {
        // Checked by rustls's own CRL support: well formed, signed by the CA, and the
        // certificates it lists are the ones refused.
        let ca = Ca::generate().unwrap();
        let revoked = der(
            &ca,
            Subject::Node {
                id: 4,
                hosts: vec![],
            },
        );
        let kept = der(
            &ca,
            Subject::Node {
                id: 5,
                hosts: vec![],
            },
        );
        let serials: BTreeSet<String> = [cert_info(&revoked).unwrap().serial, "7f".into()].into();
        let pem = ca.crl_pem(&serials).unwrap();
        assert!(pem.starts_with("-----BEGIN X509 CRL-----"), "{pem}");
        let crl = rustls::pki_types::CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
            .unwrap();
        let v = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            crate::provider(),
        )
        .with_crls([crl])
        .build()
        .unwrap();
        let e = v
            .verify_client_cert(&revoked, &[], UnixTime::now())
            .unwrap_err();
        assert_eq!(
            e,
            rustls::Error::InvalidCertificate(CertificateError::Revoked)
        );
        v.verify_client_cert(&kept, &[], UnixTime::now()).unwrap();
    }

    /// Runs a TLS handshake in memory; the first error either side saw.
    fn handshake(
        server: Arc<rustls::ServerConfig>,
        client: Arc<rustls::ClientConfig>,
        name: &str,
    ) -> Result<(), rustls::Error> {
        let mut c =
            rustls::ClientConnection::new(client, ServerName::try_from(name.to_string()).unwrap())
                .unwrap();
        let mut s = rustls::ServerConnection::new(server).unwrap();
        for _ in 0..16 {
            let mut buf = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                s.read_tls(&mut rd).unwrap();
            }
            let refused = s.process_new_packets().err();
            // What the server sends, its alert with a refusal too, reaches the client.
            let mut buf = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut buf).unwrap();
            }
            let mut rd = &buf[..];
            while !rd.is_empty() {
                c.read_tls(&mut rd).unwrap();
            }
            if let Some(e) = refused {
                // The first error is the server's; the client's is what it was told.
                return Err(c.process_new_packets().err().unwrap_or(e));
            }
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    fn node_tls(ca: &Ca, clients: Option<&Ca>, id: u32) -> crate::NodeTls {
        let key = NewKey::generate().unwrap();
        let cert = ca
            .issue(&Subject::Node { id, hosts: vec![] }, &key.public_key())
            .unwrap();
        let mut t = crate::NodeTls::from_pem(
            ca.cert_pem().as_bytes(),
            cert.as_bytes(),
            key.pem().as_bytes(),
        )
        .unwrap();
        if let Some(c) = clients {
            t.clients_ca = vec![CertificateDer::from_pem_slice(c.cert_pem().as_bytes()).unwrap()];
        }
        t
    }

    /// An NBD client's TLS settings: trusts the cluster CA, presents `issuer`'s certificate.
    fn nbd_client(ca: &Ca, issuer: &Ca, subject: Subject) -> Arc<rustls::ClientConfig> {
        let key = NewKey::generate().unwrap();
        let cert = issuer.issue(&subject, &key.public_key()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
            .unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(crate::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                rustls::pki_types::PrivateKeyDer::from_pem_slice(key.pem().as_bytes()).unwrap(),
            )
            .unwrap();
        Arc::new(cfg)
    }

    /// Each port takes only its kind of certificate, and a revocation applies to the next
    /// handshake of configurations built before it.
    #[test]
    fn each_port_takes_its_kind_of_certificate_and_refuses_revoked_ones() {
        let ca = Ca::generate().unwrap();
        let clients = Ca::generate_kind(CaKind::Clients).unwrap();
        let revocations = Revocations::new(Revoked::default());
        let n1 = node_tls(&ca, Some(&clients), 1).with_revocations(revocations.clone());
        let n2 = node_tls(&ca, Some(&clients), 2);
        let peer = n1.peer_server().unwrap();
        let api = n1.api_server().unwrap();
        let nbd = n1.nbd_server().unwrap();
        let qemu = || {
            nbd_client(
                &ca,
                &clients,
                Subject::Client {
                    name: "qemu".into(),
                },
            )
        };
        let name = node_name(1);
        // The right kinds.
        handshake(peer.clone(), n2.peer_client().unwrap(), &name).unwrap();
        handshake(api.clone(), n2.https_client().unwrap(), &name).unwrap();
        handshake(nbd.clone(), qemu(), &name).unwrap();
        // The API also takes callers without a certificate (they carry tokens).
        let anonymous = crate::client_config(ca.cert_pem().as_bytes()).unwrap();
        handshake(api.clone(), anonymous.clone(), &name).unwrap();
        // An NBD client's certificate reaches neither the peer port nor the API, and a
        // node's certificate does not open volumes. A client certificate of the cluster CA
        // (as made before the clients CA) still opens volumes, with or without a clients CA
        // (a cluster moves its clients over without a gap), but is no node.
        assert!(handshake(peer.clone(), qemu(), &name).is_err());
        assert!(handshake(api.clone(), qemu(), &name).is_err());
        assert!(handshake(nbd.clone(), n2.peer_client().unwrap(), &name).is_err());
        let legacy = || nbd_client(&ca, &ca, Subject::Client { name: "old".into() });
        handshake(nbd.clone(), legacy(), &name).unwrap();
        handshake(
            node_tls(&ca, None, 1).nbd_server().unwrap(),
            legacy(),
            &name,
        )
        .unwrap();
        assert!(handshake(peer.clone(), legacy(), &name).is_err());
        // Another CA's client certificate is nobody's.
        let stranger = Ca::generate_kind(CaKind::Clients).unwrap();
        let q = Subject::Client {
            name: "qemu".into(),
        };
        assert!(handshake(nbd.clone(), nbd_client(&ca, &stranger, q), &name).is_err());
        // Node 2 removed: refused on every port from the next handshake, both ways.
        // The removed node is told so (access_denied), and nothing else is.
        assert!(!says_removed(
            &handshake(peer.clone(), qemu(), &name).unwrap_err()
        ));
        revocations.add(Some(2), []);
        let told = handshake(peer.clone(), n2.peer_client().unwrap(), &name).unwrap_err();
        assert!(says_removed(&told), "{told:?}");
        let told = handshake(api.clone(), n2.https_client().unwrap(), &name).unwrap_err();
        assert!(says_removed(&told), "{told:?}");
        handshake(api.clone(), anonymous, &name).unwrap();
        let n2_server = node_tls(&ca, None, 2).peer_server().unwrap();
        assert!(handshake(n2_server, n1.peer_client().unwrap(), &node_name(2)).is_err());
        // A revoked client serial.
        let key = NewKey::generate().unwrap();
        let pem = clients
            .issue(
                &Subject::Client {
                    name: "lost".into(),
                },
                &key.public_key(),
            )
            .unwrap();
        let info = cert_info_pem(pem.as_bytes()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem().as_bytes()).unwrap())
            .unwrap();
        let lost = Arc::new(
            rustls::ClientConfig::builder_with_provider(crate::provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()],
                    rustls::pki_types::PrivateKeyDer::from_pem_slice(key.pem().as_bytes()).unwrap(),
                )
                .unwrap(),
        );
        handshake(nbd.clone(), lost.clone(), &name).unwrap();
        revocations.add(None, [info.serial]);
        let e = handshake(nbd.clone(), lost, &name).unwrap_err();
        assert_eq!(
            e,
            rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked)
        );
        assert!(!says_removed(&e));
        handshake(nbd, qemu(), &name).unwrap();
    }
}
