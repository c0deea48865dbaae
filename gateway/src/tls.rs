//! TLS termination: rustls with the certificate chain and private key read from PEM files, and
//! read again when they change, so that a renewed certificate is served without a restart.
//!
//! The files are checked every [`RELOAD_CHECK`]: a new pair is loaded when either file's
//! modification time, size or inode changed (a Kubernetes Secret volume swaps a symlink, which
//! changes the inode). A pair that does not load (unreadable, not PEM, a key that does not match
//! the certificate, a half-written file) is logged and the last good pair stays in use; it is
//! tried again when a file changes again. The first pair must load, else the gateway does not
//! start.
//!
//! ALPN offers `h2` and `http/1.1`; what the client picks is the connection's protocol.

use anyhow::Context;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// How often the files are checked for a change.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// The ALPN protocol id of HTTP/2.
pub const ALPN_H2: &[u8] = b"h2";

#[derive(Debug, Clone)]
pub struct Files {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Loads the pair and returns the acceptor for the API listener; a task checks the files for a
/// change until `stop` is cancelled.
pub fn acceptor(files: Files, stop: CancellationToken) -> anyhow::Result<TlsAcceptor> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let stamp = Stamp::of(&files);
    let first = load(&files, &provider)?;
    tracing::info!(cert = %files.cert.display(), key = %files.key.display(), "TLS certificate loaded");
    let resolver = Arc::new(Reloading { current: RwLock::new(Arc::new(first)) });
    let mut config = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    config.alpn_protocols = vec![ALPN_H2.to_vec(), b"http/1.1".to_vec()];
    tokio::spawn(watch(files, stamp, resolver, provider, stop));
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The certificate every handshake gets: the last pair that loaded.
#[derive(Debug)]
struct Reloading {
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Reloading {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().unwrap_or_else(|poisoned| poisoned.into_inner()).clone())
    }
}

/// What tells that a file changed, for both files.
#[derive(Debug, PartialEq, Eq)]
struct Stamp(Option<(SystemTime, u64, u64)>, Option<(SystemTime, u64, u64)>);

impl Stamp {
    fn of(files: &Files) -> Stamp {
        let one = |path: &Path| std::fs::metadata(path).ok().and_then(|m| Some((m.modified().ok()?, m.len(), m.ino())));
        Stamp(one(&files.cert), one(&files.key))
    }
}

async fn watch(
    files: Files,
    mut seen: Stamp,
    resolver: Arc<Reloading>,
    provider: Arc<CryptoProvider>,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(RELOAD_CHECK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = stop.cancelled() => return,
        }
        let stamp = Stamp::of(&files);
        if stamp == seen {
            continue;
        }
        seen = stamp;
        let (files, provider) = (files.clone(), provider.clone());
        match tokio::task::spawn_blocking(move || load(&files, &provider)).await {
            Ok(Ok(pair)) => {
                *resolver.current.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = Arc::new(pair);
                tracing::info!("TLS certificate reloaded");
            }
            Ok(Err(error)) => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "TLS certificate files changed but do not load; keeping the previous certificate"
                );
            }
            Err(error) => tracing::warn!(%error, "TLS certificate reload failed"),
        }
    }
}

/// Reads the chain and the key, and checks that the key is the certificate's.
fn load(files: &Files, provider: &CryptoProvider) -> anyhow::Result<CertifiedKey> {
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .with_context(|| format!("reading {}", files.cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", files.cert.display()))?;
    if chain.is_empty() {
        anyhow::bail!("no certificate in {}", files.cert.display());
    }
    // The parse error says what failed, never a byte of the key.
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|error| anyhow::anyhow!("reading a private key from {}: {error}", files.key.display()))?;
    CertifiedKey::from_der(chain, key, provider).context("the private key does not fit the certificate")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_pair_does_not_load() {
        let provider = rustls::crypto::ring::default_provider();
        let dir = std::env::temp_dir().join(format!("intake-tls-unit-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let files = Files { cert: dir.join("cert.pem"), key: dir.join("key.pem") };
        assert!(load(&files, &provider).is_err(), "missing files");
        let _ = std::fs::write(&files.cert, "not pem");
        let _ = std::fs::write(&files.key, "not pem");
        let error = load(&files, &provider).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(error.contains("no certificate"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_stamp_changes_with_the_file() {
        let dir = std::env::temp_dir().join(format!("intake-tls-stamp-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let files = Files { cert: dir.join("cert.pem"), key: dir.join("key.pem") };
        let missing = Stamp::of(&files);
        let _ = std::fs::write(&files.cert, "one");
        let written = Stamp::of(&files);
        assert_ne!(missing, written);
        let _ = std::fs::write(&files.cert, "three");
        assert_ne!(written, Stamp::of(&files), "a new size");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
