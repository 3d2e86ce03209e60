//! Builds the rustls configuration that `ServerConfig::tls` takes, from the PEM files an
//! operator has (certificate chain, private key, and a client CA for mutual TLS), with
//! the ring provider passed explicitly so nothing depends on a process-wide default.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio_rustls::rustls;

/// Why a TLS configuration could not be built; each names the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read the {what} file {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("the {what} is not valid PEM: {source}")]
    Pem {
        what: &'static str,
        source: pem::Error,
    },
    #[error("the {what} holds no {expected} PEM block")]
    Missing {
        what: &'static str,
        expected: &'static str,
    },
    #[error("a client CA certificate was refused: {0}")]
    ClientCa(rustls::Error),
    #[error("cannot verify client certificates with the client CA: {0}")]
    ClientVerifier(rustls::server::VerifierBuilderError),
    #[error("the TLS provider offers no safe protocol version: {0}")]
    Versions(rustls::Error),
    #[error("the server certificate chain and private key are not usable together: {0}")]
    CertKey(rustls::Error),
}

fn certificates(
    what: &'static str,
    pem_text: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_slice_iter(pem_text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsConfigError::Pem { what, source })?;
    if certs.is_empty() {
        return Err(TlsConfigError::Missing {
            what,
            expected: "CERTIFICATE",
        });
    }
    Ok(certs)
}

/// A rustls server configuration for NBD over TLS from PEM text: `cert_chain_pem` is the
/// server's certificate followed by any intermediates, `key_pem` its private key (PKCS#8,
/// PKCS#1 or SEC1). With `client_ca_pem`, clients must present a certificate signed by
/// one of those CAs (mutual TLS); without it any client that trusts the server may connect.
/// TLS 1.2 and 1.3 are offered (the NBD spec requires 1.2).
pub fn tls_server_config(
    cert_chain_pem: &[u8],
    key_pem: &[u8],
    client_ca_pem: Option<&[u8]>,
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let chain = certificates("server certificate chain", cert_chain_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| match source {
        pem::Error::NoItemsFound => TlsConfigError::Missing {
            what: "server private key",
            expected: "PRIVATE KEY",
        },
        source => TlsConfigError::Pem {
            what: "server private key",
            source,
        },
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Versions)?;
    let builder = match client_ca_pem {
        None => builder.with_no_client_auth(),
        Some(ca_pem) => {
            let mut roots = RootCertStore::empty();
            for ca in certificates("client CA", ca_pem)? {
                roots.add(ca).map_err(TlsConfigError::ClientCa)?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(TlsConfigError::ClientVerifier)?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(TlsConfigError::CertKey)?;
    Ok(Arc::new(config))
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsConfigError> {
    std::fs::read(path).map_err(|source| TlsConfigError::Read {
        what,
        path: path.to_owned(),
        source,
    })
}

/// [`tls_server_config`] from files: the server's certificate chain, its private key and,
/// for mutual TLS, the CA certificates that sign client certificates.
pub fn tls_server_config_from_files(
    cert_chain: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let chain = read("server certificate chain", cert_chain)?;
    let key = read("server private key", key)?;
    let ca = client_ca.map(|p| read("client CA", p)).transpose()?;
    tls_server_config(&chain, &key, ca.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_inputs_name_what_is_wrong() {
        let e = tls_server_config(b"", b"", None).unwrap_err();
        assert!(
            e.to_string()
                .contains("server certificate chain holds no CERTIFICATE"),
            "{e}"
        );
        let junk = b"-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n";
        let e = tls_server_config(junk, b"", None).unwrap_err();
        assert!(matches!(e, TlsConfigError::Pem { .. }), "{e}");
        let e = tls_server_config_from_files(
            Path::new("/nonexistent/cert.pem"),
            Path::new("/nonexistent/key.pem"),
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
    }
}
