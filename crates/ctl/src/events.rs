//! `starfabric events --fm HOST:PORT [--since N] [--follow] [-o json]`: FM's event log
//! (scales, refusals, aborts, node deaths, repairs, the autoscaler's decisions).
//!
//! One line per event: `seq time kind message` for people, or one JSON object per line
//! with `-o json` (seq, unix_ms, time, kind, message, detail), which tests and scripts
//! parse. `--follow` keeps polling FM every 200 ms for new events.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use clap::Args;
use proto::v1;

use crate::cli::Output;

#[derive(Args, Debug, Clone, PartialEq)]
pub struct EventsArgs {
    /// FM's gRPC address (`host:port`).
    #[arg(long, env = "STARFABRIC_FM", default_value = "127.0.0.1:7000")]
    pub fm: String,
    /// The first sequence number to print (default: the oldest FM still keeps).
    #[arg(long, default_value_t = 0)]
    pub since: u64,
    /// Keep printing new events as they come (polls every 200 ms).
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// Only events of these kinds (comma-separated, e.g. `autoscale_decision,sc_scale_out_done`).
    #[arg(long, value_delimiter = ',')]
    pub kind: Vec<String>,
    /// With --follow: stop after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Give up on an FM call after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub tls: orchestrator::fm_link::FmTlsArgs,
}

const POLL: Duration = Duration::from_millis(200);
const PAGE: u32 = 1000;

pub fn run(a: EventsArgs, output: Output) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(events(a, output))
}

async fn events(a: EventsArgs, output: Output) -> Result<()> {
    let timeout = Duration::from_secs_f64(a.timeout);
    let tls = a.tls.load().map_err(anyhow::Error::msg)?;
    let mut c = tokio::time::timeout(timeout, orchestrator::fm_link::connect(&a.fm, tls.as_ref()))
        .await
        .map_err(|_| anyhow!("FM at {} did not answer within {} s", a.fm, a.timeout))?
        .map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let mut since = a.since;
    let mut out = std::io::stdout().lock();
    loop {
        let r = tokio::time::timeout(
            timeout,
            c.events(v1::EventsRequest {
                since_seq: since,
                limit: PAGE,
            }),
        )
        .await
        .map_err(|_| anyhow!("FM did not answer within {} s", a.timeout))?
        .map_err(|s| anyhow!("events: {:?}: {}", s.code(), s.message()))?
        .into_inner();
        if since > r.next_seq && r.events.is_empty() {
            // Sequence numbers start at 1 per FM process: a smaller next means FM
            // restarted, and its whole log is new.
            eprintln!(
                "events: FM's log restarted (next seq {} < {since}); from its oldest",
                r.next_seq
            );
            since = 0;
            continue;
        }
        if since > 1 && r.oldest_seq > since {
            eprintln!(
                "events: {} events before seq {} are gone from FM's ring",
                r.oldest_seq - since,
                r.oldest_seq
            );
        }
        let full = r.events.len() as u32 >= PAGE;
        for e in &r.events {
            if a.kind.is_empty() || a.kind.iter().any(|k| k == &e.kind) {
                writeln!(out, "{}", render(e, output))?;
            }
        }
        out.flush()?;
        since = r.next_seq;
        if full {
            continue; // more pages waiting
        }
        if !a.follow
            || a.duration
                .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            return Ok(());
        }
        tokio::time::sleep(POLL).await;
    }
}

fn render(e: &v1::FmEvent, output: Output) -> String {
    match output {
        Output::Json => proto::json::fm_event(e).to_string(),
        Output::Yaml => format!(
            "---\n{}",
            serde_yaml::to_string(&proto::json::fm_event(e)).unwrap_or_default()
        )
        .trim_end()
        .to_string(),
        Output::Table => format!(
            "{:>6}  {}  {:<20}  {}",
            e.seq,
            proto::json::utc(e.unix_ms),
            e.kind,
            e.message
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: EventsArgs,
    }

    #[test]
    fn parses_since_follow_and_kinds() {
        let t = T::try_parse_from([
            "x",
            "--fm",
            "198.18.0.1:7000",
            "--since",
            "42",
            "--follow",
            "--kind",
            "autoscale_decision,sc_scale_out_done",
        ])
        .unwrap();
        assert_eq!(t.a.fm, "198.18.0.1:7000");
        assert_eq!(t.a.since, 42);
        assert!(t.a.follow);
        assert_eq!(t.a.kind, vec!["autoscale_decision", "sc_scale_out_done"]);
        let t = T::try_parse_from(["x", "--fm", "h:1"]).unwrap();
        assert_eq!((t.a.since, t.a.follow, t.a.duration), (0, false, None));
        assert!(T::try_parse_from(["x", "--since", "minus-one"]).is_err());
    }

    #[test]
    fn json_lines_carry_the_detail_as_json() {
        let e = v1::FmEvent {
            seq: 7,
            unix_ms: 1000,
            kind: "sc_scale_out_done".into(),
            message: "scale 1 done".into(),
            detail_json: r#"{"from_group":1,"to_group":2}"#.into(),
        };
        let line = render(&e, Output::Json);
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["seq"], 7);
        assert_eq!(v["detail"]["to_group"], 2);
        assert_eq!(v["time"], "1970-01-01T00:00:01.000Z");
        let human = render(&e, Output::Table);
        assert!(
            human.contains("sc_scale_out_done") && human.contains("scale 1 done"),
            "{human}"
        );
        let empty = v1::FmEvent {
            detail_json: String::new(),
            ..e
        };
        assert!(proto::json::fm_event(&empty)["detail"].is_null());
    }
}
