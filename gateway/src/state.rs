//! What the API's layers and endpoints share: the seams to the world outside the process (keys,
//! rate limits, the write sink) and the settings.

use crate::auth::Authenticate;
use crate::limits::RateLimit;
use crate::metrics::Metrics;
use crate::overload::Admission;
use crate::sink::WriteSink;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;

pub struct AppState {
    pub pool: PgPool,
    pub auth: Arc<dyn Authenticate>,
    pub limiter: Arc<dyn RateLimit>,
    pub writes: Arc<dyn WriteSink>,
    pub admission: Admission,
    pub metrics: Metrics,
    pub script_base_url: String,
    pub body_read_timeout: Duration,
    pub panic_test_route: bool,
}
