//! The ABI between this crate and `bpf/pp_xdp.c`: map names and capacities, rule flags,
//! and the layouts of the map keys and values.
//!
//! This file is the only copy. The library includes it as a module and the build script
//! includes it by path, writes `OUT_DIR/pp_xdp_abi.h` from it with [`c_header`], and
//! compiles `pp_xdp.c` against that header. The header carries `_Static_assert`s of every
//! struct's size and every field's offset and size as `repr(C)` lays them out here, so a
//! C type that lays out differently fails the clang build.
//!
//! It must build both inside the library and in the build script, so it uses `std` only.

use std::fmt::Write as _;

/// The program's name in the object.
pub const PROGRAM: &str = "pp_xdp";
/// Map of offloaded rules: 40-byte `FlowKey` bytes ([`XdpFlowKey`]) → [`XdpRule`].
pub const RULES_MAP: &str = "offloaded_rules";
/// One-entry array holding the node's underlay identity ([`XdpNode`]).
pub const NODE_MAP: &str = "node_config";
/// AF_XDP sockets by receive queue, where misses go.
pub const XSKS_MAP: &str = "xsks";
/// PP cluster mode: non-zero at index 0 makes the program take only frames to owned vMACs.
pub const VIP_MODE_MAP: &str = "vip_mode";
/// The vMACs this node owns (key: the MAC in the low 6 bytes of a native-endian u64).
pub const VIP_MACS_MAP: &str = "vip_macs";
/// Capacity of [`RULES_MAP`].
pub const MAX_OFFLOADED_RULES: u32 = 65536;
/// Capacity of [`VIP_MACS_MAP`].
pub const MAX_VIP_MACS: u32 = 256;
/// Capacity of [`XSKS_MAP`]: receive queues an AF_XDP socket can be bound on.
pub const MAX_XSK_QUEUES: u32 = 64;

/// A C scalar type of the header and its size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CType {
    pub name: &'static str,
    pub size: usize,
}

impl CType {
    const fn new(name: &'static str, size: usize) -> Self {
        CType { name, size }
    }
}

pub const C_U8: CType = CType::new("__u8", 1);
pub const C_U16: CType = CType::new("__u16", 2);
pub const C_U32: CType = CType::new("__u32", 4);
pub const C_U64: CType = CType::new("__u64", 8);

/// The C element type a Rust field type maps to by default (a byte array becomes a
/// `__u8` array); a field declares another with `as`.
pub trait CElem {
    const C: CType;
}

impl CElem for u8 {
    const C: CType = C_U8;
}
impl CElem for u32 {
    const C: CType = C_U32;
}
impl CElem for u64 {
    const C: CType = C_U64;
}
impl<T: CElem, const N: usize> CElem for [T; N] {
    const C: CType = T::C;
}

/// One field of a struct shared with C, as `repr(C)` lays it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CField {
    pub name: &'static str,
    pub c: CType,
    pub offset: usize,
    pub size: usize,
}

/// A struct shared with C.
pub trait CStruct {
    /// The struct's tag in C (`struct NAME`).
    const C_NAME: &'static str;
    const C_FIELDS: &'static [CField];
    const SIZE: usize;
}

/// A `repr(C)` struct and its C description. A field's C type is its Rust element type's
/// unless given with `as` (the program reads some byte arrays as integers).
macro_rules! abi_struct {
    (
        $(#[$m:meta])*
        pub struct $name:ident = $cname:literal {
            $( $(#[$fm:meta])* pub $field:ident : $ty:ty $(as $c:expr)? , )*
        }
    ) => {
        $(#[$m])*
        #[repr(C)]
        pub struct $name {
            $( $(#[$fm])* pub $field: $ty, )*
        }

        impl CStruct for $name {
            const C_NAME: &'static str = $cname;
            const C_FIELDS: &'static [CField] = &[$(CField {
                name: stringify!($field),
                c: abi_struct!(@c $ty $(, $c)?),
                offset: ::std::mem::offset_of!($name, $field),
                size: ::std::mem::size_of::<$ty>(),
            },)*];
            const SIZE: usize = ::std::mem::size_of::<$name>();
        }
    };
    (@c $ty:ty) => { <$ty as CElem>::C };
    (@c $ty:ty, $c:expr) => { $c };
}

/// Bit flags and their names for the header (`#define PREFIX_NAME value`).
macro_rules! abi_flags {
    (
        $(#[$m:meta])*
        pub mod $module:ident = $prefix:literal {
            $( $(#[$fm:meta])* $flag:ident = $value:expr; )*
        }
    ) => {
        $(#[$m])*
        pub mod $module {
            $( $(#[$fm])* pub const $flag: u32 = $value; )*
            /// The prefix of the flags' names in the C header.
            pub const C_PREFIX: &str = $prefix;
            /// Every flag with its name.
            pub const ALL: &[(&str, u32)] = &[$((stringify!($flag), $flag),)*];
        }
    };
}

abi_flags! {
    /// Flags of [`XdpRule::flags`]; the header defines them as `F_*`.
    pub mod rule_flag = "F_" {
        DECAP = 1;
        SRC_ADDR = 1 << 1;
        SRC_PORT = 1 << 2;
        DST_ADDR = 1 << 3;
        DST_PORT = 1 << 4;
        ENCAP = 1 << 5;
        DROP = 1 << 6;
        INNER_DMAC = 1 << 7;
        INNER_SMAC = 1 << 8;
    }
}

abi_struct! {
    /// The key of [`RULES_MAP`]: the canonical 40 bytes of pipeline's `FlowKey`
    /// (docs/golden-corpus.md). The library passes `FlowKey::as_bytes` as the key; a
    /// unit test checks those bytes sit where this struct says.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct XdpFlowKey = "flow_key" {
        pub src: [u8; 16],
        pub dst: [u8; 16],
        pub sport: [u8; 2],
        pub dport: [u8; 2],
        pub vni: [u8; 3],
        pub proto: u8,
    }
}

abi_struct! {
    /// An offloaded rule as the XDP program reads it: the compiled action list and the
    /// rule's counters, which the program updates in place.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct XdpRule = "xdp_rule" {
        pub flags: u32,
        /// New source address; IPv4 in the first 4 bytes.
        pub src_addr: [u8; 16],
        pub dst_addr: [u8; 16],
        /// New ports (ICMP echo: the identifier), network byte order.
        pub sport: [u8; 2] as C_U16,
        pub dport: [u8; 2] as C_U16,
        /// Outer destination of the re-encap, network byte order.
        pub encap_dst: [u8; 4] as C_U32,
        /// VNI of the re-encap, big endian; the first byte is 0.
        pub encap_vni: [u8; 4],
        /// Outer UDP source port of the re-encap: `vxlan_source_port` of the rewritten key,
        /// as the userspace pipeline computes it at install. Network byte order.
        pub encap_sport: [u8; 2] as C_U16,
        /// The rule's output port. Every output of a PP node leaves by its one interface,
        /// as with the UDP socket backend, so the program transmits with `XDP_TX`.
        pub out_port: u8,
        pub pad: u8,
        pub inner_dmac: [u8; 6],
        pub inner_smac: [u8; 6],
        pub packets: u64,
        pub bytes: u64,
        /// `bpf_ktime_get_ns` of the last hit (CLOCK_MONOTONIC); 0 before the first.
        pub last_seen_ns: u64,
    }
}

abi_struct! {
    /// The node's underlay identity, as the program reads it.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct XdpNode = "xdp_node" {
        /// Network byte order; all zero means "not configured": the program passes all.
        pub ip: [u8; 4] as C_U32,
        pub mac: [u8; 6],
        pub gw_mac: [u8; 6],
    }
}

// The sizes the program was written for; the header asserts the C side matches them.
const _: () = assert!(XdpFlowKey::SIZE == 40);
const _: () = assert!(XdpRule::SIZE == 88);
const _: () = assert!(XdpNode::SIZE == 16);

/// A map of the program's object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapDef {
    pub name: &'static str,
    /// `BPF_MAP_TYPE_*`, without the prefix.
    pub kind: &'static str,
    pub max_entries: u32,
    /// C key and value types.
    pub key: &'static str,
    pub value: &'static str,
}

/// Every map of `pp_xdp.c`, defined by the header.
pub const MAPS: &[MapDef] = &[
    MapDef {
        name: RULES_MAP,
        kind: "HASH",
        max_entries: MAX_OFFLOADED_RULES,
        key: "struct flow_key",
        value: "struct xdp_rule",
    },
    MapDef {
        name: NODE_MAP,
        kind: "ARRAY",
        max_entries: 1,
        key: "__u32",
        value: "struct xdp_node",
    },
    // PP cluster (docs/pp-cluster.md, paper 003 §IV-E): when `vip_mode[0]` is non-zero
    // the node takes VXLAN only in frames addressed to a vMAC it owns. A switch that has
    // not learned a vMAC floods its frames to every node; only the owner may take them,
    // or a flow would be served twice.
    MapDef {
        name: VIP_MODE_MAP,
        kind: "ARRAY",
        max_entries: 1,
        key: "__u32",
        value: "__u32",
    },
    MapDef {
        name: VIP_MACS_MAP,
        kind: "HASH",
        max_entries: MAX_VIP_MACS,
        key: "__u64",
        value: "__u32",
    },
    MapDef {
        name: XSKS_MAP,
        kind: "XSKMAP",
        max_entries: MAX_XSK_QUEUES,
        key: "__u32",
        value: "__u32",
    },
];

fn c_struct<S: CStruct>(h: &mut String) {
    let name = S::C_NAME;
    // Writing to a String cannot fail.
    let _ = writeln!(h, "struct {name} {{");
    for f in S::C_FIELDS {
        let n = f.size / f.c.size;
        let ty = f.c.name;
        if n == 1 {
            let _ = writeln!(h, "\t{ty} {};", f.name);
        } else {
            let _ = writeln!(h, "\t{ty} {}[{n}];", f.name);
        }
    }
    let _ = writeln!(h, "}};");
    let _ = writeln!(
        h,
        "_Static_assert(sizeof(struct {name}) == {}, \"struct {name}: size differs from Rust\");",
        S::SIZE
    );
    for f in S::C_FIELDS {
        let field = f.name;
        let _ = writeln!(
            h,
            "_Static_assert(__builtin_offsetof(struct {name}, {field}) == {}, \"{name}.{field}: offset differs from Rust\");",
            f.offset
        );
        let _ = writeln!(
            h,
            "_Static_assert(sizeof(((struct {name} *)0)->{field}) == {}, \"{name}.{field}: size differs from Rust\");",
            f.size
        );
    }
    h.push('\n');
}

/// The text of `pp_xdp_abi.h`, which `pp_xdp.c` includes.
pub fn c_header() -> String {
    let mut h = String::new();
    h.push_str(
        "/* Generated by crates/xdp/build.rs from crates/xdp/src/abi.rs: edit that file. */\n\
         #ifndef PP_XDP_ABI_H\n\
         #define PP_XDP_ABI_H\n\n\
         #include <linux/bpf.h>\n\
         #include <linux/types.h>\n\n\
         #ifndef SEC\n\
         #define SEC(name) __attribute__((section(name), used))\n\
         #endif\n\
         #define __uint(name, val) int(*name)[val]\n\
         #define __type(name, val) typeof(val) *name\n\n",
    );
    for (flag, value) in rule_flag::ALL {
        let _ = writeln!(h, "#define {}{flag} {value:#x}u", rule_flag::C_PREFIX);
    }
    let _ = writeln!(h, "#define MAX_OFFLOADED_RULES {MAX_OFFLOADED_RULES}\n");
    c_struct::<XdpFlowKey>(&mut h);
    c_struct::<XdpRule>(&mut h);
    c_struct::<XdpNode>(&mut h);
    for m in MAPS {
        let _ = writeln!(
            h,
            "struct {{\n\t__uint(type, BPF_MAP_TYPE_{});\n\t__uint(max_entries, {});\n\t__type(key, {});\n\t__type(value, {});\n}} {} SEC(\".maps\");\n",
            m.kind, m.max_entries, m.key, m.value, m.name
        );
    }
    h.push_str("#endif /* PP_XDP_ABI_H */\n");
    h
}
