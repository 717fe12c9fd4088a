//! API errors: every failure is an HTTP status plus a JSON body that says exactly what
//! is wrong (and which field), never a bare status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use thiserror::Error;

use crate::model::{ErrorBody, ErrorDetail};

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub field: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            field: None,
        }
    }

    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_json", message)
    }

    pub fn bad_query(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", message).at(field)
    }

    /// A well-formed request whose content is not acceptable (422).
    pub fn invalid(field: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_field", message).at(field)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// This error as item `at` (for example `items[2]`) of a request that carried
    /// several objects: the field path gets the prefix, the message names the object.
    pub fn within(mut self, at: &str, object: &str) -> Self {
        self.field = Some(match self.field.take() {
            Some(f) if !f.is_empty() => format!("{at}.{f}"),
            _ => at.to_string(),
        });
        self.message = format!("{object}: {}", self.message);
        self
    }

    pub fn at(mut self, field: &str) -> Self {
        self.field = Some(field.to_string());
        self
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                status: self.status.as_u16(),
                code: self.code.to_string(),
                message: self.message.clone(),
                field: self.field.clone(),
            },
        }
    }
}

impl From<store::StoreError> for ApiError {
    fn from(e: store::StoreError) -> Self {
        match e {
            store::StoreError::Unavailable(m) => {
                ApiError::unavailable(format!("the store is unavailable: {m}"))
            }
            store::StoreError::Conflict { key } => ApiError::conflict(format!(
                "a concurrent change to {key} won; retry the request"
            )),
            other => ApiError::internal(format!("store: {other}")),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), code = self.code, message = %self.message, "API error");
        } else {
            tracing::debug!(status = self.status.as_u16(), code = self.code, message = %self.message, "API request refused");
        }
        (self.status, Json(self.body())).into_response()
    }
}
