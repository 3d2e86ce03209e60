//! How the etcd client proves who it talks to and who it is: TLS trust and client
//! certificates for `https://` endpoints, and the user for etcd's own authentication.
//!
//! Kept apart from the request code so the rustls configuration is built (and its inputs
//! checked) once per client, and so a failed handshake is named for what it means to an
//! operator (wrong CA, missing client certificate, not TLS at all) rather than as a raw
//! rustls error.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{AlertDescription, CertificateError, ClientConfig, RootCertStore};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// TLS and authentication settings for talking to a secured etcd.
///
/// `https://` endpoints need `ca_pem`: converge ships no system roots, so the CA that signed
/// etcd's `--cert-file` must be given. With etcd's `--client-cert-auth`, also give the client
/// certificate and its key. `username`/`password` log in to etcd's own authentication
/// (`etcdctl auth enable`), over http or https.
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// PEM of the CA certificate(s) trusted to sign etcd's server certificate.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM of the client certificate chain presented to etcd (leaf first).
    pub client_cert_pem: Option<Vec<u8>>,
    /// PEM of the client certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub client_key_pem: Option<Vec<u8>>,
    /// etcd user to authenticate as.
    pub username: Option<String>,
    /// That user's password.
    pub password: Option<String>,
}

impl fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key or the password.
        f.debug_struct("EtcdSecurity")
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field(
                "client_cert_pem",
                &self.client_cert_pem.as_ref().map(|_| "<pem>"),
            )
            .field(
                "client_key_pem",
                &self.client_key_pem.as_ref().map(|_| "<redacted>"),
            )
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Which PEM input a [`SecurityError`] is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PemRole {
    Ca,
    ClientCert,
    ClientKey,
}

impl fmt::Display for PemRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PemRole::Ca => "CA certificate",
            PemRole::ClientCert => "client certificate",
            PemRole::ClientKey => "client key",
        })
    }
}

/// Why TLS or authentication settings for etcd cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("cannot read the etcd {role} file {}: {source}", path.display())]
    ReadFile {
        role: PemRole,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the etcd {role} from {origin} is not usable: {reason}; \
         expected PEM ({expected})"
    )]
    BadPem {
        role: PemRole,
        /// The file, or "the configured PEM" when given as bytes.
        origin: String,
        reason: String,
        expected: &'static str,
    },
    #[error(
        "etcd endpoint {endpoint} uses TLS but no CA certificate was given: converge does \
         not use the system's root CAs, so give the CA that signed etcd's --cert-file"
    )]
    NoCa { endpoint: String },
    #[error(
        "an etcd client {given} was given without its {missing}: give both the client \
         certificate and its key, or neither"
    )]
    IncompleteClientIdentity {
        given: &'static str,
        missing: &'static str,
    },
    #[error("the etcd client certificate and key cannot be used together: {reason}")]
    ClientIdentity { reason: String },
    #[error(
        "an etcd {given} was given without a {missing}: give both the username and the \
         password, or neither"
    )]
    IncompleteUser {
        given: &'static str,
        missing: &'static str,
    },
    #[error(
        "etcd endpoints mix http ({http}) and https ({https}); use https:// for all of them \
         or for none"
    )]
    MixedSchemes { http: String, https: String },
    #[error(
        "a CA or client certificate was given for etcd, but the endpoints ({endpoints}) are \
         plain http://; use https:// endpoints so the connection is encrypted, or drop the \
         TLS settings"
    )]
    TlsSettingsWithoutHttps { endpoints: String },
    #[error("cannot set up TLS for etcd: {reason}")]
    Config { reason: String },
}

fn read_pem(role: PemRole, path: &Path) -> Result<Vec<u8>, SecurityError> {
    let bytes = std::fs::read(path).map_err(|source| SecurityError::ReadFile {
        role,
        path: path.to_path_buf(),
        source,
    })?;
    // Checked here too, so a bad file is named by its path rather than found later.
    let origin = path.display().to_string();
    match role {
        PemRole::Ca | PemRole::ClientCert => {
            parse_certs(role, &bytes, &origin)?;
        }
        PemRole::ClientKey => {
            parse_key(&bytes, &origin)?;
        }
    }
    Ok(bytes)
}

impl EtcdSecurity {
    /// Reads the CA certificate and, if given, the client certificate and key from PEM files.
    /// Each error names the file and what it was meant to hold.
    pub fn from_pem_files(
        ca: &Path,
        client_cert: Option<&Path>,
        client_key: Option<&Path>,
    ) -> Result<EtcdSecurity, SecurityError> {
        check_pair(client_cert.is_some(), client_key.is_some())?;
        Ok(EtcdSecurity {
            ca_pem: Some(read_pem(PemRole::Ca, ca)?),
            client_cert_pem: client_cert
                .map(|p| read_pem(PemRole::ClientCert, p))
                .transpose()?,
            client_key_pem: client_key
                .map(|p| read_pem(PemRole::ClientKey, p))
                .transpose()?,
            username: None,
            password: None,
        })
    }

    /// The same settings, logging in to etcd as this user.
    pub fn with_user(self, username: impl Into<String>, password: impl Into<String>) -> Self {
        EtcdSecurity {
            username: Some(username.into()),
            password: Some(password.into()),
            ..self
        }
    }

    /// True if any TLS input (CA or client identity) is set.
    pub(crate) fn has_tls_settings(&self) -> bool {
        self.ca_pem.is_some() || self.client_cert_pem.is_some() || self.client_key_pem.is_some()
    }

    /// The user and password, if both are set; an error if only one is.
    pub(crate) fn user(&self) -> Result<Option<(String, String)>, SecurityError> {
        match (&self.username, &self.password) {
            (Some(u), Some(p)) => Ok(Some((u.clone(), p.clone()))),
            (None, None) => Ok(None),
            (Some(_), None) => Err(SecurityError::IncompleteUser {
                given: "username",
                missing: "password",
            }),
            (None, Some(_)) => Err(SecurityError::IncompleteUser {
                given: "password",
                missing: "username",
            }),
        }
    }

    /// The rustls configuration for `https://` endpoints; `endpoint` names one in errors.
    pub(crate) fn client_config(&self, endpoint: &str) -> Result<Arc<ClientConfig>, SecurityError> {
        const GIVEN: &str = "the configured PEM";
        let ca = self.ca_pem.as_ref().ok_or_else(|| SecurityError::NoCa {
            endpoint: endpoint.to_string(),
        })?;
        let mut roots = RootCertStore::empty();
        for cert in parse_certs(PemRole::Ca, ca, GIVEN)? {
            roots.add(cert).map_err(|e| SecurityError::BadPem {
                role: PemRole::Ca,
                origin: GIVEN.to_string(),
                reason: e.to_string(),
                expected: CERT_PEM,
            })?;
        }
        // Our own provider, so nothing depends on a process-wide default being installed.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| SecurityError::Config {
                reason: e.to_string(),
            })?
            .with_root_certificates(roots);
        check_pair(
            self.client_cert_pem.is_some(),
            self.client_key_pem.is_some(),
        )?;
        let mut config = match (&self.client_cert_pem, &self.client_key_pem) {
            (Some(cert), Some(key)) => {
                let chain = parse_certs(PemRole::ClientCert, cert, GIVEN)?;
                let key = parse_key(key, GIVEN)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    SecurityError::ClientIdentity {
                        reason: e.to_string(),
                    }
                })?
            }
            _ => builder.with_no_client_auth(),
        };
        // The client speaks HTTP/1.1 only; saying so keeps etcd from offering h2.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

const CERT_PEM: &str = "-----BEGIN CERTIFICATE-----";
const KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----, or an RSA or EC private key";

fn check_pair(cert: bool, key: bool) -> Result<(), SecurityError> {
    match (cert, key) {
        (true, false) => Err(SecurityError::IncompleteClientIdentity {
            given: "certificate",
            missing: "private key",
        }),
        (false, true) => Err(SecurityError::IncompleteClientIdentity {
            given: "private key",
            missing: "certificate",
        }),
        _ => Ok(()),
    }
}

fn parse_certs(
    role: PemRole,
    pem: &[u8],
    origin: &str,
) -> Result<Vec<CertificateDer<'static>>, SecurityError> {
    let bad = |reason: String| SecurityError::BadPem {
        role,
        origin: origin.to_string(),
        reason,
        expected: CERT_PEM,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("it holds no certificate".to_string()));
    }
    Ok(certs)
}

fn parse_key(pem: &[u8], origin: &str) -> Result<PrivateKeyDer<'static>, SecurityError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| SecurityError::BadPem {
        role: PemRole::ClientKey,
        origin: origin.to_string(),
        reason: match e {
            rustls::pki_types::pem::Error::NoItemsFound => "it holds no private key".to_string(),
            e => e.to_string(),
        },
        expected: KEY_PEM,
    })
}

/// A TLS failure with an etcd endpoint, by what the operator has to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsFailure {
    /// etcd's certificate does not chain to the configured CA.
    UntrustedCertificate { reason: String },
    /// etcd's certificate does not name the host of the endpoint.
    WrongHost { host: String, reason: String },
    /// etcd's certificate is expired or not yet valid.
    CertificateExpired { reason: String },
    /// etcd refused the handshake and no client certificate was configured.
    ClientCertificateRequired { reason: String },
    /// etcd refused the client certificate that was presented.
    ClientCertificateRejected { reason: String },
    /// The endpoint did not answer in TLS at all.
    NotTls { reason: String },
    /// Anything else rustls reported.
    Other { reason: String },
}

impl fmt::Display for TlsFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsFailure::UntrustedCertificate { reason } => write!(
                f,
                "presented a certificate not signed by the configured CA ({reason}); give the \
                 CA that signed etcd's --cert-file"
            ),
            TlsFailure::WrongHost { host, reason } => write!(
                f,
                "presented a certificate that is not valid for {host} ({reason}); connect by a \
                 name or IP address in the certificate's subject alternative names"
            ),
            TlsFailure::CertificateExpired { reason } => write!(
                f,
                "presented a certificate that is expired or not yet valid ({reason}); renew \
                 etcd's certificate or check the clocks"
            ),
            TlsFailure::ClientCertificateRequired { reason } => write!(
                f,
                "refused the TLS handshake ({reason}): etcd runs with client-cert-auth, which \
                 needs a client certificate; give one signed by etcd's --trusted-ca-file"
            ),
            TlsFailure::ClientCertificateRejected { reason } => write!(
                f,
                "refused our client certificate ({reason}); is it signed by the CA in etcd's \
                 --trusted-ca-file, still valid, and usable for client authentication?"
            ),
            TlsFailure::NotTls { reason } => write!(
                f,
                "did not answer in TLS ({reason}); if etcd serves plain http on this port, use \
                 an http:// endpoint"
            ),
            TlsFailure::Other { reason } => write!(f, "failed the TLS handshake: {reason}"),
        }
    }
}

/// The rustls error somewhere in `err`'s chain. rustls reports through `io::Error`, whose
/// `source()` skips the wrapped error, so each io::Error is looked into as well.
fn find_rustls_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(r) = inner.downcast_ref::<rustls::Error>() {
                return Some(r);
            }
        }
        cur = e.source();
    }
    None
}

/// Names a failure that came from TLS; None if `err` did not. `host` is the name checked
/// against etcd's certificate; `presented_client_cert` tells a missing client certificate
/// from a refused one.
pub(crate) fn classify_tls_failure(
    err: &(dyn std::error::Error + 'static),
    host: &str,
    presented_client_cert: bool,
) -> Option<TlsFailure> {
    let e = find_rustls_error(err)?;
    let reason = e.to_string();
    Some(match e {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                TlsFailure::UntrustedCertificate { reason }
            }
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                TlsFailure::WrongHost {
                    host: host.to_string(),
                    reason,
                }
            }
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => {
                TlsFailure::CertificateExpired { reason }
            }
            _ => TlsFailure::Other { reason },
        },
        // Go's TLS server (etcd) answers a missing or untrusted client certificate with
        // bad_certificate; TLS 1.3 peers may say certificate_required or unknown_ca. Under
        // TLS 1.3 this alert arrives after our side finished the handshake, so it surfaces
        // on the first read of the answer rather than from connect.
        rustls::Error::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::CertificateRequired
            | AlertDescription::UnknownCA
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateUnknown
            | AlertDescription::AccessDenied,
        ) => {
            if presented_client_cert {
                TlsFailure::ClientCertificateRejected { reason }
            } else {
                TlsFailure::ClientCertificateRequired { reason }
            }
        }
        rustls::Error::InvalidMessage(_) => TlsFailure::NotTls { reason },
        _ => TlsFailure::Other { reason },
    })
}

/// Names a failed TLS handshake; None if it failed below TLS (then it is a connection
/// problem). A peer that hangs up on our hello without a word is most likely not speaking
/// TLS: etcd serving plain http answers 400 and closes the connection on bytes it cannot
/// route. Closing with part of our hello still unread makes its kernel reset the
/// connection, and the reset can overtake the 400: so a reset during the handshake means
/// the same as an end of stream.
pub(crate) fn classify_handshake_failure(
    err: &std::io::Error,
    host: &str,
    presented_client_cert: bool,
) -> Option<TlsFailure> {
    use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
    classify_tls_failure(err, host, presented_client_cert).or_else(|| match err.kind() {
        UnexpectedEof => Some(TlsFailure::NotTls {
            reason: "it closed the connection during the TLS handshake".to_string(),
        }),
        ConnectionReset => Some(TlsFailure::NotTls {
            reason: "it reset the connection during the TLS handshake".to_string(),
        }),
        _ => None,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Was a flaky test under load: a plain-http etcd reset the connection before its 400
    /// arrived, and the failure read "unreachable" instead of "not TLS".
    #[test]
    fn a_hang_up_during_the_handshake_reads_as_not_tls() {
        use std::io::{Error, ErrorKind};
        for kind in [ErrorKind::UnexpectedEof, ErrorKind::ConnectionReset] {
            let f = classify_handshake_failure(&Error::from(kind), "h", false);
            assert!(
                matches!(f, Some(TlsFailure::NotTls { .. })),
                "{kind:?}: {f:?}"
            );
        }
        let refused = Error::from(ErrorKind::ConnectionRefused);
        assert!(classify_handshake_failure(&refused, "h", false).is_none());
    }

    #[test]
    fn incomplete_settings_are_refused() {
        let s = EtcdSecurity {
            ca_pem: None,
            ..Default::default()
        };
        let e = s.client_config("https://h:1").unwrap_err();
        assert!(matches!(e, SecurityError::NoCa { .. }), "{e}");
        assert!(e.to_string().contains("system's root CAs"), "{e}");

        let s = EtcdSecurity {
            username: Some("u".into()),
            ..Default::default()
        };
        assert!(s
            .user()
            .unwrap_err()
            .to_string()
            .contains("without a password"));
    }

    #[test]
    fn garbage_pem_is_refused_with_its_role() {
        let s = EtcdSecurity {
            ca_pem: Some(b"not a certificate".to_vec()),
            ..Default::default()
        };
        let e = s.client_config("https://h:1").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("the etcd CA certificate from the configured PEM"),
            "{e}"
        );
        assert!(e.to_string().contains("holds no certificate"), "{e}");
    }

    #[test]
    fn missing_file_is_named() {
        let e =
            EtcdSecurity::from_pem_files(Path::new("/nonexistent/ca.pem"), None, None).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("cannot read the etcd CA certificate file /nonexistent/ca.pem: "),
            "{msg}"
        );
        let e = EtcdSecurity::from_pem_files(
            Path::new("/nonexistent/ca.pem"),
            Some(Path::new("/c.pem")),
            None,
        )
        .unwrap_err();
        assert!(
            matches!(e, SecurityError::IncompleteClientIdentity { .. }),
            "{e}"
        );
    }

    #[test]
    fn debug_hides_secrets() {
        let s = EtcdSecurity {
            client_key_pem: Some(b"SECRETKEY".to_vec()),
            ..Default::default()
        }
        .with_user("u", "hunter2");
        let d = format!("{s:?}");
        assert!(!d.contains("hunter2") && !d.contains("SECRETKEY"), "{d}");
    }

    #[test]
    fn rustls_errors_are_found_inside_io_errors() {
        let io = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(AlertDescription::BadCertificate),
        );
        assert!(matches!(
            classify_tls_failure(&io, "h", false),
            Some(TlsFailure::ClientCertificateRequired { .. })
        ));
        assert!(matches!(
            classify_tls_failure(&io, "h", true),
            Some(TlsFailure::ClientCertificateRejected { .. })
        ));
        let plain = std::io::Error::other("connection reset");
        assert_eq!(classify_tls_failure(&plain, "h", false), None);
    }
}
