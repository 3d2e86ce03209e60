//! A throwaway PKI for the TLS tests: a CA, a server certificate for 127.0.0.1/localhost
//! and a client certificate, as PEM for the server and for real clients' certificate
//! directories, and as rustls client configurations for the handwritten client.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use converge_nbd::rustls;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

/// The name the handwritten client verifies; the server certificate also carries the IP
/// SAN 127.0.0.1 that libnbd and qemu check when connecting to that address.
pub const SERVER_NAME: &str = "localhost";

pub struct Pki {
    pub ca_pem: String,
    pub server_cert_pem: String,
    pub server_key_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

fn params(common_name: &str, sans: Vec<String>) -> CertificateParams {
    let mut p = CertificateParams::new(sans).expect("valid subject alternative names");
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    p.distinguished_name = dn;
    // Plain dates far from now: GnuTLS and webpki both check validity periods.
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2099, 1, 1);
    p
}

impl Pki {
    /// A fresh CA (named after `label`) with one server and one client certificate.
    pub fn new(label: &str) -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = params(&format!("converge {label} test CA"), Vec::new());
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca.self_signed(&ca_key).expect("self-sign CA");
        let issuer = Issuer::new(ca, &ca_key);

        // qemu refuses its own client certificate unless the key usages below are present
        // and the purpose fits the endpoint; webpki checks the purposes too.
        let leaf = |cn: &str, sans: Vec<String>, purpose| {
            let key = KeyPair::generate().expect("leaf key");
            let mut p = params(cn, sans);
            p.is_ca = IsCa::ExplicitNoCa;
            p.key_usages = vec![
                KeyUsagePurpose::DigitalSignature,
                KeyUsagePurpose::KeyEncipherment,
            ];
            p.extended_key_usages = vec![purpose];
            let cert = p.signed_by(&key, &issuer).expect("sign leaf");
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert_pem, server_key_pem) = leaf(
            SERVER_NAME,
            vec!["127.0.0.1".to_owned(), SERVER_NAME.to_owned()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert_pem, client_key_pem) = leaf(
            &format!("converge {label} test client"),
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        Self {
            ca_pem: ca_cert.pem(),
            server_cert_pem,
            server_key_pem,
            client_cert_pem,
            client_key_pem,
        }
    }

    /// The server side, through the crate's own PEM loader; `mutual`: clients need a
    /// certificate from this CA.
    pub fn server_config(&self, mutual: bool) -> Arc<rustls::ServerConfig> {
        converge_nbd::tls_server_config(
            self.server_cert_pem.as_bytes(),
            self.server_key_pem.as_bytes(),
            mutual.then_some(self.ca_pem.as_bytes()),
        )
        .expect("server TLS config")
    }

    /// A client trusting this CA; `with_cert`: it presents this PKI's client certificate.
    pub fn client_config(&self, with_cert: bool) -> Arc<rustls::ClientConfig> {
        client_config(self, with_cert.then_some(self), rustls::DEFAULT_VERSIONS)
    }

    /// Writes the certificate directory libnbd (`tls-certificates=`) and qemu
    /// (`tls-creds-x509,dir=`) read as a client: `ca-cert.pem`, and with `with_cert` also
    /// `client-cert.pem` and `client-key.pem`.
    pub fn write_client_dir(&self, dir: &Path, with_cert: bool) {
        std::fs::create_dir_all(dir).expect("create certificate dir");
        std::fs::write(dir.join("ca-cert.pem"), &self.ca_pem).expect("write ca-cert.pem");
        if with_cert {
            std::fs::write(dir.join("client-cert.pem"), &self.client_cert_pem)
                .expect("write client-cert.pem");
            std::fs::write(dir.join("client-key.pem"), &self.client_key_pem)
                .expect("write client-key.pem");
        }
    }
}

/// A client that trusts `trust`'s CA, presents `cert`'s client certificate (if any) and
/// speaks only `versions`.
pub fn client_config(
    trust: &Pki,
    cert: Option<&Pki>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let ca = CertificateDer::from_pem_slice(trust.ca_pem.as_bytes()).expect("CA PEM");
    roots.add(ca).expect("CA into the root store");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .expect("protocol versions")
        .with_root_certificates(roots);
    let config = match cert {
        Some(pki) => {
            let chain = vec![
                CertificateDer::from_pem_slice(pki.client_cert_pem.as_bytes())
                    .expect("client cert PEM"),
            ];
            let key = PrivateKeyDer::from_pem_slice(pki.client_key_pem.as_bytes())
                .expect("client key PEM");
            builder
                .with_client_auth_cert(chain, key)
                .expect("client cert and key")
        }
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

pub fn server_name() -> ServerName<'static> {
    ServerName::try_from(SERVER_NAME).expect("valid DNS name")
}
