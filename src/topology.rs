//! Device topology: the NUMA node and the CPUs nearest each device.
//!
//! [`discover`] maps every device (by its PCI bus id, see
//! [`DeviceInfo::pci_bus_id`]) to the NUMA node and cpuset hwloc reports as
//! local to it, so that per-device maintenance threads can be pinned next to
//! their device with [`bind_current_thread`]. hwloc is optional (cargo feature
//! `hwloc`, which links against the system's `libhwloc`); without it, or when
//! hwloc cannot place a device (the simulator's made-up bus ids, a container
//! that hides `/sys/bus/pci`), every device gets all host CPUs and no NUMA
//! node, and [`Topology::note`] says why. Discovery never fails and never
//! panics.

use crate::backend::DeviceInfo;
use crate::error::{Error, Result};
use std::fmt;

/// The note [`discover`] gives when gpupool is built without the `hwloc`
/// feature.
pub const NO_HWLOC_NOTE: &str = "built without the hwloc feature: maintenance threads are unbound";

/// Where one device sits in the machine.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceTopology {
    /// Index of the device in its backend.
    pub device: usize,
    /// PCI bus id of the device, as the backend reports it (`0000:3b:00.0`).
    pub pci_bus_id: String,
    /// OS index of the NUMA node nearest the device; `None` when unknown or
    /// when the device is equally close to several nodes.
    pub numa_node: Option<u32>,
    /// OS indices of the CPUs nearest the device (sorted, no duplicates): the
    /// cpuset of the device's first non-I/O ancestor in hwloc, or all host
    /// CPUs when that is unknown. Suitable for [`bind_current_thread`].
    pub cpus: Vec<usize>,
}

/// The host's topology as far as gpupool cares: one entry per device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Topology {
    /// Where the facts come from: `"hwloc"` or `"none"`.
    pub source: &'static str,
    /// A human-readable remark: why a fallback was taken, or which devices
    /// hwloc could not place. Never empty.
    pub note: String,
    /// One entry per device, in the order given to [`discover`].
    pub devices: Vec<DeviceTopology>,
    /// Number of CPUs (hardware threads) the host makes available.
    pub host_cpus: usize,
    /// Number of NUMA nodes (at least 1).
    pub numa_nodes: usize,
}

/// Finds the NUMA node and the CPUs nearest each of `devices`.
///
/// With the `hwloc` feature this builds an hwloc topology with I/O (PCI)
/// objects, looks up each device's PCI object by bus id and takes the cpuset
/// and nodeset of its first non-I/O ancestor. Devices hwloc cannot find get
/// all host CPUs and no NUMA node; if hwloc fails altogether the result has
/// `source == "none"`. Without the feature every device gets all CPUs the
/// process may run on. Never panics; the reason for any fallback is in
/// [`Topology::note`].
pub fn discover(devices: &[DeviceInfo]) -> Topology {
    #[cfg(feature = "hwloc")]
    {
        hw::discover(devices)
    }
    #[cfg(not(feature = "hwloc"))]
    {
        discover_without_hwloc(devices, NO_HWLOC_NOTE.to_string())
    }
}

/// Pins the calling thread to `cpus` (OS CPU indices, as in
/// [`DeviceTopology::cpus`]); it may then run on any of them.
///
/// Uses hwloc's thread CPU binding with the `hwloc` feature and
/// `sched_setaffinity` otherwise (or when hwloc cannot build a topology).
///
/// # Errors
///
/// [`Error::InvalidArgument`] for an empty list or an absurd CPU index;
/// [`Error::Io`] (or [`Error::Backend`] from hwloc) when the OS refuses the
/// binding, for instance because none of the CPUs is available to the
/// process; [`Error::Unsupported`] on systems without thread affinity.
pub fn bind_current_thread(cpus: &[usize]) -> Result<()> {
    if cpus.is_empty() {
        return Err(Error::InvalidArgument(
            "cannot bind a thread to an empty CPU list".into(),
        ));
    }
    if let Some(&bad) = cpus.iter().find(|&&c| c >= MAX_CPUS) {
        return Err(Error::InvalidArgument(format!(
            "CPU index {bad} is out of range (limit {MAX_CPUS})"
        )));
    }
    #[cfg(feature = "hwloc")]
    {
        if let Some(topo) = hw::shared_topology() {
            return hw::bind(topo, cpus);
        }
    }
    affinity::set(cpus)
}

/// The CPUs the calling thread may run on now (its affinity mask), sorted.
///
/// # Errors
///
/// [`Error::Io`] if the OS refuses to report it; [`Error::Unsupported`] on
/// systems without thread affinity.
pub fn current_thread_cpus() -> Result<Vec<usize>> {
    affinity::get()
}

/// Highest CPU index (exclusive) gpupool accepts; far beyond any machine.
const MAX_CPUS: usize = 1 << 20;

/// All CPUs the process may run on: the affinity mask of the calling thread,
/// or `0..available_parallelism` where that cannot be read.
fn host_cpus_fallback() -> Vec<usize> {
    match affinity::get() {
        Ok(cpus) if !cpus.is_empty() => cpus,
        _ => {
            let n = std::thread::available_parallelism().map_or(1, |n| n.get());
            (0..n).collect()
        }
    }
}

/// Number of NUMA nodes according to sysfs (at least 1).
fn numa_nodes_from_sysfs() -> usize {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else {
        return 1;
    };
    let n = dir
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("node")
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        })
        .count();
    n.max(1)
}

/// The topology without hwloc: every device gets all host CPUs.
fn discover_without_hwloc(devices: &[DeviceInfo], note: String) -> Topology {
    let cpus = host_cpus_fallback();
    Topology {
        source: "none",
        note,
        devices: devices
            .iter()
            .map(|d| DeviceTopology {
                device: d.index,
                pci_bus_id: d.pci_bus_id.clone(),
                numa_node: None,
                cpus: cpus.clone(),
            })
            .collect(),
        host_cpus: cpus.len(),
        numa_nodes: numa_nodes_from_sysfs(),
    }
}

/// Formats sorted CPU indices as ranges: `0-3,8,10-11`.
fn cpu_ranges(cpus: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            end += 1;
            i += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    if out.is_empty() {
        out.push('-');
    }
    out
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "topology (source: {}): {} host CPU(s), {} NUMA node(s)",
            self.source, self.host_cpus, self.numa_nodes
        )?;
        let bus_w = self
            .devices
            .iter()
            .map(|d| d.pci_bus_id.len())
            .max()
            .unwrap_or(0)
            .max("PCI BUS ID".len());
        writeln!(
            f,
            "{:>6}  {:<bus_w$}  {:>4}  {:>5}  CPUS",
            "DEVICE", "PCI BUS ID", "NUMA", "#CPUS"
        )?;
        for d in &self.devices {
            let numa = d
                .numa_node
                .map_or_else(|| "-".to_string(), |n| n.to_string());
            writeln!(
                f,
                "{:>6}  {:<bus_w$}  {:>4}  {:>5}  {}",
                d.device,
                d.pci_bus_id,
                numa,
                d.cpus.len(),
                cpu_ranges(&d.cpus)
            )?;
        }
        if self.devices.is_empty() {
            writeln!(f, "(no devices)")?;
        }
        write!(f, "note: {}", self.note)
    }
}

/// Thread affinity through `sched_{get,set}affinity` with a mask sized to
/// the CPUs at hand (so machines beyond `CPU_SETSIZE` work too).
#[cfg(target_os = "linux")]
mod affinity {
    use crate::error::{Error, Result};
    use libc::c_ulong;
    use std::mem::size_of;

    const BITS: usize = c_ulong::BITS as usize;

    /// Affinity mask of the calling thread.
    pub(super) fn get() -> Result<Vec<usize>> {
        // Start at glibc's CPU_SETSIZE (1024 CPUs) and grow while the kernel
        // says the mask is too small (EINVAL).
        let mut words = 1024 / BITS;
        loop {
            let mut buf: Vec<c_ulong> = vec![0; words];
            // SAFETY: `buf` is a live, writable buffer of exactly
            // `words * size_of::<c_ulong>()` bytes, the size passed; the kernel
            // writes a cpumask (an array of unsigned longs, the layout of
            // `cpu_set_t`) of at most that many bytes, and glibc zero-fills
            // the rest of the given size. pid 0 means the calling thread.
            let rc = unsafe {
                libc::sched_getaffinity(
                    0,
                    words * size_of::<c_ulong>(),
                    buf.as_mut_ptr().cast::<libc::cpu_set_t>(),
                )
            };
            if rc == 0 {
                let mut cpus = Vec::new();
                for (w, &word) in buf.iter().enumerate() {
                    for b in 0..BITS {
                        if word & (1 << b) != 0 {
                            cpus.push(w * BITS + b);
                        }
                    }
                }
                return Ok(cpus);
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) && words * BITS < super::MAX_CPUS {
                words *= 2;
                continue;
            }
            return Err(Error::Io(format!("sched_getaffinity: {err}")));
        }
    }

    /// Sets the affinity mask of the calling thread to `cpus` (each below
    /// `MAX_CPUS`, checked by the caller).
    pub(super) fn set(cpus: &[usize]) -> Result<()> {
        let max = cpus.iter().copied().max().unwrap_or(0);
        let words = (max / BITS + 1).max(1024 / BITS);
        let mut buf: Vec<c_ulong> = vec![0; words];
        for &c in cpus {
            buf[c / BITS] |= 1 << (c % BITS);
        }
        // SAFETY: `buf` is a live buffer of exactly `words *
        // size_of::<c_ulong>()` bytes, the size passed, holding a cpumask in
        // the kernel's layout (array of unsigned longs, as `cpu_set_t`); the
        // kernel only reads it. pid 0 means the calling thread.
        let rc = unsafe {
            libc::sched_setaffinity(
                0,
                words * size_of::<c_ulong>(),
                buf.as_ptr().cast::<libc::cpu_set_t>(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::Io(format!(
                "sched_setaffinity to CPUs {}: {}",
                super::cpu_ranges(cpus),
                std::io::Error::last_os_error()
            )))
        }
    }
}

/// Thread affinity is Linux-only here.
#[cfg(not(target_os = "linux"))]
mod affinity {
    use crate::error::{Error, Result};

    pub(super) fn get() -> Result<Vec<usize>> {
        Err(Error::Unsupported(
            "thread affinity is only implemented on Linux".into(),
        ))
    }

    pub(super) fn set(_cpus: &[usize]) -> Result<()> {
        Err(Error::Unsupported(
            "thread affinity is only implemented on Linux".into(),
        ))
    }
}

/// The hwloc side, through `hwlocality`.
#[cfg(feature = "hwloc")]
mod hw {
    use super::{cpu_ranges, discover_without_hwloc, DeviceTopology, Topology};
    use crate::backend::DeviceInfo;
    use crate::error::{Error, Result};
    use hwlocality::bitmap::BitmapIndex;
    use hwlocality::cpu::binding::CpuBindingFlags;
    use hwlocality::cpu::cpuset::CpuSet;
    use hwlocality::object::types::ObjectType;
    use hwlocality::topology::builder::TypeFilter;
    use hwlocality::Topology as HwTopology;
    use std::sync::OnceLock;

    /// Set indices of a (finite) hwloc cpuset, as OS CPU indices.
    fn cpuset_to_vec(set: &CpuSet) -> Vec<usize> {
        if set.last_set().is_none() {
            // Empty or infinite: neither is a usable CPU list.
            return Vec::new();
        }
        set.iter_set().map(usize::from).collect()
    }

    /// Builds a topology that includes PCI devices, bridges and OS devices.
    fn build_with_io() -> std::result::Result<HwTopology, String> {
        HwTopology::builder()
            .with_io_type_filter(TypeFilter::KeepAll)
            .map_err(|e| format!("hwloc_topology_set_io_types_filter: {e}"))?
            .build()
            .map_err(|e| format!("hwloc_topology_load: {e}"))
    }

    pub(super) fn discover(devices: &[DeviceInfo]) -> Topology {
        let topo = match build_with_io() {
            Ok(t) => t,
            Err(e) => {
                let note = format!(
                    "hwloc could not build a topology ({e}): maintenance threads are unbound"
                );
                return discover_without_hwloc(devices, note);
            }
        };
        let mut host = cpuset_to_vec(&topo.cpuset());
        if host.is_empty() {
            host = super::host_cpus_fallback();
        }
        let numa_nodes = topo.objects_with_type(ObjectType::NUMANode).count().max(1);
        let pci_seen = topo.pci_devices().len();

        let mut not_found = Vec::new();
        let mut multi_numa = Vec::new();
        let mut out = Vec::with_capacity(devices.len());
        for d in devices {
            // A malformed bus id is treated like one hwloc does not know.
            let obj = topo
                .pci_device_by_bus_id_string(d.pci_bus_id.trim())
                .ok()
                .flatten();
            // The first non-I/O ancestor has the device's locality: its
            // cpuset and nodeset.
            let anc = obj.and_then(|o| o.first_non_io_ancestor());
            let Some(anc) = anc else {
                not_found.push(format!("{} ({})", d.index, d.pci_bus_id));
                out.push(DeviceTopology {
                    device: d.index,
                    pci_bus_id: d.pci_bus_id.clone(),
                    numa_node: None,
                    cpus: host.clone(),
                });
                continue;
            };
            let mut cpus = anc.cpuset().map(|s| cpuset_to_vec(&s)).unwrap_or_default();
            if cpus.is_empty() {
                cpus = host.clone();
            }
            let numa_node = anc.nodeset().and_then(|ns| {
                if ns.weight() == Some(1) {
                    ns.first_set()
                        .and_then(|i| u32::try_from(usize::from(i)).ok())
                } else {
                    if ns.weight().is_some_and(|w| w > 1) {
                        multi_numa.push(format!("{} (nodes {})", d.index, ns));
                    }
                    None
                }
            });
            out.push(DeviceTopology {
                device: d.index,
                pci_bus_id: d.pci_bus_id.clone(),
                numa_node,
                cpus,
            });
        }

        let mut notes = Vec::new();
        if !not_found.is_empty() {
            notes.push(format!(
                "hwloc found no PCI device for device(s) {} among the {pci_seen} PCI device(s) \
                 it sees: those use all host CPUs ({}) and no NUMA node",
                not_found.join(", "),
                cpu_ranges(&host)
            ));
        }
        if !multi_numa.is_empty() {
            notes.push(format!(
                "device(s) {} are equally close to several NUMA nodes: no single node reported",
                multi_numa.join(", ")
            ));
        }
        if notes.is_empty() {
            notes.push(format!(
                "all {} device(s) placed by hwloc PCI locality",
                devices.len()
            ));
        }
        Topology {
            source: "hwloc",
            note: notes.join("; "),
            devices: out,
            host_cpus: host.len(),
            numa_nodes,
        }
    }

    /// A CPU-only topology shared by every binding call (built once; `None`
    /// if hwloc cannot build one, and then callers use `sched_setaffinity`).
    pub(super) fn shared_topology() -> Option<&'static HwTopology> {
        static TOPO: OnceLock<Option<HwTopology>> = OnceLock::new();
        TOPO.get_or_init(|| match HwTopology::new() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(
                    "hwloc could not build a topology ({e}); binding with sched_setaffinity"
                );
                None
            }
        })
        .as_ref()
    }

    /// Binds the calling thread to `cpus` with `hwloc_set_cpubind(THREAD)`.
    pub(super) fn bind(topo: &HwTopology, cpus: &[usize]) -> Result<()> {
        let mut set = CpuSet::new();
        for &c in cpus {
            let idx = BitmapIndex::try_from(c).map_err(|_| {
                Error::InvalidArgument(format!("CPU index {c} is beyond hwloc's range"))
            })?;
            set.set(idx);
        }
        topo.bind_cpu(&set, CpuBindingFlags::THREAD).map_err(|e| {
            Error::backend(
                "hwloc_set_cpubind",
                format!("binding to CPUs {}: {e}", cpu_ranges(cpus)),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::{SimBackend, SimConfig};
    use crate::backend::Backend;

    fn sim_devices(n: usize) -> Vec<DeviceInfo> {
        let sim = SimBackend::new(SimConfig {
            devices: n,
            ..Default::default()
        })
        .expect("simulator");
        (0..n)
            .map(|d| sim.device_info(d).expect("device info"))
            .collect()
    }

    #[test]
    fn cpu_ranges_compress() {
        assert_eq!(cpu_ranges(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_ranges(&[5]), "5");
        assert_eq!(cpu_ranges(&[]), "-");
    }

    #[cfg(not(feature = "hwloc"))]
    #[test]
    fn discover_without_feature_gives_all_cpus() {
        let infos = sim_devices(2);
        let topo = discover(&infos);
        let all = current_thread_cpus().expect("affinity");
        assert_eq!(topo.source, "none");
        assert_eq!(topo.note, NO_HWLOC_NOTE);
        assert_eq!(topo.devices.len(), 2);
        assert_eq!(topo.host_cpus, all.len());
        assert!(topo.numa_nodes >= 1);
        for (d, info) in topo.devices.iter().zip(&infos) {
            assert_eq!(d.device, info.index);
            assert_eq!(d.pci_bus_id, info.pci_bus_id);
            assert_eq!(d.numa_node, None);
            assert_eq!(d.cpus, all);
        }
        let text = topo.to_string();
        assert!(
            text.contains("0000:10:00.0") && text.contains("0000:11:00.0"),
            "{text}"
        );
        assert!(text.contains(NO_HWLOC_NOTE), "{text}");
        let json = serde_json::to_value(&topo).expect("json");
        assert_eq!(json["source"], "none");
        assert_eq!(json["devices"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn discover_with_no_devices() {
        let topo = discover(&[]);
        assert!(topo.devices.is_empty());
        assert!(topo.host_cpus >= 1 && topo.numa_nodes >= 1);
        assert!(topo.to_string().contains("(no devices)"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn bind_current_thread_pins_and_reads_back() {
        // In a fresh thread, so that no other test's thread is affected.
        std::thread::spawn(|| {
            let all = current_thread_cpus().expect("affinity");
            assert!(!all.is_empty());
            let one = *all.last().expect("a CPU");
            bind_current_thread(&[one]).expect("bind to one CPU");
            assert_eq!(current_thread_cpus().expect("affinity"), vec![one]);
            bind_current_thread(&all).expect("bind to all CPUs");
            assert_eq!(current_thread_cpus().expect("affinity"), all);
        })
        .join()
        .expect("binding thread");
    }

    #[test]
    fn bind_current_thread_rejects_bad_lists() {
        std::thread::spawn(|| {
            let before = current_thread_cpus().ok();
            assert!(matches!(
                bind_current_thread(&[]),
                Err(Error::InvalidArgument(_))
            ));
            assert!(matches!(
                bind_current_thread(&[usize::MAX]),
                Err(Error::InvalidArgument(_))
            ));
            // A CPU that exists nowhere is refused by the OS, and nothing
            // changes.
            assert!(bind_current_thread(&[MAX_CPUS - 1]).is_err());
            assert_eq!(current_thread_cpus().ok(), before);
        })
        .join()
        .expect("binding thread");
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn hwloc_discover_falls_back_for_fake_bus_ids() {
        let infos = sim_devices(2);
        let topo = discover(&infos);
        assert_eq!(topo.source, "hwloc", "{}", topo.note);
        assert!(topo.host_cpus >= 1);
        let avail = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(
            topo.host_cpus >= avail,
            "hwloc sees {} CPUs, std {avail}",
            topo.host_cpus
        );
        assert!(topo.numa_nodes >= 1);
        assert_eq!(topo.devices.len(), 2);
        for d in &topo.devices {
            assert_eq!(d.numa_node, None);
            assert_eq!(d.cpus.len(), topo.host_cpus);
            assert!(topo.note.contains(&d.pci_bus_id), "{}", topo.note);
        }
        assert!(topo.note.contains("no PCI device"), "{}", topo.note);
    }

    /// A real PCI device of this host, if hwloc sees any, is placed: its
    /// CPUs are a non-empty subset of the host's and the note is clean.
    #[cfg(feature = "hwloc")]
    #[test]
    fn hwloc_discover_places_a_real_pci_device() {
        use hwlocality::object::attributes::ObjectAttributes;
        let hw = hwlocality::Topology::builder()
            .with_io_type_filter(hwlocality::topology::builder::TypeFilter::KeepAll)
            .expect("io filter")
            .build()
            .expect("hwloc topology");
        let Some(bus_id) = hw.pci_devices().find_map(|o| match o.attributes() {
            Some(ObjectAttributes::PCIDevice(p)) => Some(format!(
                "{:04x}:{:02x}:{:02x}.{:x}",
                p.domain(),
                p.bus_id(),
                p.bus_device(),
                p.function()
            )),
            _ => None,
        }) else {
            eprintln!("hwloc sees no PCI device here; nothing to place");
            return;
        };
        let mut info = sim_devices(1).remove(0);
        info.pci_bus_id = bus_id.clone();
        let topo = discover(std::slice::from_ref(&info));
        let all = discover(&[]);
        assert_eq!(topo.source, "hwloc");
        let d = &topo.devices[0];
        assert!(!d.cpus.is_empty());
        assert!(d.cpus.len() <= all.host_cpus);
        assert!(
            !topo.note.contains("no PCI device"),
            "{bus_id}: {}",
            topo.note
        );
        if topo.numa_nodes == 1 {
            assert!(d.numa_node.is_some(), "{bus_id}: {topo}");
        }
        eprintln!("{topo}");
    }
}
