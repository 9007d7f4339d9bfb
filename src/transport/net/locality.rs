//! Which NIC a rank uses when nothing names one (`ibDev = NULL`, or `auto` in
//! `MSCCLPP_IBDEV_MAP`): the NIC(s) nearest to its GPU in the PCI tree, spread over the GPUs
//! that share them, so the ranks of one node do not all pile onto the first NIC.
//!
//! Nearness, best first, from the sysfs paths of the two PCI devices (the chain of bridges
//! from the host bridge down): the same PCIe switch (they share a bridge below the host
//! bridge), the same root complex (the same `pciDDDD:BB` host bridge), the same NUMA node,
//! anything else. This is the order NCCL uses (PIX/PXB, PHB, then SYS split by NUMA).
//!
//! Spreading: the GPUs of the node (NVIDIA display/3D controllers in sysfs, so every rank sees
//! all of them whatever `CUDA_VISIBLE_DEVICES` says) whose nearest NICs are the same set take
//! that set in turns: the k-th of them (by PCI address) starts at the set's k-th NIC. A rank
//! without a GPU picks the NICs on the NUMA node of the CPU it runs on.
//!
//! sysfs is read from `MSCCLPP_TEST_SYSFS_ROOT` (tests point it at a fixture tree) or `/sys`.
//! Nothing here is hand-written for want of a library: hwloc would answer the same questions
//! but is a C dependency for five file reads.

use std::fmt;
use std::path::{Path, PathBuf};

/// A PCI address `domain:bus:device.function`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pci {
    pub domain: u16,
    pub bus: u8,
    pub dev: u8,
    pub func: u8,
}

impl fmt::Display for Pci {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.dev, self.func
        )
    }
}

impl std::str::FromStr for Pci {
    type Err = ();
    /// `0000:1b:00.0` (any case; the CUDA driver writes `00000000:1B:00.0`, also taken).
    fn from_str(s: &str) -> Result<Pci, ()> {
        let s = s.trim();
        let (rest, func) = s.rsplit_once('.').ok_or(())?;
        let mut it = rest.rsplitn(3, ':');
        let dev = it.next().ok_or(())?;
        let bus = it.next().ok_or(())?;
        let domain = it.next().unwrap_or("0");
        Ok(Pci {
            domain: u32::from_str_radix(domain, 16)
                .ok()
                .and_then(|d| u16::try_from(d).ok())
                .ok_or(())?,
            bus: u8::from_str_radix(bus, 16).map_err(|_| ())?,
            dev: u8::from_str_radix(dev, 16).map_err(|_| ())?,
            func: u8::from_str_radix(func, 16).map_err(|_| ())?,
        })
    }
}

/// How near two devices are, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Near {
    /// Behind one PCIe switch (they share a bridge below the host bridge).
    Switch,
    /// Under the same host bridge (root complex).
    RootComplex,
    /// On the same NUMA node.
    Numa,
    /// Anything else, or not known.
    System,
}

impl fmt::Display for Near {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Near::Switch => "same PCIe switch",
            Near::RootComplex => "same root complex",
            Near::Numa => "same NUMA node",
            Near::System => "no nearer NIC (across the system)",
        })
    }
}

/// The sysfs tree the topology is read from.
#[derive(Clone, Debug)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Sysfs { root: root.into() }
    }

    fn device_dir(&self, p: Pci) -> PathBuf {
        self.root.join("bus/pci/devices").join(p.to_string())
    }

    /// The chain of PCI components from the host bridge (`pci0000:00`) down to the device,
    /// from where its `bus/pci/devices` link points; None if the device is not there.
    fn chain(&self, p: Pci) -> Option<Vec<String>> {
        let real = std::fs::canonicalize(self.device_dir(p)).ok()?;
        let devices = std::fs::canonicalize(self.root.join("devices")).ok()?;
        let rel = real.strip_prefix(&devices).ok()?;
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        parts.first()?.starts_with("pci").then_some(parts)
    }

    /// The device's NUMA node; None where unknown (-1, as on many VMs) or absent.
    pub fn numa_node(&self, p: Pci) -> Option<i32> {
        read_num(&self.device_dir(p).join("numa_node")).filter(|n| *n >= 0)
    }

    /// How near `a` and `b` are.
    pub fn near(&self, a: Pci, b: Pci) -> Near {
        if let (Some(x), Some(y)) = (self.chain(a), self.chain(b)) {
            let common = x.iter().zip(&y).take_while(|(p, q)| p == q).count();
            // [host bridge, root port, (switch ports...), device]: sharing a bridge below the
            // host bridge means one switch (or one root port, which fans out through one).
            if common >= 2 {
                return Near::Switch;
            }
            if common == 1 {
                return Near::RootComplex;
            }
        }
        match (self.numa_node(a), self.numa_node(b)) {
            (Some(x), Some(y)) if x == y => Near::Numa,
            _ => Near::System,
        }
    }

    /// NVIDIA GPUs (vendor 0x10de, PCI class 0x03: display / 3D controller), by address.
    pub fn gpus(&self) -> Vec<Pci> {
        let mut out: Vec<Pci> = std::fs::read_dir(self.root.join("bus/pci/devices"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let p: Pci = e.file_name().to_str()?.parse().ok()?;
                let vendor = read_hex(&e.path().join("vendor"))?;
                let class = read_hex(&e.path().join("class"))?;
                (vendor == 0x10de && class >> 16 == 0x03).then_some(p)
            })
            .collect();
        out.sort();
        out
    }

    /// The NUMA node of CPU `cpu`, from the `nodeN` entry of its sysfs directory.
    pub fn cpu_numa_node(&self, cpu: usize) -> Option<i32> {
        let dir = self.root.join(format!("devices/system/cpu/cpu{cpu}"));
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .find_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
    }
}

fn read_num(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_hex(path: &Path) -> Option<u32> {
    let s = std::fs::read_to_string(path).ok()?;
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// A NIC candidate: its libfabric domain name and PCI address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nic {
    pub name: String,
    pub pci: Pci,
}

/// The NICs chosen for a rank, in the order to use them (the first is the one a single-rail
/// endpoint opens), and how near they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub nics: Vec<String>,
    pub near: Near,
    /// This rank's turn among the GPUs sharing those NICs, and how many share them.
    pub turn: (usize, usize),
}

/// The nearest of `nics` (none of them empty-named; order irrelevant) to the GPU at `gpu`,
/// spread over the node's GPUs that share them (module doc). None without NICs.
pub fn for_gpu(sys: &Sysfs, gpu: Pci, nics: &[Nic]) -> Option<Choice> {
    let (set, near) = nearest(nics, |n| sys.near(gpu, n.pci))?;
    let mut gpus = sys.gpus();
    if !gpus.contains(&gpu) {
        gpus.push(gpu);
        gpus.sort();
    }
    let sharing: Vec<Pci> = gpus
        .into_iter()
        .filter(|g| nearest(nics, |n| sys.near(*g, n.pci)).is_some_and(|(s, _)| s == set))
        .collect();
    let turn = sharing.iter().position(|g| *g == gpu).unwrap_or(0);
    Some(Choice {
        nics: rotate(&set, turn),
        near,
        turn: (turn, sharing.len().max(1)),
    })
}

/// The NICs on the NUMA node of CPU `cpu` (all NICs if none is, or the node is unknown),
/// starting at the one `cpu` falls on, for a rank without a GPU.
pub fn for_cpu(sys: &Sysfs, cpu: usize, nics: &[Nic]) -> Option<Choice> {
    let node = sys.cpu_numa_node(cpu);
    let (set, near) = nearest(nics, |n| match (node, sys.numa_node(n.pci)) {
        (Some(a), Some(b)) if a == b => Near::Numa,
        _ => Near::System,
    })?;
    let turn = cpu % set.len();
    Some(Choice {
        nics: rotate(&set, turn),
        near,
        turn: (turn, set.len()),
    })
}

/// The names of the NICs at the best nearness (ordered by PCI address, then name), and it.
fn nearest(nics: &[Nic], near: impl Fn(&Nic) -> Near) -> Option<(Vec<String>, Near)> {
    // Each NIC's nearness once: it reads sysfs.
    let ds: Vec<Near> = nics.iter().map(near).collect();
    let best = *ds.iter().min()?;
    let mut set: Vec<&Nic> = nics
        .iter()
        .zip(&ds)
        .filter(|(_, d)| **d == best)
        .map(|(n, _)| n)
        .collect();
    set.sort_by(|a, b| (a.pci, &a.name).cmp(&(b.pci, &b.name)));
    set.dedup_by(|a, b| a.name == b.name);
    Some((set.into_iter().map(|n| n.name.clone()).collect(), best))
}

fn rotate(set: &[String], k: usize) -> Vec<String> {
    let k = k % set.len().max(1);
    set[k..].iter().chain(&set[..k]).cloned().collect()
}

#[cfg(test)]
mod tests;
