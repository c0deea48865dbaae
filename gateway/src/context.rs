//! What the layers and the endpoints know about one request, in its extensions: its id and
//! start, and what its log line says about it, filled in as the request goes through (never a
//! body or an identifier value).

use crate::api_error::ApiError;
use crate::auth::Principal;
use crate::timing::Stages;
use intake_model::ids;
use std::sync::{Arc, OnceLock};

#[derive(Clone)]
pub struct RequestContext {
    pub id: Arc<str>,
    /// When the request arrived: the write deadline counts from here, so that time spent
    /// before the write (a slow key look-up, reading the body) is inside it.
    pub started: std::time::Instant,
    facts: Arc<Facts>,
}

#[derive(Default)]
struct Facts {
    principal: OnceLock<(Arc<str>, Arc<str>)>,
    items: OnceLock<usize>,
    stages: OnceLock<Stages>,
}

impl Default for RequestContext {
    fn default() -> Self {
        RequestContext { id: ids::new_id("req_").into(), started: std::time::Instant::now(), facts: Arc::default() }
    }
}

impl RequestContext {
    /// The request's context, or a new one for a request that came in without (a test's).
    pub fn of<B>(request: &http::Request<B>) -> RequestContext {
        request.extensions().get::<RequestContext>().cloned().unwrap_or_default()
    }

    /// The key and workspace the request was authenticated as.
    pub fn authenticated(&self, principal: &Principal) {
        let _ = self.facts.principal.set((principal.workspace_id.clone(), principal.key_id.clone()));
    }

    /// The number of conversions the request carried.
    pub fn items(&self, count: usize) {
        let _ = self.facts.items.set(count);
    }

    /// (workspace id, key id), once authenticated.
    pub fn principal(&self) -> Option<(&str, &str)> {
        self.facts.principal.get().map(|(w, k)| (&**w, &**k))
    }

    pub fn item_count(&self) -> usize {
        self.facts.items.get().copied().unwrap_or(0)
    }

    /// Where a write's time went, once it was answered.
    pub fn stages(&self, stages: Stages) {
        let _ = self.facts.stages.set(stages);
    }

    pub fn timed_stages(&self) -> Option<&Stages> {
        self.facts.stages.get()
    }
}

/// What a layer put into the request's extensions for the endpoint (the principal, the
/// admission's ticket); its absence is a fault of the layers' assembly, answered 500.
pub fn required<T: Clone + Send + Sync + 'static, B>(request: &http::Request<B>) -> Result<T, ApiError> {
    request
        .extensions()
        .get::<T>()
        .cloned()
        .ok_or_else(|| ApiError::Internal(format!("no {} in the request", std::any::type_name::<T>())))
}
