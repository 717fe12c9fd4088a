//! The scraping side, small and blocking: fetch an endpoint over HTTP/1.1 and parse
//! the exposition into samples. For tests and health checks, not for a Prometheus.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// An HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: String,
}

fn bad(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.into())
}

/// `GET path` from `addr` (one request per connection, 5 s timeouts).
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<HttpResponse> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8(raw).map_err(|e| bad(e.to_string()))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut content_type = None;
    let mut chunked = false;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-type" {
            content_type = Some(v.to_string());
        } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Ok(HttpResponse {
        status,
        content_type,
        body,
    })
}

fn dechunk(mut s: &str) -> std::io::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").ok_or_else(|| bad("bad chunk"))?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad("bad chunk size"))?;
        if n == 0 {
            return Ok(out);
        }
        let chunk = rest.get(..n).ok_or_else(|| bad("short chunk"))?;
        out.push_str(chunk);
        s = rest.get(n + 2..).ok_or_else(|| bad("short chunk"))?;
    }
}

/// One sample line of an exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, k: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Parse the sample lines of Prometheus or OpenMetrics text; comments, exemplars and
/// timestamps are skipped, and lines that do not parse are ignored.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices();
        let mut key = String::new();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => break i,
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut val = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => val.push('\n'),
                                c => val.push(c),
                            },
                            c => val.push(c),
                        }
                    }
                    labels.push((std::mem::take(&mut key), val));
                }
                c => key.push(c),
            }
        };
        rest = &r[end + 1..];
    }
    // Value, then an optional timestamp and an optional exemplar (` # {...} v`).
    let rest = rest.split(" # ").next()?;
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The value of the first sample named `name` whose labels include all of `labels`.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(*v)))
        .map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_escapes_and_exemplars() {
        let text = "# HELP x X.\n# TYPE x counter\n\
                    x_total 3\n\
                    y{a=\"1\",b=\"q\\\"uo\\\\te\"} 2.5\n\
                    z_bucket{le=\"+Inf\"} 7 # {trace=\"t\"} 1.0\n\
                    w 4 1700000000\n# EOF\n";
        let s = parse(text);
        assert_eq!(s.len(), 4);
        assert_eq!(value(&s, "x_total", &[]), Some(3.0));
        assert_eq!(value(&s, "y", &[("b", "q\"uo\\te")]), Some(2.5));
        assert_eq!(value(&s, "y", &[("a", "2")]), None);
        assert_eq!(value(&s, "z_bucket", &[("le", "+Inf")]), Some(7.0));
        assert_eq!(value(&s, "w", &[]), Some(4.0));
    }

    #[test]
    fn dechunks() {
        assert_eq!(
            dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            "abcde"
        );
        assert!(dechunk("5\r\nab").is_err());
    }
}
