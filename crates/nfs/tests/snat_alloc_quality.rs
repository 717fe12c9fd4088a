//! Allocator quality, in the spirit of Cilium's `nat4_port_allocation` check: fill a port
//! range from many random clients and bound the probes per allocation and the failure
//! rate as the pool fills. Run with `--nocapture` to see the numbers.

mod snat_util;

use std::collections::HashSet;

use nf::DetRng;
use nfs::snat::{SnatPool, SnatStats, PROBES};
use packet::proto;
use snat_util::*;

const LO: u16 = 20_000;
const HI: u16 = 20_999;
const SIZE: usize = (HI - LO) as usize + 1;

/// A new flow from a random client and source port never seen before.
fn random_flow(rng: &mut DetRng, used: &mut HashSet<(u64, u64)>) -> String {
    loop {
        let client = rng.below(65_534) + 1;
        let sport = 1024 + rng.below(64_512);
        if used.insert((client, sport)) {
            return format!(
                "100 udp 198.18.{}.{}:{} > 198.19.0.{}:443",
                client >> 8,
                client & 0xff,
                sport,
                1 + rng.below(250)
            );
        }
    }
}

fn allocations(s: &SnatStats) -> u64 {
    s.probe_histogram.iter().sum()
}

struct Window {
    label: &'static str,
    allocs: u64,
    probes: u64,
    scans: u64,
    hist: [u64; PROBES + 1],
}

fn window(label: &'static str, from: &SnatStats, to: &SnatStats) -> Window {
    let mut hist = [0; PROBES + 1];
    for (i, h) in hist.iter_mut().enumerate() {
        *h = to.probe_histogram[i] - from.probe_histogram[i];
    }
    Window {
        label,
        allocs: allocations(to) - allocations(from),
        probes: to.random_probes - from.random_probes,
        scans: hist[PROBES],
        hist,
    }
}

#[test]
fn nat4_port_allocation_quality() {
    let mut n = nat(LO, HI);
    let mut rng = DetRng::new(0x5eed);
    let mut used = HashSet::new();
    let mut ports = HashSet::new();
    let mut marks = Vec::new();
    let mut failures_to_95 = 0;
    let checkpoints = [
        (SIZE / 2, "0-50%"),
        (SIZE * 3 / 4, "50-75%"),
        (SIZE * 95 / 100, "75-95%"),
        (SIZE, "95-100%"),
    ];
    let mut prev = n.stats();
    let mut spread_at_half = [0u32; 10];
    for i in 0..SIZE {
        let d = decide_at(&mut n, &pkt(&random_flow(&mut rng, &mut used)), 0, i as u64);
        if d.verdict != nf::Verdict::pass() {
            if i < SIZE * 95 / 100 {
                failures_to_95 += 1;
            }
            continue;
        }
        let (_, p) = ext(&d);
        assert!(ports.insert(p), "port {p} handed out twice");
        if i < SIZE / 2 {
            spread_at_half[usize::from(p - LO) * 10 / SIZE] += 1;
        }
        if let Some(&(_, label)) = checkpoints.iter().find(|(at, _)| *at == i + 1) {
            let now = n.stats();
            marks.push(window(label, &prev, &now));
            prev = now;
        }
    }
    // Full: the next one is refused, cleanly.
    let d = decide_at(&mut n, &pkt(&random_flow(&mut rng, &mut used)), 0, 99_999);
    assert_eq!(drop_reason(&d), nfs::snat::reason::EXHAUSTED);
    assert_eq!(n.free_port_count(ip(POOL_A), proto::UDP), 0);

    let s = n.stats();
    eprintln!(
        "{SIZE} ports: {} allocated ({} preserved), {} distinct, failures before 95%: {failures_to_95}",
        s.mappings_created,
        s.ports_preserved,
        ports.len()
    );
    for w in &marks {
        let mean = w.probes as f64 / w.allocs.max(1) as f64;
        eprintln!(
            "{:>8}: {:4} random allocations, {:.2} probes each, {} scans ({:.1}%), failed-probe histogram {:?}",
            w.label,
            w.allocs,
            mean,
            w.scans,
            100.0 * w.scans as f64 / w.allocs.max(1) as f64,
            &w.hist[..=PROBES]
        );
    }
    eprintln!("spread over tenths of the range after 50%: {spread_at_half:?}");

    assert_eq!(ports.len(), SIZE, "every port handed out exactly once");
    assert_eq!(
        failures_to_95, 0,
        "the allocator finds a free port whenever one exists"
    );
    assert_eq!(s.exhausted, 1);
    let [half, q3, p95, full] = &marks[..] else {
        panic!("checkpoints missing");
    };
    // Half full: about 2 probes on average, scans only rarely.
    assert!(half.probes as f64 / half.allocs as f64 <= 1.6, "0-50%");
    assert!(half.scans <= 1, "0-50%: {} scans", half.scans);
    // Up to 95 %: bounded work, the scan fallback under 5 % of allocations.
    let (allocs, probes, scans) = [half, q3, p95].iter().fold((0, 0, 0), |(a, p, sc), w| {
        (a + w.allocs, p + w.probes, sc + w.scans)
    });
    assert!(
        probes as f64 / allocs as f64 <= 3.5,
        "mean probes to 95%: {}",
        probes as f64 / allocs as f64
    );
    assert!(
        (scans as f64) < 0.05 * allocs as f64,
        "scans to 95%: {scans} of {allocs}"
    );
    // Fewer failed probes is likelier than more (random probing, not a walk).
    let mut h = [0u64; PROBES + 1];
    for w in &marks {
        for (a, b) in h.iter_mut().zip(w.hist) {
            *a += b;
        }
    }
    for i in 1..=5 {
        assert!(h[i] <= h[i - 1], "histogram not decreasing at {i}: {h:?}");
    }
    // The last 5 % is where the scan earns its keep; it still never fails.
    assert!(full.scans > 0);
    // Uniform spread: no tenth of the range is starved or crowded at half fill.
    for (i, c) in spread_at_half.iter().enumerate() {
        assert!((25..=75).contains(c), "tenth {i} got {c} of {}", SIZE / 2);
    }
}

#[test]
fn large_pools_fill_fast_and_exactly() {
    // Four addresses × the full dynamic range: 258,048 ports per protocol. Allocate a
    // quarter million mappings and check none collide and the pairing spreads hosts.
    let addrs = [
        "198.19.255.1",
        "198.19.255.2",
        "198.19.255.3",
        "198.19.255.4",
    ];
    let mut n = nat_with(vec![SnatPool::new(
        addrs.iter().map(|a| ip(a)).collect(),
        1024,
        65535,
    )
    .sources(&[INSIDE])]);
    let mut rng = DetRng::new(7);
    let mut used = HashSet::new();
    let mut seen = HashSet::new();
    let total = 4 * (65535 - 1024 + 1);
    let want = 250_000;
    for i in 0..want {
        let d = decide_at(&mut n, &pkt(&random_flow(&mut rng, &mut used)), 0, i as u64);
        assert!(seen.insert(ext(&d)), "collision at {i}");
    }
    let free: usize = addrs
        .iter()
        .map(|a| n.free_port_count(ip(a), proto::UDP))
        .sum();
    assert_eq!(free, total - want);
    let s = n.stats();
    eprintln!(
        "{want} of {total}: {:.2} probes per random allocation, {} scans, {} pairing fallbacks",
        s.random_probes as f64 / allocations(&s) as f64,
        s.probe_histogram[PROBES],
        s.pairing_fallbacks
    );
    for a in addrs {
        let f = n.free_port_count(ip(a), proto::UDP);
        assert!(f < 12_000, "{a} has {f} free: hosts were not spread");
    }
}
