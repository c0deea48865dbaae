//! The API's routes (docs/api.md, "Endpoints"): each under `/v1` and the alias `/api/v1`; everything else,
//! including a known path with another method, is 404 not_found.

use http::Method;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Workspace,
    Conversion,
    ConversionBatch,
    /// Validates a batch and writes nothing (docs/api.md, "POST /v1/conversions/validate").
    ConversionValidate,
    OpenApi,
}

impl Route {
    pub fn recognize(method: &Method, path: &str) -> Option<Route> {
        let rest = path.strip_prefix("/v1/").or_else(|| path.strip_prefix("/api/v1/"))?;
        match (method, rest) {
            (&Method::GET, "workspace") => Some(Route::Workspace),
            (&Method::POST, "conversions") => Some(Route::Conversion),
            (&Method::POST, "conversions/batch") => Some(Route::ConversionBatch),
            (&Method::POST, "conversions/validate") => Some(Route::ConversionValidate),
            (&Method::GET, "openapi.json") => Some(Route::OpenApi),
            _ => None,
        }
    }

    /// The scope a key needs for the route; `None` for the public contract document.
    pub fn scope(self) -> Option<&'static str> {
        match self {
            Route::Workspace => Some("workspace:read"),
            Route::Conversion | Route::ConversionBatch | Route::ConversionValidate => Some("conversions:write"),
            Route::OpenApi => None,
        }
    }

    /// A write: goes through write admission (503 when the writers are behind).
    pub fn is_write(self) -> bool {
        matches!(self, Route::Conversion | Route::ConversionBatch)
    }

    /// Takes every field in its JSON body: a query string is refused (400 query_not_allowed).
    pub fn refuses_query(self) -> bool {
        matches!(self, Route::Conversion | Route::ConversionBatch | Route::ConversionValidate)
    }

    /// For logs and metrics: the name of a request that has no route.
    pub const UNKNOWN: &'static str = "unknown";

    /// For logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Route::Workspace => "workspace",
            Route::Conversion => "conversions",
            Route::ConversionBatch => "conversions_batch",
            Route::ConversionValidate => "conversions_validate",
            Route::OpenApi => "openapi",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_routes_under_both_prefixes() {
        for prefix in ["/v1", "/api/v1"] {
            assert_eq!(Route::recognize(&Method::GET, &format!("{prefix}/workspace")), Some(Route::Workspace));
            assert_eq!(Route::recognize(&Method::POST, &format!("{prefix}/conversions")), Some(Route::Conversion));
            assert_eq!(
                Route::recognize(&Method::POST, &format!("{prefix}/conversions/batch")),
                Some(Route::ConversionBatch)
            );
            assert_eq!(
                Route::recognize(&Method::POST, &format!("{prefix}/conversions/validate")),
                Some(Route::ConversionValidate)
            );
            assert_eq!(Route::recognize(&Method::GET, &format!("{prefix}/openapi.json")), Some(Route::OpenApi));
        }
    }

    #[test]
    fn everything_else_is_unknown() {
        for (method, path) in [
            (Method::GET, "/"),
            (Method::GET, "/v1"),
            (Method::GET, "/v1/"),
            (Method::GET, "/api/v1"),
            (Method::GET, "/v1/conversions"),
            (Method::POST, "/v1/workspace"),
            (Method::DELETE, "/v1/conversions"),
            (Method::POST, "/v1/conversions/"),
            (Method::POST, "/v2/conversions"),
            (Method::GET, "/v1/workspace/x"),
            (Method::POST, "/api/v1/conversions/batch/1"),
            (Method::GET, "/v1/conversions/validate"),
            (Method::PUT, "/v1/conversions/validate"),
            (Method::POST, "/v1/conversions/validate/"),
            (Method::GET, "/healthz"),
        ] {
            assert_eq!(Route::recognize(&method, path), None, "{method} {path}");
        }
    }
}
