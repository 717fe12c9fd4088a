//! Heap allocations per decision of the built-in chain (FW → SNAT → LB), the work every
//! SC replica repeats for each new flow. Issue 16 asks for no allocation per op; this
//! counts what one decision costs today and holds the line against new ones.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use nf::{Chain, ChainSpec, Egress, FirstPacket, NfEnv};
use pipeline::{FlowKey, PacketMeta};

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting allocations and reallocations made by this thread.
struct Counting;

// SAFETY: every call is passed unchanged to `System`, which upholds `GlobalAlloc`'s
// contract; the count is a thread-local `Cell` with a const initialiser, so counting
// never allocates or re-enters the allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's `layout` obligations carry over unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|c| c.set(c.get() + 1));
        // SAFETY: as for `dealloc`; `new_size` is the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

/// The chain `starfabric bench setup --nfs builtin` runs, with its VXLAN egress.
fn builtin_chain() -> Chain {
    let addrs: Vec<String> = (1..=8).map(|i| format!("198.19.255.{i}")).collect();
    let cfgs = [
        serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow",
            "rules": [{"action": "deny", "proto": "tcp", "dport": 23}]}]}),
        serde_json::json!({"kind": "snat", "pools": [{"addresses": addrs,
            "ports": {"lo": 1024, "hi": 65535}}]}),
        serde_json::json!({"kind": "lb", "services": [{"vip": "198.19.200.9", "port": 53,
            "protocol": "udp", "backends": [{"addr": "198.19.1.7", "port": 5353}]}]}),
    ];
    let nfs = (cfgs.iter())
        .map(|c| nfs::build(&serde_json::from_value(c.clone()).expect("config")).expect("nf"))
        .collect();
    let encap = |dst: [u8; 4], vni| Egress {
        decap: true,
        encap: Some((dst.into(), vni)),
        output: 1,
        ..Egress::LOCAL
    };
    Chain::new(
        nfs,
        ChainSpec::seq(3),
        encap([198, 18, 0, 9], 200),
        encap([198, 18, 0, 50], 100),
    )
    .expect("chain")
}

fn key(i: u32) -> FlowKey {
    let (a, b, p) = ((i >> 14) & 255, (i >> 6) & 255, 1024 + (i & 63) * 900);
    format!("100 udp 198.18.{a}.{b}:{p} > 198.19.200.9:53")
        .parse()
        .expect("flow key")
}

#[test]
fn a_new_flows_decision_allocates_nothing_but_table_growth() {
    let keys: Vec<FlowKey> = (0..60_000).map(key).collect();
    let mut chain = builtin_chain();
    // As SC applies them: ops of 64 requests, each op one group-clock time.
    let decide = |chain: &mut Chain, i: usize| {
        let p = FirstPacket::new(keys[i], 1, PacketMeta::new(60, 0));
        let now = (i / 64) as u64;
        let r = chain.decide(&p, &mut NfEnv::new(now, now ^ i as u64));
        assert!(r.is_ok_and(|r| r.reverse.is_some()), "flow {i} passes");
    };
    // Past the tables' early growth, then counted.
    for i in 0..50_000 {
        decide(&mut chain, i);
    }
    let before = allocs();
    for i in 50_000..60_000 {
        decide(&mut chain, i);
    }
    let per = (allocs() - before) as f64 / 10_000.0;
    eprintln!("allocations per decision: {per:.2}");
    // What is left is the tables' amortised growth. The new mapping's row key is kept
    // inline since 2026-11-30 (3.27 to 2.25), and the two rules' action lists since
    // 2026-12-01 (`pipeline::Actions`: 2.25 to 0.25).
    assert!(per <= 0.5, "{per:.2} allocations per decision");
}
