//! The one client of the orchestrator's REST API: the CLI verbs, `starfabric up`, the
//! benches and the tests all call through it.
//!
//! Like kubectl with its kubeconfig, it finds the API address and a token in
//! `~/.starfabric/config.json` (or `$STARFABRIC_CONFIG`), which `starfabric up` writes
//! ([`ClientConfig`]); explicit values override the file.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    /// The API answered with a non-2xx status; `message` is its error message.
    #[error("{method} {path}: {status}: {message}")]
    Status {
        method: String,
        path: String,
        status: u16,
        message: String,
        body: Value,
    },
    #[error("cannot reach the orchestrator at {server}: {why}")]
    Unreachable { server: String, why: String },
    #[error("{0}")]
    Config(String),
    #[error("bad answer from the orchestrator: {0}")]
    Decode(String),
}

/// The CLI's credentials file.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientConfig {
    /// `http://host:port` of the REST API.
    pub server: String,
    pub token: String,
    /// The nodes' control address (for `starfabric pp|fm|sc --orchestrator`).
    #[serde(default)]
    pub control: String,
}

/// Where [`ClientConfig`] lives.
pub fn config_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STARFABRIC_CONFIG") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".starfabric/config.json")
}

/// Write the credentials file, readable by its owner only.
pub fn write_config(c: &ClientConfig) -> std::io::Result<PathBuf> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = config_path();
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)?;
    writeln!(
        f,
        "{}",
        serde_json::to_string_pretty(c).map_err(std::io::Error::other)?
    )?;
    Ok(path)
}

/// An answer of the API.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

/// A client of one orchestrator.
#[derive(Clone)]
pub struct Client {
    server: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    /// A client of `server` (`http://host:port`) presenting `token` (none: anonymous).
    pub fn new(server: &str, token: Option<&str>) -> Client {
        Client {
            server: server.trim_end_matches('/').to_string(),
            token: token.map(String::from),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(15))
                .build(),
        }
    }

    /// From explicit values, falling back to the credentials file for what is missing.
    pub fn from_config(server: Option<&str>, token: Option<&str>) -> Result<Client, ClientError> {
        let file: Option<ClientConfig> = std::fs::read_to_string(config_path())
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        let server = server
            .map(String::from)
            .or_else(|| file.as_ref().map(|f| f.server.clone()))
            .ok_or_else(|| {
                ClientError::Config(format!(
                    "no orchestrator: run `starfabric up`, or pass --server (config file {} not found)",
                    config_path().display()
                ))
            })?;
        let token = token
            .map(String::from)
            .or_else(|| file.as_ref().map(|f| f.token.clone()))
            .ok_or_else(|| {
                ClientError::Config("no token: pass --token or run `starfabric up`".into())
            })?;
        Ok(Client::new(&server, Some(&token)))
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    /// The same orchestrator with another token (`None`: anonymous).
    pub fn with_token(&self, token: Option<&str>) -> Client {
        Client {
            token: token.map(String::from),
            ..self.clone()
        }
    }

    /// One request with a raw body (sent as JSON): the status and the body, parsed as
    /// JSON where it is (else a JSON string of the text), whatever the status.
    pub fn exchange_raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Reply, ClientError> {
        let mut req = self
            .agent
            .request(method, &format!("{}{path}", self.server));
        if let Some(t) = &self.token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        let res = match body {
            Some(b) => req.set("Content-Type", "application/json").send_string(b),
            None => req.call(),
        };
        let resp = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => {
                return Err(ClientError::Unreachable {
                    server: self.server.clone(),
                    why: e.to_string(),
                })
            }
        };
        let status = resp.status();
        let text = resp
            .into_string()
            .map_err(|e| ClientError::Decode(e.to_string()))?;
        let body = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        Ok(Reply { status, body })
    }

    /// [`Client::exchange_raw`] with a JSON body.
    pub fn exchange(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Reply, ClientError> {
        self.exchange_raw(method, path, body.map(|b| b.to_string()).as_deref())
    }

    /// One request; a non-2xx answer is [`ClientError::Status`] with the API's message.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, ClientError> {
        let r = self.exchange(method, path, body)?;
        if (200..300).contains(&r.status) {
            return Ok(r.body);
        }
        let message = match (&r.body["error"]["message"], &r.body) {
            (Value::String(m), _) | (_, Value::String(m)) => m.clone(),
            (_, b) => b.to_string(),
        };
        Err(ClientError::Status {
            method: method.to_string(),
            path: path.to_string(),
            status: r.status,
            message,
            body: r.body,
        })
    }

    /// Every item of a paged list (`?limit=&after=`, answered as `{items, next}`).
    pub fn all_pages(&self, path: &str) -> Result<Value, ClientError> {
        let mut items = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let sep = if path.contains('?') { '&' } else { '?' };
            let p = match &after {
                Some(a) => format!("{path}{sep}limit=1000&after={a}"),
                None => format!("{path}{sep}limit=1000"),
            };
            let v = self.call("GET", &p, None)?;
            items.extend(v["items"].as_array().cloned().unwrap_or_default());
            match v["next"].as_str() {
                Some(n) => after = Some(n.to_string()),
                None => return Ok(Value::Array(items)),
            }
        }
    }
}
