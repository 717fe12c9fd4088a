//! The `starfabric` CLI verbs: a client of the orchestrator's REST API.
//!
//! Like kubectl with its kubeconfig, it needs no flags next to `starfabric up`: it reads
//! the API address and a token from `~/.starfabric/config.json` (or `$STARFABRIC_CONFIG`),
//! which `up` writes; `--server`/`--token` (or `STARFABRIC_SERVER`/`STARFABRIC_TOKEN`)
//! override it. Output is a table by default, or `-o json|yaml`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use serde_json::{json, Value};

pub use orchestrator::client::{write_config, ClientConfig};

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

/// Flags every client verb takes.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    /// Orchestrator API, `http://host:port` (default: from the config file).
    #[arg(long, global = true, env = "STARFABRIC_SERVER")]
    pub server: Option<String>,
    /// API token (default: from the config file).
    #[arg(long, global = true, env = "STARFABRIC_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: Output,
}

/// The REST client ([`orchestrator::client::Client`]) and the output format.
pub struct Client {
    pub api: orchestrator::client::Client,
    pub output: Output,
}

impl Client {
    pub fn new(a: &ClientArgs) -> Result<Client> {
        Ok(Client {
            api: orchestrator::client::Client::from_config(
                a.server.as_deref(),
                a.token.as_deref(),
            )?,
            output: a.output,
        })
    }

    /// One request; a non-2xx answer becomes an error carrying the API's message.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value> {
        Ok(self.api.call(method, path, body)?)
    }

    /// PUT and report what happened in one line.
    fn put(&self, path: &str, body: Value, what: &str) -> Result<Value> {
        let v = self.call("PUT", path, Some(body))?;
        if self.output == Output::Table {
            println!("{what} applied");
        }
        Ok(v)
    }

    /// Print `v` per `-o`; `cols` are the table's (header, JSON pointer) columns over
    /// `rows` (the list inside `v`).
    pub fn print(&self, v: &Value, rows: &[Value], cols: &[(&str, &str)]) -> Result<()> {
        match self.output {
            Output::Json => println!("{}", serde_json::to_string_pretty(v)?),
            Output::Yaml => print!("{}", serde_yaml::to_string(v)?),
            Output::Table => print_table(rows, cols),
        }
        Ok(())
    }
}

fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

/// Aligned columns, as kubectl prints them. (A table crate would bring box drawing and
/// terminal probing for what is a dozen lines here.)
pub fn print_table(rows: &[Value], cols: &[(&str, &str)]) {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            cols.iter()
                .map(|(_, p)| cell(r.pointer(p).unwrap_or(&Value::Null)))
                .collect()
        })
        .collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, (h, _))| {
            cells
                .iter()
                .map(|r| r[i].len())
                .chain([h.len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |vals: Vec<String>| {
        let s: Vec<String> = vals
            .iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(cols.iter().map(|(h, _)| h.to_string()).collect());
    for r in cells {
        line(r);
    }
}

/// A spinner while waiting (hidden when stdout is not a terminal).
pub fn spinner(msg: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// Poll `f` until it returns Some, with a spinner, or fail after `limit`.
pub fn wait_for<T>(
    msg: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let pb = spinner(msg);
    let start = Instant::now();
    loop {
        match f() {
            Ok(Some(v)) => {
                pb.finish_and_clear();
                return Ok(v);
            }
            Ok(None) => {}
            Err(e) if start.elapsed() >= limit => {
                pb.finish_and_clear();
                return Err(e);
            }
            Err(_) => {}
        }
        if start.elapsed() >= limit {
            pb.finish_and_clear();
            bail!("timed out after {limit:?}: {msg}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

// ---------------------------------------------------------------------- verbs

#[derive(Subcommand, Debug)]
pub enum TenantCmd {
    /// Create (or update) a tenant; with --vni and --snat also its VPC `main`, an SNAT
    /// NF `snat` and a chain `main` through it, in one go.
    Create {
        name: String,
        #[arg(long)]
        pp_cluster: Option<String>,
        /// What the tenant reserves on its SC nodes: `bw=GBIT,cpu=CORES,mem=GIB`
        /// (docs/placement.md); default: the orchestrator's.
        #[arg(long)]
        demand: Option<String>,
        /// VNI of the tenant's VPC `main`.
        #[arg(long)]
        vni: Option<u32>,
        /// SNAT pool addresses (comma-separated): adds SNAT on the VPC.
        #[arg(long, value_delimiter = ',')]
        snat: Vec<String>,
        /// SNAT port range.
        #[arg(long, default_value = "1024-65535")]
        ports: String,
        #[command(flatten)]
        ends: ChainEnds,
    },
    List,
    Get {
        name: String,
    },
    Delete {
        name: String,
        /// Also delete its VPCs, NFs, chains and tokens.
        #[arg(long)]
        cascade: bool,
    },
    /// Show or set the tenant's rates at each PP node (paper 000 §7.2): per second,
    /// `MIN/BASE/BURST[/DEBT]`. With neither --requests nor --packets (nor --clear):
    /// show them, with each node's credit state.
    Rates {
        name: String,
        /// New flows (rule requests) per second.
        #[arg(long)]
        requests: Option<String>,
        /// Packets per second.
        #[arg(long)]
        packets: Option<String>,
        /// Remove the tenant's rates.
        #[arg(long, conflicts_with_all = ["requests", "packets"])]
        clear: bool,
    },
}

/// `MIN/BASE/BURST[/DEBT]` as the API's RateSpec (the API checks the values).
fn rate_spec(s: &str) -> Result<Value> {
    let v: Vec<f64> = s
        .split('/')
        .map(|n| {
            n.trim()
                .parse::<f64>()
                .map_err(|_| anyhow::anyhow!("{s:?}: {n:?} is not a number"))
        })
        .collect::<Result<_>>()?;
    let (min, base, burst, debt) = match v[..] {
        [min, base, burst] => (min, base, burst, 0.0),
        [min, base, burst, debt] => (min, base, burst, debt),
        _ => anyhow::bail!("{s:?}: want MIN/BASE/BURST[/DEBT]"),
    };
    Ok(serde_json::json!({"min": min, "base": base, "burst": burst, "debt": debt}))
}

const RATE_COLS: &[(&str, &str)] = &[
    ("TENANT", "/tenant"),
    ("NODE", "/node"),
    ("KIND", "/kind"),
    ("STATE", "/state"),
    ("CREDIT", "/credit"),
    ("ALLOWANCE/S", "/allowance"),
    ("OFFERED/S", "/offered_rate"),
    ("ADMITTED/S", "/admitted_rate"),
    ("RATE-LIMITED", "/refused"),
];

/// Rate status rows (rounded for the table), each with its tenant's name.
fn rate_rows(tenant: &str, status: &[Value]) -> Vec<Value> {
    status
        .iter()
        .map(|s| {
            let mut r = s.clone();
            r["tenant"] = Value::String(tenant.to_string());
            for k in ["credit", "allowance", "offered_rate", "admitted_rate"] {
                if let Some(x) = r[k].as_f64() {
                    r[k] = serde_json::json!(x.round() as i64);
                }
            }
            r
        })
        .collect()
}

/// `--tenant T`: the list of a tenant's objects.
/// Where a chain's traffic is re-encapsulated to, and whether to wait for it.
#[derive(Args, Debug)]
pub struct ChainEnds {
    /// Where the forward direction leaves: `IP:VNI[@MAC]` of the egress VXLAN endpoint.
    #[arg(long)]
    egress: Option<String>,
    /// Where replies go back to: `IP:VNI[@MAC]` of the tenant's VXLAN endpoint.
    #[arg(long = "return")]
    ret: Option<String>,
    /// Wait until the chain's SC group serves it.
    #[arg(long)]
    wait: bool,
}

impl ChainEnds {
    /// The chain spec's `forward` and `reverse`.
    fn spec(&self) -> Result<(Value, Value)> {
        Ok((
            egress(self.egress.as_deref())?,
            egress(self.ret.as_deref())?,
        ))
    }
}

#[derive(Args, Debug)]
pub struct OfTenant {
    #[arg(long)]
    tenant: String,
}

/// `NAME --tenant T`: one object of a tenant's.
#[derive(Args, Debug)]
pub struct Named {
    name: String,
    #[arg(long)]
    tenant: String,
}

#[derive(Subcommand, Debug)]
pub enum VpcCmd {
    Create {
        name: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        vni: u32,
        #[arg(long = "cidr")]
        cidrs: Vec<String>,
    },
    List(OfTenant),
    Delete(Named),
}

#[derive(Subcommand, Debug)]
pub enum NfKindCmd {
    /// Source NAT from a pool of public addresses.
    Snat {
        name: String,
        #[arg(long)]
        tenant: String,
        /// Pool addresses, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        pool: Vec<String>,
        #[arg(long, default_value = "1024-65535")]
        ports: String,
        /// Internal sources translated (prefixes); default: all.
        #[arg(long = "source")]
        sources: Vec<String>,
    },
    /// L4 load balancer (Maglev).
    Lb {
        name: String,
        #[arg(long)]
        tenant: String,
        /// `IP:PORT[/tcp|udp]`
        #[arg(long)]
        vip: String,
        /// `IP:PORT`, repeatable.
        #[arg(long = "backend", required = true)]
        backends: Vec<String>,
    },
    /// Stateful firewall with the tenant's ACL.
    Fw {
        name: String,
        #[arg(long)]
        tenant: String,
        /// `allow` or `deny` when no rule matches.
        #[arg(long, default_value = "deny")]
        default: String,
        /// `PROTO:DPORT` (e.g. `tcp:80`), repeatable.
        #[arg(long)]
        allow: Vec<String>,
        #[arg(long)]
        deny: Vec<String>,
    },
    /// Per-host traffic monitor.
    Monitor {
        name: String,
        #[arg(long)]
        tenant: String,
    },
    /// Any kind, from a JSON configuration file.
    FromFile {
        name: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        kind: String,
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
pub enum NfCmd {
    #[command(subcommand)]
    Create(NfKindCmd),
    List(OfTenant),
    Delete(Named),
}

#[derive(Subcommand, Debug)]
pub enum ChainCmd {
    Create {
        name: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        vpc: String,
        /// NF names in order, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        nfs: Vec<String>,
        #[command(flatten)]
        ends: ChainEnds,
    },
    List(OfTenant),
    Delete(Named),
}

/// `bw=1,cpu=0.5,mem=1` as the API's demand object; the API checks the values.
fn demand_json(s: &str) -> Result<Value> {
    let mut d = json!({"bw_gbps": 1.0, "cpu": 0.5, "mem_gib": 1.0});
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            bail!("--demand: {part:?} is not KEY=VALUE (bw, cpu, mem)");
        };
        let x: f64 = v
            .parse()
            .map_err(|_| anyhow::anyhow!("--demand: {k}: {v:?} is not a number"))?;
        let key = match k {
            "bw" => "bw_gbps",
            "cpu" => "cpu",
            "mem" => "mem_gib",
            _ => bail!("--demand: unknown key {k:?} (bw, cpu, mem)"),
        };
        d[key] = json!(x);
    }
    Ok(d)
}

fn ports(s: &str) -> Result<Value> {
    let (lo, hi) = s
        .split_once('-')
        .ok_or_else(|| anyhow!("--ports must be LO-HI, got {s:?}"))?;
    Ok(
        json!({"lo": lo.parse::<u16>().context("--ports")?, "hi": hi.parse::<u16>().context("--ports")?}),
    )
}

/// `IP:VNI[@MAC]`: the VXLAN endpoint a direction is re-encapsulated to, and the
/// inner destination MAC its receiver expects (a Linux VXLAN device drops frames not
/// addressed to it).
fn egress(s: Option<&str>) -> Result<Value> {
    match s {
        None => Ok(json!({"decap": true})),
        Some(s) => {
            let (endpoint, mac) = match s.split_once('@') {
                Some((e, m)) => (e, Some(m)),
                None => (s, None),
            };
            let (ip, vni) = endpoint
                .rsplit_once(':')
                .ok_or_else(|| anyhow!("expected IP:VNI[@MAC], got {s:?}"))?;
            let mut v = json!({"decap": true,
                               "encap": {"dst": ip, "vni": vni.parse::<u32>().context("VNI")?}});
            if let Some(m) = mac {
                v["inner_dmac"] = json!(m);
            }
            Ok(v)
        }
    }
}

fn snat_config(pool: &[String], port_range: &str, sources: &[String]) -> Result<Value> {
    Ok(json!({"kind": "snat", "config": {"pools": [{
        "addresses": pool, "ports": ports(port_range)?, "sources": sources}]}}))
}

fn wait_served(c: &Client, tenant: &str, chain: &str) -> Result<()> {
    wait_for(
        &format!("waiting for the SC group of {tenant}/{chain}"),
        Duration::from_secs(30),
        || {
            let v = c.call("GET", "/v1/partitions", None)?;
            Ok(v.as_array()
                .is_some_and(|a| {
                    a.iter().any(|p| {
                        p["tenant"] == tenant
                            && p["chain"] == chain
                            && p["replicas"].as_array().is_some_and(|r| !r.is_empty())
                    })
                })
                .then_some(()))
        },
    )?;
    if c.output == Output::Table {
        println!("chain {tenant}/{chain} is served");
    }
    Ok(())
}

const TENANT_COLS: &[(&str, &str)] = &[
    ("NAME", "/name"),
    ("ID", "/id"),
    ("PP CLUSTER", "/pp_cluster"),
    ("REVISION", "/revision"),
];

/// All pages of a list.
fn all_pages(c: &Client, path: &str) -> Result<Value> {
    Ok(c.api.all_pages(path)?)
}

/// `PUT /v1/tenants/{tenant}/{kind}s/{name}`, reported as `{kind}/{tenant}/{name}`.
fn put_owned(c: &Client, kind: &str, tenant: &str, name: &str, body: Value) -> Result<Value> {
    c.put(
        &format!("/v1/tenants/{tenant}/{kind}s/{name}"),
        body,
        &format!("{kind}/{tenant}/{name}"),
    )
}

/// What a create returned, in JSON or YAML output (a table says nothing more).
fn print_created(c: &Client, v: &Value) -> Result<()> {
    if c.output != Output::Table {
        c.print(v, &[], &[])?;
    }
    Ok(())
}

/// A tenant's `{kind}s`, every page, in these columns.
fn list_owned(c: &Client, kind: &str, tenant: &str, cols: &[(&str, &str)]) -> Result<()> {
    let v = all_pages(c, &format!("/v1/tenants/{tenant}/{kind}s"))?;
    c.print(&v, v.as_array().unwrap_or(&vec![]), cols)
}

/// Deletes a tenant's `{kind}` and says so.
fn delete_owned(c: &Client, kind: &str, Named { name, tenant }: Named) -> Result<()> {
    c.call(
        "DELETE",
        &format!("/v1/tenants/{tenant}/{kind}s/{name}"),
        None,
    )?;
    println!("{kind}/{tenant}/{name} deleted");
    Ok(())
}

pub fn tenant(c: &Client, cmd: TenantCmd) -> Result<()> {
    match cmd {
        TenantCmd::Create {
            name,
            pp_cluster,
            demand,
            vni,
            snat,
            ports: pr,
            ends,
        } => {
            let mut spec = json!({});
            if let Some(pc) = pp_cluster {
                spec["pp_cluster"] = json!(pc);
            }
            if let Some(d) = demand {
                spec["demand"] = demand_json(&d)?;
            }
            if !snat.is_empty() && vni.is_none() {
                bail!("--snat needs --vni (the VPC it translates)");
            }
            // One POST /v1/apply: the tenant, its VPC, SNAT and chain are written in one
            // store transaction, so a refused VPC or NF leaves no tenant behind.
            let mut items = vec![json!({"kind": "tenant", "name": name, "spec": spec})];
            if let Some(vni) = vni {
                items.push(
                    json!({"kind": "vpc", "tenant": name, "name": "main", "spec": {"vni": vni}}),
                );
            }
            if !snat.is_empty() {
                items.push(json!({"kind": "nf", "tenant": name, "name": "snat",
                                  "spec": snat_config(&snat, &pr, &[])?}));
                let (fwd, rev) = ends.spec()?;
                items.push(json!({"kind": "chain", "tenant": name, "name": "main",
                                  "spec": {"vpc": "main", "nfs": ["snat"],
                                           "forward": fwd, "reverse": rev}}));
            }
            let r = c.call("POST", "/v1/apply", Some(json!({ "items": items })))?;
            if c.output == Output::Table {
                for i in r["items"].as_array().into_iter().flatten() {
                    println!(
                        "{} {}",
                        i["object"].as_str().unwrap_or("?"),
                        i["result"].as_str().unwrap_or("?")
                    );
                }
            }
            if ends.wait && !snat.is_empty() {
                wait_served(c, &name, "main")?;
            }
            let t = c.call("GET", &format!("/v1/tenants/{name}"), None)?;
            print_created(c, &t)
        }
        TenantCmd::List => {
            let v = all_pages(c, "/v1/tenants")?;
            c.print(&v, v.as_array().unwrap_or(&vec![]), TENANT_COLS)
        }
        TenantCmd::Get { name } => {
            let v = c.call("GET", &format!("/v1/tenants/{name}"), None)?;
            c.print(&v, std::slice::from_ref(&v), TENANT_COLS)
        }
        TenantCmd::Delete { name, cascade } => {
            let q = if cascade { "?cascade=true" } else { "" };
            c.call("DELETE", &format!("/v1/tenants/{name}{q}"), None)?;
            println!("tenant/{name} deleted");
            Ok(())
        }
        TenantCmd::Rates {
            name,
            requests,
            packets,
            clear,
        } => {
            let path = format!("/v1/tenants/{name}/rates");
            if clear {
                c.call("DELETE", &path, None)?;
                println!("tenant/{name} rates cleared");
                return Ok(());
            }
            let v = if requests.is_some() || packets.is_some() {
                let mut body = serde_json::Map::new();
                if let Some(r) = &requests {
                    body.insert("requests".into(), rate_spec(r)?);
                }
                if let Some(p) = &packets {
                    body.insert("packets".into(), rate_spec(p)?);
                }
                c.call("PUT", &path, Some(Value::Object(body)))?
            } else {
                c.call("GET", &path, None)?
            };
            if c.output == Output::Table {
                for kind in ["requests", "packets"] {
                    let r = &v["rates"][kind];
                    if r.is_object() {
                        println!(
                            "{kind}: min {} base {} burst {} debt {} per second",
                            r["min"], r["base"], r["burst"], r["debt"]
                        );
                    } else {
                        println!("{kind}: not rate-managed");
                    }
                }
            }
            let rows = rate_rows(&name, v["status"].as_array().unwrap_or(&vec![]));
            c.print(&v, &rows, RATE_COLS)
        }
    }
}

pub fn vpc(c: &Client, cmd: VpcCmd) -> Result<()> {
    match cmd {
        VpcCmd::Create {
            name,
            tenant,
            vni,
            cidrs,
        } => {
            let v = put_owned(
                c,
                "vpc",
                &tenant,
                &name,
                json!({"vni": vni, "cidrs": cidrs}),
            )?;
            print_created(c, &v)
        }
        VpcCmd::List(OfTenant { tenant }) => list_owned(
            c,
            "vpc",
            &tenant,
            &[("NAME", "/name"), ("VNI", "/vni"), ("CIDRS", "/cidrs")],
        ),
        VpcCmd::Delete(n) => delete_owned(c, "vpc", n),
    }
}

fn port_rule(action: &str, s: &str) -> Result<Value> {
    let (proto, port) = s
        .split_once(':')
        .ok_or_else(|| anyhow!("expected PROTO:DPORT (e.g. tcp:80), got {s:?}"))?;
    Ok(
        json!({"action": action, "proto": proto, "dport": port.parse::<u16>().with_context(|| format!("port in {s:?}"))?}),
    )
}

pub fn nf(c: &Client, cmd: NfCmd) -> Result<()> {
    let (tenant, name, body) = match cmd {
        NfCmd::List(OfTenant { tenant }) => {
            return list_owned(
                c,
                "nf",
                &tenant,
                &[
                    ("NAME", "/name"),
                    ("KIND", "/kind"),
                    ("REVISION", "/revision"),
                ],
            );
        }
        NfCmd::Delete(n) => return delete_owned(c, "nf", n),
        NfCmd::Create(k) => match k {
            NfKindCmd::Snat {
                name,
                tenant,
                pool,
                ports: pr,
                sources,
            } => (tenant, name, snat_config(&pool, &pr, &sources)?),
            NfKindCmd::Lb {
                name,
                tenant,
                vip,
                backends,
            } => {
                let (addr_port, proto) = vip.split_once('/').unwrap_or((&vip, "tcp"));
                let (ip, port) = addr_port
                    .rsplit_once(':')
                    .ok_or_else(|| anyhow!("--vip must be IP:PORT[/tcp|udp], got {vip:?}"))?;
                let backends = backends
                    .iter()
                    .map(|b| {
                        let (ip, port) = b
                            .rsplit_once(':')
                            .ok_or_else(|| anyhow!("--backend must be IP:PORT, got {b:?}"))?;
                        Ok(json!({"addr": ip, "port": port.parse::<u16>().context("backend port")?}))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (
                    tenant,
                    name,
                    json!({"kind": "lb", "config": {"services": [{
                    "vip": ip, "port": port.parse::<u16>().context("VIP port")?, "protocol": proto, "backends": backends}]}}),
                )
            }
            NfKindCmd::Fw {
                name,
                tenant,
                default,
                allow,
                deny,
            } => {
                let rules = deny
                    .iter()
                    .map(|r| port_rule("deny", r))
                    .chain(allow.iter().map(|r| port_rule("allow", r)))
                    .collect::<Result<Vec<_>>>()?;
                (
                    tenant,
                    name,
                    json!({"kind": "fw", "config": {"default_action": default, "rules": rules}}),
                )
            }
            NfKindCmd::Monitor { name, tenant } => (tenant, name, json!({"kind": "monitor"})),
            NfKindCmd::FromFile {
                name,
                tenant,
                kind,
                config,
            } => {
                let text = std::fs::read_to_string(&config)
                    .with_context(|| format!("reading {}", config.display()))?;
                let cfg: Value = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not JSON", config.display()))?;
                (tenant, name, json!({"kind": kind, "config": cfg}))
            }
        },
    };
    let v = put_owned(c, "nf", &tenant, &name, body)?;
    print_created(c, &v)
}

pub fn chain(c: &Client, cmd: ChainCmd) -> Result<()> {
    match cmd {
        ChainCmd::Create {
            name,
            tenant,
            vpc,
            nfs,
            ends,
        } => {
            let (fwd, rev) = ends.spec()?;
            let v = put_owned(
                c,
                "chain",
                &tenant,
                &name,
                json!({"vpc": vpc, "nfs": nfs, "forward": fwd, "reverse": rev}),
            )?;
            if ends.wait {
                wait_served(c, &tenant, &name)?;
            }
            print_created(c, &v)
        }
        ChainCmd::List(OfTenant { tenant }) => list_owned(
            c,
            "chain",
            &tenant,
            &[
                ("NAME", "/name"),
                ("ID", "/id"),
                ("VPC", "/vpc"),
                ("NFS", "/nfs"),
            ],
        ),
        ChainCmd::Delete(n) => delete_owned(c, "chain", n),
    }
}

pub fn token_create(c: &Client, tenant: &str) -> Result<()> {
    let v = c.call("POST", &format!("/v1/tenants/{tenant}/tokens"), None)?;
    c.print(
        &v,
        std::slice::from_ref(&v),
        &[("ID", "/id"), ("TENANT", "/tenant"), ("TOKEN", "/token")],
    )
}

pub fn status(c: &Client, wait: bool) -> Result<()> {
    let v = if wait {
        wait_for(
            "waiting for every node to be up and ready",
            Duration::from_secs(60),
            || {
                let v = c.call("GET", "/v1/status", None)?;
                Ok((v["healthy"] == true).then_some(v))
            },
        )?
    } else {
        c.call("GET", "/v1/status", None)?
    };
    if c.output == Output::Table {
        println!(
            "orchestrator {}  store {} (revision {})  tenants {}  chains {}  nodes {} up, {} down  {}",
            cell(&v["orchestrator"]),
            cell(&v["store"]),
            cell(&v["store_revision"]),
            cell(&v["tenants"]),
            cell(&v["chains"]),
            cell(&v["nodes_up"]),
            cell(&v["nodes_down"]),
            if v["healthy"] == true { "HEALTHY" } else { "NOT HEALTHY" }
        );
        println!();
    }
    let nodes = v["nodes"].as_array().cloned().unwrap_or_default();
    c.print(
        &v,
        &nodes,
        &[
            ("NODE", "/id"),
            ("ROLE", "/role"),
            ("STATUS", "/status"),
            ("READY", "/ready"),
            ("ADDR", "/addr"),
            ("CLUSTER", "/cluster"),
            ("LAST REPORT MS", "/last_report_ms"),
            ("METRICS", "/metrics_url"),
            ("DETAIL", "/detail"),
        ],
    )
}

pub fn flows(c: &Client, tenant: &str, limit: u32) -> Result<()> {
    let v = c.call(
        "GET",
        &format!("/v1/tenants/{tenant}/flows?limit={limit}"),
        None,
    )?;
    let rows = v["items"].as_array().cloned().unwrap_or_default();
    c.print(
        &v,
        &rows,
        &[
            ("CHAIN", "/chain"),
            ("FLOW", "/key"),
            ("ACTIONS", "/actions"),
            ("EXPIRES MS", "/expires_in_ms"),
        ],
    )?;
    if c.output == Output::Table {
        if let Some(n) = v["next"].as_str() {
            println!("({n}; raise --limit)");
        }
    }
    Ok(())
}

/// `--watch`: after `n` rounds, wait for the next one (true), or end (false) when not
/// watching or `--count` rounds are done.
fn watch_again(watch: Option<f64>, count: Option<u64>, n: u64, output: Output) -> bool {
    match watch {
        Some(s) if count.is_none_or(|c| n < c) => {
            std::thread::sleep(Duration::from_secs_f64(s.max(0.1)));
            if output == Output::Table {
                println!();
            }
            true
        }
        _ => false,
    }
}

pub fn stats(
    c: &Client,
    tenant: Option<&str>,
    watch: Option<f64>,
    count: Option<u64>,
) -> Result<()> {
    let cols: &[(&str, &str)] = &[
        ("TENANT", "/tenant"),
        ("PACKETS", "/packets"),
        ("BYTES", "/bytes"),
        ("DROPS", "/drops"),
        ("FLOWS", "/flows_set_up"),
        ("RULE REQUESTS", "/rule_requests"),
        ("SC APPLIED", "/requests_applied"),
    ];
    let mut n = 0u64;
    loop {
        let v = match tenant {
            Some(t) => Value::Array(vec![c.call(
                "GET",
                &format!("/v1/tenants/{t}/stats"),
                None,
            )?]),
            None => c.call("GET", "/v1/stats", None)?,
        };
        c.print(&v, v.as_array().unwrap_or(&vec![]), cols)?;
        if c.output == Output::Table {
            // Rate-managed tenants: each PP node's credit state (paper 000 §7.2).
            let rows: Vec<Value> = v
                .as_array()
                .unwrap_or(&vec![])
                .iter()
                .flat_map(|t| {
                    rate_rows(
                        t["tenant"].as_str().unwrap_or("?"),
                        t["rates"].as_array().unwrap_or(&vec![]),
                    )
                })
                .collect();
            if !rows.is_empty() {
                println!();
                print_table(&rows, RATE_COLS);
            }
        }
        n += 1;
        if !watch_again(watch, count, n, c.output) {
            return Ok(());
        }
    }
}

/// `starfabric stats --tenant T --monitor`: what the tenant's monitor NFs counted (every
/// packet and byte PP's counted rules matched, and the flows SC decided), in total and
/// for the top hosts by bytes.
pub fn monitor_stats(
    c: &Client,
    tenant: &str,
    top: u32,
    watch: Option<f64>,
    count: Option<u64>,
) -> Result<()> {
    if !(1..=1000).contains(&top) {
        bail!("--top must be 1..=1000, got {top}");
    }
    let mut n = 0u64;
    loop {
        let v = c.call(
            "GET",
            &format!("/v1/tenants/{tenant}/monitor?top={top}"),
            None,
        )?;
        match c.output {
            Output::Table => {
                let mut total = v["total"].clone();
                total["tenant"] = v["tenant"].clone();
                total["hosts"] = v["hosts_total"].clone();
                total["groups"] = json!(format!("{}/{}", v["groups_read"], v["groups"]));
                print_table(
                    &[total],
                    &[
                        ("TENANT", "/tenant"),
                        ("PACKETS", "/packets"),
                        ("BYTES", "/bytes"),
                        ("FLOWS", "/flows"),
                        ("HOSTS", "/hosts"),
                        ("SC GROUPS READ", "/groups"),
                    ],
                );
                let hosts = v["hosts"].as_array().cloned().unwrap_or_default();
                if !hosts.is_empty() {
                    println!();
                    print_table(
                        &hosts,
                        &[
                            ("HOST", "/host"),
                            ("PACKETS", "/packets"),
                            ("BYTES", "/bytes"),
                            ("FLOWS", "/flows"),
                        ],
                    );
                }
                for e in v["errors"].as_array().into_iter().flatten() {
                    eprintln!("warning: {}", e.as_str().unwrap_or("?"));
                }
            }
            _ => c.print(&v, &[], &[])?,
        }
        n += 1;
        if !watch_again(watch, count, n, c.output) {
            return Ok(());
        }
    }
}
