//! Topology fixtures: sysfs-like trees (the `devices/` hierarchy, `bus/pci/devices` links, the
//! `vendor`, `class` and `numa_node` files, CPU `nodeN` entries) for nodes as they come.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A sysfs-like tree in a fresh temporary directory, removed on drop.
struct Fixture {
    root: PathBuf,
}

const NVIDIA: u32 = 0x10de;
const MELLANOX: u32 = 0x15b3;
const GPU_CLASS: u32 = 0x030200; // 3D controller
const NIC_CLASS: u32 = 0x020700; // InfiniBand controller

impl Fixture {
    fn new(name: &str) -> Fixture {
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "mscclpp-topo-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bus/pci/devices")).unwrap();
        Fixture { root }
    }

    fn sys(&self) -> Sysfs {
        Sysfs::new(&self.root)
    }

    /// A PCI device at the end of `chain` (host bridge, bridges...), linked from
    /// bus/pci/devices as in sysfs.
    fn device(&self, chain: &[&str], pci: &str, vendor: u32, class: u32, numa: i32) -> Pci {
        let mut dir = self.root.join("devices");
        for c in chain {
            dir.push(c);
        }
        dir.push(pci);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vendor"), format!("0x{vendor:04x}\n")).unwrap();
        std::fs::write(dir.join("class"), format!("0x{class:06x}\n")).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        let rel: PathBuf = ["..", "..", ".."]
            .iter()
            .collect::<PathBuf>()
            .join(dir.strip_prefix(&self.root).unwrap());
        std::os::unix::fs::symlink(rel, self.root.join("bus/pci/devices").join(pci)).unwrap();
        pci.parse().unwrap()
    }

    fn cpu(&self, cpu: usize, node: i32) {
        let d = self
            .root
            .join(format!("devices/system/cpu/cpu{cpu}/node{node}"));
        std::fs::create_dir_all(d).unwrap();
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn nic(name: &str, pci: Pci) -> Nic {
    Nic {
        name: name.into(),
        pci,
    }
}

#[test]
fn pci_addresses_parse_and_print() {
    let p: Pci = "0000:1b:00.0".parse().unwrap();
    assert_eq!(p.to_string(), "0000:1b:00.0");
    let q: Pci = "00000000:1B:00.0".parse().unwrap();
    assert_eq!(p, q, "the CUDA driver's form");
    assert_eq!("1b:00.1".parse::<Pci>().unwrap().func, 1);
    for bad in [
        "",
        "0000:1b:00",
        "zz:00.0",
        "0000:1b:100.0",
        "10000000:00:00.0",
    ] {
        assert!(bad.parse::<Pci>().is_err(), "{bad:?}");
    }
}

/// HGX-like: 8 GPUs and 8 NICs, two of each per PCIe switch, two switches per root complex,
/// one root complex per NUMA node... of two. Each GPU gets the NICs of its switch, and the
/// two GPUs of a switch start on different NICs.
#[test]
fn hgx_like_node_pairs_each_gpu_with_its_switch_nics() {
    let f = Fixture::new("hgx");
    let mut gpus = Vec::new();
    let mut nics = Vec::new();
    for sw in 0..4u32 {
        let host = if sw < 2 { "pci0000:00" } else { "pci0000:80" };
        let base = if sw < 2 { 0x00 } else { 0x80 };
        let port = format!("0000:{:02x}:{:02x}.0", base, 1 + sw);
        let up = format!("0000:{:02x}:00.0", base + 0x10 * (sw + 1));
        let numa = (sw / 2) as i32;
        for k in 0..2u32 {
            let down = format!("0000:{:02x}:{:02x}.0", base + 0x10 * (sw + 1) + 1, k * 8);
            let gpu = format!("0000:{:02x}:00.0", base + 0x10 * (sw + 1) + 2 + k);
            gpus.push(f.device(&[host, &port, &up, &down], &gpu, NVIDIA, GPU_CLASS, numa));
            let down_n = format!(
                "0000:{:02x}:{:02x}.0",
                base + 0x10 * (sw + 1) + 1,
                16 + k * 8
            );
            let nic_pci = format!("0000:{:02x}:00.0", base + 0x10 * (sw + 1) + 4 + k);
            let p = f.device(
                &[host, &port, &up, &down_n],
                &nic_pci,
                MELLANOX,
                NIC_CLASS,
                numa,
            );
            nics.push(nic(&format!("mlx5_{}", 2 * sw + k), p));
        }
    }
    let sys = f.sys();
    assert_eq!(sys.gpus(), gpus);
    let mut firsts = Vec::new();
    for (g, gpu) in gpus.iter().enumerate() {
        let c = for_gpu(&sys, *gpu, &nics).unwrap();
        let sw = g / 2;
        let mine = [format!("mlx5_{}", 2 * sw), format!("mlx5_{}", 2 * sw + 1)];
        let want: Vec<String> = if g % 2 == 0 {
            mine.to_vec()
        } else {
            vec![mine[1].clone(), mine[0].clone()]
        };
        assert_eq!(c.nics, want, "GPU {g} ({gpu})");
        assert_eq!((c.near, c.turn), (Near::Switch, (g % 2, 2)));
        firsts.push(c.nics[0].clone());
    }
    firsts.sort();
    firsts.dedup();
    assert_eq!(firsts.len(), 8, "every GPU starts on a NIC of its own");
}

/// p5-like: 8 GPUs, 32 NICs, each GPU alone on a switch with 4 NICs: each GPU gets its 4.
#[test]
fn p5_like_node_gives_each_gpu_its_four_nics() {
    let f = Fixture::new("p5");
    let mut gpus = Vec::new();
    let mut nics = Vec::new();
    for g in 0..8u32 {
        let host = format!("pci0000:{:02x}", g * 0x20);
        let port = format!("0000:{:02x}:01.0", g * 0x20);
        let up = format!("0000:{:02x}:00.0", g * 0x20 + 1);
        let numa = (g / 4) as i32;
        let down = format!("0000:{:02x}:00.0", g * 0x20 + 2);
        gpus.push(f.device(
            &[&host, &port, &up, &down],
            &format!("0000:{:02x}:00.0", g * 0x20 + 3),
            NVIDIA,
            GPU_CLASS,
            numa,
        ));
        for k in 0..4u32 {
            let down = format!("0000:{:02x}:{:02x}.0", g * 0x20 + 2, 8 + k);
            let p = f.device(
                &[&host, &port, &up, &down],
                &format!("0000:{:02x}:00.0", g * 0x20 + 4 + k),
                0x1d0f,
                0x020000,
                numa,
            );
            nics.push(nic(&format!("rdmap{}s0", 4 * g + k), p));
        }
    }
    let sys = f.sys();
    for (g, gpu) in gpus.iter().enumerate() {
        let c = for_gpu(&sys, *gpu, &nics).unwrap();
        let want: Vec<String> = (0..4).map(|k| format!("rdmap{}s0", 4 * g + k)).collect();
        assert_eq!(c.nics, want, "GPU {g}");
        assert_eq!((c.near, c.turn), (Near::Switch, (0, 1)));
    }
}

/// NUMA node -1 everywhere (as on the GPU machine here), GPUs and NICs under host bridges of
/// their own: nothing is near, so all NICs, and the two GPUs start on different ones.
#[test]
fn unknown_numa_nodes_spread_gpus_over_all_nics() {
    let f = Fixture::new("numa-1");
    let g0 = f.device(&["pci0000:00"], "0000:00:05.0", NVIDIA, GPU_CLASS, -1);
    let g1 = f.device(&["pci0000:40"], "0000:40:05.0", NVIDIA, GPU_CLASS, -1);
    let n0 = f.device(&["pci0000:80"], "0000:80:03.0", MELLANOX, NIC_CLASS, -1);
    let n1 = f.device(&["pci0000:c0"], "0000:c0:03.0", MELLANOX, NIC_CLASS, -1);
    let sys = f.sys();
    assert_eq!(sys.numa_node(g0), None);
    let nics = [nic("mlx5_1", n1), nic("mlx5_0", n0)];
    let c0 = for_gpu(&sys, g0, &nics).unwrap();
    let c1 = for_gpu(&sys, g1, &nics).unwrap();
    assert_eq!(c0.nics, ["mlx5_0", "mlx5_1"]);
    assert_eq!(c1.nics, ["mlx5_1", "mlx5_0"]);
    assert_eq!((c0.near, c0.turn, c1.turn), (Near::System, (0, 2), (1, 2)));
}

/// No NIC near a GPU: the GPU's NUMA node has none. The GPU on the NICs' node takes them by
/// NUMA; the other gets every NIC, said to be across the system.
#[test]
fn gpu_with_no_near_nic_takes_all_of_them() {
    let f = Fixture::new("far");
    let near_gpu = f.device(
        &["pci0000:00", "0000:00:01.0"],
        "0000:01:00.0",
        NVIDIA,
        GPU_CLASS,
        0,
    );
    let far_gpu = f.device(
        &["pci0000:80", "0000:80:01.0"],
        "0000:81:00.0",
        NVIDIA,
        GPU_CLASS,
        1,
    );
    let n0 = f.device(
        &["pci0000:40", "0000:40:01.0"],
        "0000:41:00.0",
        MELLANOX,
        NIC_CLASS,
        0,
    );
    let n1 = f.device(
        &["pci0000:40", "0000:40:02.0"],
        "0000:42:00.0",
        MELLANOX,
        NIC_CLASS,
        0,
    );
    let sys = f.sys();
    let nics = [nic("mlx5_0", n0), nic("mlx5_1", n1)];
    let c = for_gpu(&sys, near_gpu, &nics).unwrap();
    assert_eq!(
        (c.nics.as_slice(), c.near),
        (&["mlx5_0".to_string(), "mlx5_1".into()][..], Near::Numa)
    );
    let c = for_gpu(&sys, far_gpu, &nics).unwrap();
    assert_eq!(c.near, Near::System);
    assert_eq!(c.nics.len(), 2);
    // The two NICs share a root complex but not a switch (separate root ports).
    assert_eq!(sys.near(n0, n1), Near::RootComplex);
    assert_eq!(
        for_gpu(&sys, far_gpu, &[]),
        None,
        "no NIC at all: no choice"
    );
}

/// A rank without a GPU: the NICs of its CPU's NUMA node, spread by CPU.
#[test]
fn host_ranks_take_the_nics_of_their_cpus_numa_node() {
    let f = Fixture::new("cpu");
    for c in 0..8 {
        f.cpu(c, (c / 4) as i32);
    }
    let a = f.device(&["pci0000:00"], "0000:00:03.0", MELLANOX, NIC_CLASS, 0);
    let b = f.device(&["pci0000:80"], "0000:80:03.0", MELLANOX, NIC_CLASS, 1);
    let c = f.device(&["pci0000:80"], "0000:80:04.0", MELLANOX, NIC_CLASS, 1);
    let sys = f.sys();
    let nics = [nic("a", a), nic("b", b), nic("c", c)];
    assert_eq!(sys.cpu_numa_node(5), Some(1));
    assert_eq!(for_cpu(&sys, 1, &nics).unwrap().nics, ["a"]);
    assert_eq!(for_cpu(&sys, 4, &nics).unwrap().nics, ["b", "c"]);
    assert_eq!(for_cpu(&sys, 5, &nics).unwrap().nics, ["c", "b"]);
    // A CPU sysfs does not know: every NIC, across the system.
    let any = for_cpu(&sys, 99, &nics).unwrap();
    assert_eq!((any.nics.len(), any.near), (3, Near::System));
}
