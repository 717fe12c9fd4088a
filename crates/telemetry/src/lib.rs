//! Prometheus endpoints for starfabric nodes.
//!
//! Every node serves `GET /metrics` (OpenMetrics text, encoded by `prometheus-client`)
//! and `GET /healthz` (200 `ok`) on an address of its own. Metrics are rendered at
//! scrape time from snapshots of the counters the node keeps anyway (the collector
//! pattern): the packet path keeps plain integers and a node publishes or answers a
//! snapshot, so serving metrics adds no atomics or locks to hot paths.
//!
//! - [`Exporter`]: a `prometheus-client` [`Registry`] with a name prefix, plus an
//!   optional async hook run before each scrape, for nodes whose state lives in a task
//!   that must be asked (FM, SC); the hook refreshes a snapshot the collectors read.
//! - [`Scrape`] / [`collector`]: write const counters, gauges, labelled families and
//!   fixed-bucket histograms from a snapshot inside a closure.
//! - [`MetricsServer`]: an axum server on the caller's tokio runtime
//!   ([`MetricsServer::spawn`]) or on a thread of its own ([`MetricsServer::spawn_thread`],
//!   for the PP node whose worker is a plain thread).
//! - [`scrape`]: a tiny blocking HTTP client and exposition parser, for tests and
//!   health checks.

pub mod scrape;

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric, NoLabelSet,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use thiserror::Error;
use tokio::sync::oneshot;

pub use prometheus_client;

/// What `prometheus_client::encoding::text::encode` produces: OpenMetrics 1.0 text,
/// `# EOF` included. Prometheus negotiates it and parses it natively.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Debug, Error)]
pub enum TelemetryError {
    #[error("metrics endpoint: bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("metrics endpoint: {0}")]
    Io(#[from] std::io::Error),
    #[error("metrics endpoint: encoding the exposition failed")]
    Encode,
}

type Refresh = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A registry of collectors with a name prefix (`starfabric_pp`, ...), and an optional
/// hook run before each scrape.
pub struct Exporter {
    registry: Registry,
    refresh: Option<Refresh>,
    /// More routes served beside `/metrics` and `/healthz` (the PP node's `/trace`).
    routes: Option<Router>,
}

impl Exporter {
    /// Metric names get `prefix_` in front.
    pub fn new(prefix: &str) -> Self {
        let mut registry = Registry::with_prefix(prefix);
        registry.register_collector(Box::new(collector(pack_metrics)));
        Exporter {
            registry,
            refresh: None,
            routes: None,
        }
    }

    /// Serve `routes` on the same endpoint, beside `/metrics` and `/healthz`.
    pub fn routes(mut self, routes: Router) -> Self {
        self.routes = Some(match self.routes.take() {
            Some(r) => r.merge(routes),
            None => routes,
        });
        self
    }

    /// Add a collector; it is asked for its metrics on every scrape.
    pub fn collector(mut self, c: impl Collector) -> Self {
        self.registry.register_collector(Box::new(c));
        self
    }

    /// The registry, for metrics kept as `prometheus-client` types.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Run `f` (to completion) before every scrape, e.g. to fetch a fresh snapshot
    /// from the task that owns the state; collectors then read what it stored.
    pub fn on_scrape<F, Fut>(mut self, f: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.refresh = Some(Arc::new(move || Box::pin(f())));
        self
    }

    /// Refresh, then encode every collector as OpenMetrics text.
    pub async fn render(&self) -> Result<String, TelemetryError> {
        if let Some(r) = &self.refresh {
            r().await;
        }
        self.encode()
    }

    /// Encode without refreshing.
    pub fn encode(&self) -> Result<String, TelemetryError> {
        let mut out = String::with_capacity(16 * 1024);
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .map_err(|_| TelemetryError::Encode)?;
        Ok(out)
    }
}

/// Writes metrics from a snapshot during a scrape; see [`collector`].
pub struct Scrape<'a> {
    enc: DescriptorEncoder<'a>,
}

impl Scrape<'_> {
    /// A counter. `name` has no `_total`: the OpenMetrics encoder appends it.
    pub fn counter(&mut self, name: &str, help: &str, v: u64) -> fmt::Result {
        let c = ConstCounter::new(v);
        c.encode(
            self.enc
                .encode_descriptor(name, help, None, c.metric_type())?,
        )
    }

    /// A counter of time in seconds, Prometheus' base unit: `name` gets `_seconds`,
    /// then `_total`.
    pub fn counter_seconds(&mut self, name: &str, help: &str, secs: f64) -> fmt::Result {
        let c = ConstCounter::new(secs);
        c.encode(
            self.enc
                .encode_descriptor(name, help, Some(&Unit::Seconds), c.metric_type())?,
        )
    }

    pub fn gauge<V: EncodeGaugeValue>(&mut self, name: &str, help: &str, v: V) -> fmt::Result {
        let g = ConstGauge::new(v);
        g.encode(
            self.enc
                .encode_descriptor(name, help, None, g.metric_type())?,
        )
    }

    /// A counter with one series per label set, e.g. `[("tenant", "7")]`.
    pub fn counter_family<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (L, u64)>,
    ) -> fmt::Result {
        let series = series.into_iter().map(|(l, v)| (l, ConstCounter::new(v)));
        self.family(name, help, MetricType::Counter, series)
    }

    /// A gauge with one series per label set.
    pub fn gauge_family<L: EncodeLabelSet, V: EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (L, V)>,
    ) -> fmt::Result {
        let series = series.into_iter().map(|(l, v)| (l, ConstGauge::new(v)));
        self.family(name, help, MetricType::Gauge, series)
    }

    fn family<L: EncodeLabelSet, M: EncodeMetric>(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        series: impl Iterator<Item = (L, M)>,
    ) -> fmt::Result {
        let mut m = self.enc.encode_descriptor(name, help, None, kind)?;
        for (labels, metric) in series {
            metric.encode(m.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A histogram in seconds (`name` gets `_seconds`) from fixed buckets kept
    /// elsewhere: `buckets` are (upper bound, count in that bucket alone), ending with
    /// `+Inf`; the encoder makes them cumulative.
    pub fn histogram_seconds(
        &mut self,
        name: &str,
        help: &str,
        sum: f64,
        count: u64,
        buckets: &[(f64, u64)],
    ) -> fmt::Result {
        let unit = Unit::Seconds;
        let mut m = self
            .enc
            .encode_descriptor(name, help, Some(&unit), MetricType::Histogram)?;
        m.encode_histogram::<NoLabelSet>(sum, count, buckets, None)
    }
}

/// The process's control-thread packer (`--pack-cpus`, docs/corepack.md), on every
/// node's endpoint; nothing when no packer runs.
fn pack_metrics(s: &mut Scrape<'_>) -> fmt::Result {
    let Some(p) = corepack::process_stats() else {
        return Ok(());
    };
    s.gauge(
        "pack_active_cpus",
        "CPUs the node's control threads may use now (corepack)",
        p.active as i64,
    )?;
    s.gauge(
        "pack_cpus",
        "CPUs the packer may spread the control threads over",
        p.cpus as i64,
    )?;
    s.gauge(
        "pack_managed_threads",
        "Threads the packer places (data-path and externally pinned threads excluded)",
        p.managed_threads as i64,
    )?;
    s.counter(
        "pack_grows",
        "Times the packer gave the control threads one more CPU",
        p.grows,
    )?;
    s.counter(
        "pack_shrinks",
        "Times the packer took one CPU from the control threads",
        p.shrinks,
    )?;
    s.counter(
        "pack_failed_probes",
        "Shrinks undone within the probe window (the load did not fit)",
        p.failed_probes,
    )?;
    s.counter(
        "pack_affinity_errors",
        "sched_setaffinity calls the kernel refused",
        p.affinity_errors,
    )
}

/// A collector from a closure that writes metrics into a [`Scrape`].
pub fn collector<F>(f: F) -> impl Collector
where
    F: Fn(&mut Scrape<'_>) -> fmt::Result + Send + Sync + 'static,
{
    FnCollector(f)
}

struct FnCollector<F>(F);

impl<F> fmt::Debug for FnCollector<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnCollector")
    }
}

impl<F> Collector for FnCollector<F>
where
    F: Fn(&mut Scrape<'_>) -> fmt::Result + Send + Sync + 'static,
{
    fn encode(&self, enc: DescriptorEncoder) -> fmt::Result {
        (self.0)(&mut Scrape { enc })
    }
}

/// A running metrics endpoint. Dropping it stops the server.
pub struct MetricsServer {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn bind(addr: SocketAddr) -> Result<(std::net::TcpListener, SocketAddr), TelemetryError> {
    // Bound synchronously, so a bad address fails the caller at once and port 0
    // resolves before anyone prints the address.
    let l = std::net::TcpListener::bind(addr)
        .map_err(|source| TelemetryError::Bind { addr, source })?;
    l.set_nonblocking(true)?;
    let bound = l.local_addr()?;
    Ok((l, bound))
}

fn router(mut exporter: Exporter) -> Router {
    let extra = exporter.routes.take();
    let r = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Arc::new(exporter));
    match extra {
        Some(e) => r.merge(e),
        None => r,
    }
}

async fn metrics(State(exporter): State<Arc<Exporter>>) -> Response {
    match exporter.render().await {
        Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "metrics scrape failed");
            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
        }
    }
}

async fn serve(listener: std::net::TcpListener, exporter: Exporter, stop: oneshot::Receiver<()>) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "metrics endpoint cannot start");
            return;
        }
    };
    let app = router(exporter);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = stop.await;
        })
        .await
    {
        tracing::warn!(error = %e, "metrics endpoint stopped");
    }
}

impl MetricsServer {
    /// Serve on the current tokio runtime (call from within it, e.g. in `block_on`).
    pub fn spawn(addr: SocketAddr, exporter: Exporter) -> Result<Self, TelemetryError> {
        let (listener, bound) = bind(addr)?;
        let (tx, rx) = oneshot::channel();
        tokio::spawn(serve(listener, exporter, rx));
        tracing::info!(addr = %bound, "metrics endpoint listening");
        Ok(MetricsServer {
            addr: bound,
            shutdown: Some(tx),
            thread: None,
        })
    }

    /// Serve on a thread of its own, with a single-threaded runtime: for callers with
    /// no tokio runtime of their own (the PP worker loop).
    pub fn spawn_thread(addr: SocketAddr, exporter: Exporter) -> Result<Self, TelemetryError> {
        let (listener, bound) = bind(addr)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tx, rx) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || rt.block_on(serve(listener, exporter, rx)))?;
        tracing::info!(addr = %bound, "metrics endpoint listening");
        Ok(MetricsServer {
            addr: bound,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    /// The bound address (the real port when asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/metrics`.
    pub fn url(&self) -> String {
        format!("http://{}/metrics", self.addr)
    }

    /// Print `metrics: listening on URL` to stdout: node processes say so once their
    /// endpoint is up, and tests and `starfabric up` parse the line.
    pub fn announce(&self) -> std::io::Result<()> {
        use std::io::Write as _;
        println!("metrics: listening on {}", self.url());
        std::io::stdout().flush()
    }

    /// Stop serving; waits for the server thread if it has one.
    pub fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a node's status lines go (`pp: listening on ...`, stats lines, `fm: stopped`).
/// The binary prints them to stdout, where tests and `starfabric up` read them; an
/// in-process caller may collect them; the default drops them.
#[derive(Clone, Default)]
pub struct Lines(Option<LineFn>);

type LineFn = Arc<dyn Fn(&str) + Send + Sync>;

impl Lines {
    pub fn new(f: impl Fn(&str) + Send + Sync + 'static) -> Lines {
        Lines(Some(Arc::new(f)))
    }

    /// Each line to stdout, flushed: readers wait for them.
    pub fn stdout() -> Lines {
        Lines::new(|l| {
            use std::io::Write as _;
            println!("{l}");
            let _ = std::io::stdout().flush();
        })
    }

    pub fn say(&self, line: &str) {
        if let Some(f) = &self.0 {
            f(line)
        }
    }

    /// Whether anyone listens (a line not worth building otherwise).
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }
}

/// Serve the metrics of a node whose state lives in tasks that must be asked: each
/// scrape first awaits `fetch` and keeps its answer (`None` keeps the last one) in the
/// snapshot `exporter`'s collectors read; then announce the endpoint.
pub fn serve_fetched<S, F, Fut>(
    rt: &tokio::runtime::Handle,
    addr: SocketAddr,
    exporter: impl FnOnce(Arc<std::sync::Mutex<S>>) -> Exporter,
    fetch: F,
) -> Result<MetricsServer, TelemetryError>
where
    S: Default + Send + 'static,
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<S>> + Send + 'static,
{
    let snap = Arc::new(std::sync::Mutex::new(S::default()));
    let s = snap.clone();
    let exporter = exporter(snap).on_scrape(move || {
        let (s, next) = (s.clone(), fetch());
        async move {
            if let Some(f) = next.await {
                *lock(&s) = f;
            }
        }
    });
    let _guard = rt.enter();
    let server = MetricsServer::spawn(addr, exporter)?;
    server.announce()?;
    Ok(server)
}

/// A snapshot mutex, poison or not: a scrape renders whatever was last published.
pub fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `tenant` label of per-tenant families.
pub fn tenant_label(t: u32) -> [(&'static str, String); 1] {
    [("tenant", t.to_string())]
}

/// A pipeline latency histogram as a `_seconds` histogram.
pub fn latency(
    s: &mut Scrape<'_>,
    name: &str,
    help: &str,
    h: &pipeline::LatencyHistogram,
) -> fmt::Result {
    s.histogram_seconds(name, help, h.sum_seconds(), h.count, &h.buckets_seconds())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    fn local() -> SocketAddr {
        "127.0.0.1:0".parse().unwrap()
    }

    #[test]
    fn every_endpoint_shows_the_packer_while_one_runs() {
        let e = Exporter::new("t");
        let packer = corepack::CorePacker::start(corepack::PackConfig::default()).unwrap();
        let text = e.encode().unwrap();
        let cpus = corepack::allowed_cpus().len();
        assert!(text.contains(&format!("t_pack_cpus {cpus}")), "{text}");
        assert!(text.contains("t_pack_active_cpus "), "{text}");
        assert!(text.contains("t_pack_failed_probes_total 0"), "{text}");
        packer.stop();
        assert!(
            !e.encode().unwrap().contains("pack_"),
            "gone with the packer"
        );
    }

    fn sample_exporter(n: Arc<Mutex<u64>>) -> Exporter {
        Exporter::new("t").collector(collector(move |s| {
            let n = *n.lock().unwrap();
            s.counter("things", "Things.", n)?;
            s.gauge("level", "Level.", 0.5f64)?;
            s.counter_seconds("busy", "Busy time.", 1.25)?;
            s.counter_family(
                "per_tenant",
                "Per tenant.",
                [([("tenant", "1")], 3u64), ([("tenant", "2")], 4)],
            )?;
            s.histogram_seconds(
                "latency",
                "Latency.",
                0.0035,
                2,
                &[(0.001, 1), (0.005, 1), (f64::INFINITY, 0)],
            )
        }))
    }

    #[test]
    fn thread_server_serves_metrics_and_health() {
        let n = Arc::new(Mutex::new(5));
        let mut srv = MetricsServer::spawn_thread(local(), sample_exporter(n.clone())).unwrap();
        assert_ne!(srv.addr().port(), 0);
        let r = scrape::get(srv.addr(), "/metrics").unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.content_type.as_deref(), Some(CONTENT_TYPE));
        let samples = scrape::parse(&r.body);
        assert_eq!(scrape::value(&samples, "t_things_total", &[]), Some(5.0));
        assert_eq!(scrape::value(&samples, "t_level", &[]), Some(0.5));
        assert_eq!(
            scrape::value(&samples, "t_busy_seconds_total", &[]),
            Some(1.25)
        );
        assert!(
            r.body.contains("# UNIT t_busy_seconds seconds"),
            "{}",
            r.body
        );
        assert_eq!(
            scrape::value(&samples, "t_per_tenant_total", &[("tenant", "2")]),
            Some(4.0)
        );
        // Buckets are cumulative on the wire.
        assert_eq!(
            scrape::value(&samples, "t_latency_seconds_bucket", &[("le", "0.005")]),
            Some(2.0)
        );
        assert_eq!(
            scrape::value(&samples, "t_latency_seconds_count", &[]),
            Some(2.0)
        );
        assert!(r.body.ends_with("# EOF\n"), "{}", r.body);
        // Rendered at scrape time.
        *n.lock().unwrap() = 6;
        let r = scrape::get(srv.addr(), "/metrics").unwrap();
        assert_eq!(
            scrape::value(&scrape::parse(&r.body), "t_things_total", &[]),
            Some(6.0)
        );
        let h = scrape::get(srv.addr(), "/healthz").unwrap();
        assert_eq!((h.status, h.body.as_str()), (200, "ok"));
        assert_eq!(scrape::get(srv.addr(), "/nope").unwrap().status, 404);
        let addr = srv.addr();
        srv.stop();
        assert!(scrape::get(addr, "/healthz").is_err(), "stopped");
    }

    #[test]
    fn runtime_server_runs_the_scrape_hook_first() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let calls = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(Mutex::new(0u64));
        let (c, s) = (calls.clone(), seen.clone());
        let exporter = Exporter::new("t")
            .on_scrape(move || {
                let (c, s) = (c.clone(), s.clone());
                async move {
                    let n = c.fetch_add(1, Ordering::Relaxed) + 1;
                    *s.lock().unwrap() = n;
                }
            })
            .collector(collector(move |sc| {
                sc.counter("scrapes", "Scrapes.", *seen.lock().unwrap())
            }));
        let srv = rt
            .block_on(async { MetricsServer::spawn(local(), exporter) })
            .unwrap();
        for want in 1..=2 {
            let r = scrape::get(srv.addr(), "/metrics").unwrap();
            let v = scrape::value(&scrape::parse(&r.body), "t_scrapes_total", &[]);
            assert_eq!(v, Some(want as f64));
        }
        assert!(matches!(
            MetricsServer::spawn_thread(srv.addr(), Exporter::new("x")),
            Err(TelemetryError::Bind { .. })
        ));
    }
}

/// Per-second rates of cumulative counters between two observations (a node's report
/// to the orchestrator carries rates; its counters only grow). A counter that went
/// down (a restart) gives 0, not a negative rate; the first observation gives 0.
#[derive(Debug, Clone, Copy)]
pub struct CounterRates<const N: usize> {
    last: Option<(std::time::Instant, [u64; N])>,
    per_s: [f64; N],
}

impl<const N: usize> Default for CounterRates<N> {
    fn default() -> Self {
        CounterRates {
            last: None,
            per_s: [0.0; N],
        }
    }
}

impl<const N: usize> CounterRates<N> {
    pub fn observe(&mut self, now: std::time::Instant, counters: [u64; N]) -> [f64; N] {
        if let Some((t, before)) = self.last {
            let dt = now.saturating_duration_since(t).as_secs_f64();
            if dt > 0.0 {
                for i in 0..N {
                    self.per_s[i] = counters[i].saturating_sub(before[i]) as f64 / dt;
                }
            }
        }
        self.last = Some((now, counters));
        self.per_s
    }
}

#[cfg(test)]
mod counter_rates_tests {
    use super::CounterRates;
    use std::time::{Duration, Instant};

    #[test]
    fn rates_between_observations() {
        let mut r = CounterRates::<2>::default();
        let t0 = Instant::now();
        assert_eq!(r.observe(t0, [100, 7]), [0.0, 0.0]);
        assert_eq!(
            r.observe(t0 + Duration::from_millis(500), [300, 7]),
            [400.0, 0.0]
        );
        // A restart: counters went down; no negative rate.
        assert_eq!(r.observe(t0 + Duration::from_secs(1), [10, 9]), [0.0, 4.0]);
        // No time passed: the last rates stand.
        assert_eq!(r.observe(t0 + Duration::from_secs(1), [20, 9]), [0.0, 4.0]);
    }
}
