//! `starfabric scale sc-out|sc-in|map`: drive SC scaling (paper 000 Fig. 3) against a
//! running FM over its gRPC API (`FabricMaster.ScaleOut/ScaleIn/GetPartitionMap`).
//!
//! It talks to FM directly, not through the orchestrator: scaling is FM's own
//! operation (docs/scaling.md), and the netns testbed runs FM without an orchestrator.
//! `-o json` prints one JSON object, which the elasticity tests and `bench scaling`
//! parse (`testbed::elastic::ScaleResult`, `PartitionMap`).

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand};
use orchestrator::fm_link::{FmClient, FmTlsArgs};
use proto::v1;
use serde_json::{json, Value};

use crate::cli::{print_table, Output};

#[derive(Subcommand)]
pub enum ScaleCmd {
    /// Split a chain's partition (the busiest, or --group's) onto 3 spare SC nodes.
    ScOut(ScaleArgs),
    /// Merge a chain's partition (the newest, or --group's) into its neighbour.
    ScIn(ScaleArgs),
    /// FM's partition map: which SC group serves which key-hash range, and its replicas.
    Map(FmAddr),
    /// The PP cluster's vIP table (Multi-IP, docs/pp-cluster.md): which PP node owns
    /// which vIP.
    Vips(FmAddr),
    /// PP scale-in, first step: move every vIP of `--node` to the other PP nodes. Stop
    /// the node once its traffic has drained.
    PpDrain(PpDrainArgs),
    /// Move vIPs to PP node `--to` (live migration, docs/pp-cluster.md): the vIPs
    /// named by `--vip`, or every vIP PP node `--from` owns. One FM session for all of
    /// them, so a node's whole share moves in one go.
    VipMove(VipMoveArgs),
}

#[derive(Args, Debug, Clone)]
pub struct VipMoveArgs {
    #[command(flatten)]
    pub fm: FmAddr,
    /// The PP node that takes the vIPs (`--id` of `starfabric pp`).
    #[arg(long)]
    pub to: String,
    /// A vIP's index in the cluster's vIP group (repeatable, or comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "from",
        conflicts_with = "from"
    )]
    pub vip: Vec<u32>,
    /// Move every vIP this PP node owns.
    #[arg(long)]
    pub from: Option<String>,
    /// Why, for FM's event log.
    #[arg(long, default_value = "")]
    pub reason: String,
}

#[derive(Args, Debug, Clone)]
pub struct PpDrainArgs {
    #[command(flatten)]
    pub fm: FmAddr,
    /// The PP node's id (`--id` of `starfabric pp`).
    #[arg(long)]
    pub node: String,
}

#[derive(Args, Debug, Clone)]
pub struct FmAddr {
    /// FM's gRPC address (`host:port`).
    #[arg(long, env = "STARFABRIC_FM", default_value = "127.0.0.1:7000")]
    pub fm: String,
    /// Give up after this many seconds (a scale answers when it finished or aborted).
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
    #[command(flatten)]
    pub tls: FmTlsArgs,
}

#[derive(Args, Debug, Clone)]
pub struct ScaleArgs {
    #[command(flatten)]
    pub fm: FmAddr,
    /// Tenant id (FM's numeric id).
    #[arg(long)]
    pub tenant: u32,
    /// Chain id within the tenant.
    #[arg(long)]
    pub chain: u32,
    /// The SC group to split (sc-out) or retire (sc-in).
    #[arg(long)]
    pub group: Option<u64>,
    /// sc-out: how the flows' state moves, `bulk` or `gradual` (docs/scaling.md);
    /// default: FM's.
    #[arg(long, value_parser = ["bulk", "gradual"])]
    pub migration: Option<String>,
}

pub fn run(c: ScaleCmd, output: Output) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match c {
        ScaleCmd::ScOut(a) => scale(&rt, a, true, output),
        ScaleCmd::ScIn(a) => scale(&rt, a, false, output),
        ScaleCmd::Map(a) => map(&rt, a, output),
        ScaleCmd::Vips(a) => {
            let r = call(&rt, &a, async {
                let mut c = connect(&a).await?;
                c.vip_map(v1::VipMapRequest {})
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| anyhow!("vIP map: {:?}: {}", s.code(), s.message()))
            })?;
            print_vips(&r, output)
        }
        ScaleCmd::PpDrain(a) => {
            let node = a.node.clone();
            let r = call(&rt, &a.fm, async {
                let mut c = connect(&a.fm).await?;
                c.pp_drain(v1::PpDrainRequest { node })
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| anyhow!("FM refused the drain: {:?}: {}", s.code(), s.message()))
            })?;
            print_vips(&r, output)
        }
        ScaleCmd::VipMove(a) => {
            let r = call(&rt, &a.fm, vip_move(&a))?;
            print_vips(&r, output)
        }
    }
}

/// Move `a`'s vIPs one RPC each over one session; the last answer is FM's table after
/// all of them. A refused move stops there, with FM's reason (the moves before it stay).
async fn vip_move(a: &VipMoveArgs) -> Result<v1::VipMapReply> {
    let mut c = connect(&a.fm).await?;
    let vips: Vec<u32> = match &a.from {
        Some(from) => {
            let m = c
                .vip_map(v1::VipMapRequest {})
                .await
                .map_err(|s| anyhow!("vIP map: {:?}: {}", s.code(), s.message()))?
                .into_inner();
            if !m.nodes.contains(from) {
                bail!(
                    "{from} is not a PP node of FM's vIP table (nodes: {:?})",
                    m.nodes
                );
            }
            m.vips
                .iter()
                .filter(|o| &o.node == from)
                .filter_map(|o| o.vip.as_ref().map(|v| v.index))
                .collect()
        }
        None => a.vip.clone(),
    };
    if vips.is_empty() {
        bail!("no vIP to move");
    }
    let mut last = None;
    for vip in vips {
        let reason = if a.reason.is_empty() {
            format!("operator: vIP {vip} moved to {}", a.to)
        } else {
            a.reason.clone()
        };
        let r = c
            .vip_move(v1::VipMoveRequest {
                vip,
                to: a.to.clone(),
                reason,
            })
            .await
            .map_err(|s| {
                anyhow!(
                    "FM refused to move vIP {vip} to {}: {:?}: {}",
                    a.to,
                    s.code(),
                    s.message()
                )
            })?;
        last = Some(r.into_inner());
    }
    last.ok_or_else(|| anyhow!("no vIP moved"))
}

fn call<T>(
    rt: &tokio::runtime::Runtime,
    a: &FmAddr,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    rt.block_on(async { tokio::time::timeout(Duration::from_secs_f64(a.timeout), f).await })
        .map_err(|_| anyhow!("FM did not answer within {} s", a.timeout))?
}

fn print_vips(r: &v1::VipMapReply, output: Output) -> Result<()> {
    let v = proto::json::vip_map(r);
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&v)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&v)?),
        Output::Table => {
            println!(
                "vIP table epoch {}, {} moves; nodes: {}{}",
                r.epoch,
                r.moves,
                r.nodes.join(" "),
                if r.draining.is_empty() {
                    String::new()
                } else {
                    format!(" (draining: {})", r.draining.join(" "))
                }
            );
            let rows = v["vips"].as_array().cloned().unwrap_or_default();
            print_table(
                &rows,
                &[
                    ("VIP", "/index"),
                    ("IP", "/ip"),
                    ("VMAC", "/mac"),
                    ("OWNER", "/node"),
                ],
            );
        }
    }
    Ok(())
}

async fn connect(a: &FmAddr) -> Result<FmClient> {
    let tls = a.tls.load().map_err(anyhow::Error::msg)?;
    orchestrator::fm_link::connect(&a.fm, tls.as_ref())
        .await
        .map_err(anyhow::Error::msg)
}

fn scale(rt: &tokio::runtime::Runtime, a: ScaleArgs, out: bool, output: Output) -> Result<()> {
    let verb = if out { "scale-out" } else { "scale-in" };
    tracing::info!(fm = %a.fm.fm, tenant = a.tenant, chain = a.chain, group = ?a.group, verb, "asking FM");
    let call = async {
        let mut c = connect(&a.fm).await?;
        let r = if out {
            c.scale_out(v1::ScaleOutRequest {
                tenant: a.tenant,
                chain: a.chain,
                group: a.group,
                migration: a.migration.clone().unwrap_or_default(),
            })
            .await
        } else {
            c.scale_in(v1::ScaleInRequest {
                tenant: a.tenant,
                chain: a.chain,
                group: a.group,
            })
            .await
        };
        // FAILED_PRECONDITION carries FM's reason for not starting (no spare nodes, no
        // neighbour to merge into): that is the message an operator needs.
        r.map(|r| r.into_inner())
            .map_err(|s| anyhow!("FM refused the {verb}: {:?}: {}", s.code(), s.message()))
    };
    let reply = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs_f64(a.fm.timeout), call).await })
        .map_err(|_| anyhow!("{verb}: FM did not answer within {} s", a.fm.timeout))??;
    let v = proto::json::scale_reply(&reply);
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&v)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&v)?),
        Output::Table => print_table(
            std::slice::from_ref(&v),
            &[
                ("SCALE", "/scale_id"),
                ("KIND", "/kind"),
                ("FROM GROUP", "/from_group"),
                ("TO GROUP", "/to_group"),
                ("MOVED RANGE", "/moved_range"),
                ("ST->FIN (us)", "/st_to_fin_us"),
                ("ABORTED", "/aborted"),
            ],
        ),
    }
    if !reply.aborted.is_empty() {
        bail!("{verb} aborted: {}", reply.aborted);
    }
    Ok(())
}

fn map(rt: &tokio::runtime::Runtime, a: FmAddr, output: Output) -> Result<()> {
    let m = rt
        .block_on(async {
            tokio::time::timeout(Duration::from_secs_f64(a.timeout), async {
                let mut c = connect(&a).await?;
                c.get_partition_map(v1::PartitionMapRequest {})
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| anyhow!("partition map: {:?}: {}", s.code(), s.message()))
            })
            .await
        })
        .map_err(|_| anyhow!("FM did not answer within {} s", a.timeout))??;
    let v = proto::json::partition_map(&m);
    match output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&v)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&v)?),
        Output::Table => {
            let rows: Vec<Value> = m
                .partitions
                .iter()
                .map(|p| {
                    let replicas = m
                        .groups
                        .iter()
                        .find(|g| g.id == p.group)
                        .map(|g| {
                            g.replicas
                                .iter()
                                .map(|r| r.node_id.clone())
                                .collect::<Vec<_>>()
                                .join(" → ")
                        })
                        .unwrap_or_default();
                    json!({
                        "tenant": p.tenant, "chain": p.chain, "group": p.group,
                        "range": format!("{:#018x}..={:#018x}", p.hash_lo, p.hash_hi),
                        "replicas": replicas,
                    })
                })
                .collect();
            println!("partition map version {}", m.version);
            print_table(
                &rows,
                &[
                    ("TENANT", "/tenant"),
                    ("CHAIN", "/chain"),
                    ("GROUP", "/group"),
                    ("KEY-HASH RANGE", "/range"),
                    ("REPLICAS (head → tail)", "/replicas"),
                ],
            );
        }
    }
    Ok(())
}
