//! Devices as llama.cpp names them (`CPU`, `CUDA0`, `CUDA1`, ...), their memory budgets, and the
//! size and layer-count values of the placement flags.

use crate::{Error, Result};
use serde::{Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
pub const TIB: u64 = 1 << 40;

/// Where a tensor, a KV cache or a compute buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// A CUDA GPU by ordinal. Sorts before the CPU so reports list GPUs first.
    Cuda(u32),
    Cpu,
}

impl Device {
    /// `CPU` or `CUDA<n>` (case-insensitive, as typed on a command line); `None` for anything else.
    pub fn parse(s: &str) -> Option<Device> {
        if s.eq_ignore_ascii_case("cpu") {
            return Some(Device::Cpu);
        }
        let n = s.get(..4).filter(|p| p.eq_ignore_ascii_case("cuda")).and_then(|_| s.get(4..))?;
        // Only plain decimal digits: `CUDA+1` or `CUDA 1` are not device names.
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        n.parse().ok().map(Device::Cuda)
    }

    pub fn is_gpu(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("CPU"),
            Device::Cuda(n) => write!(f, "CUDA{n}"),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A GPU and the bytes of its memory the plan may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuBudget {
    pub device: Device,
    pub bytes: u64,
}

impl GpuBudget {
    /// Parses `--gpu CUDA0=96GiB`.
    pub fn parse(arg: &str) -> Result<GpuBudget> {
        let bad = |msg: &str| Error::bad_value("--gpu", arg, msg);
        let Some((name, size)) = arg.split_once('=') else {
            return Err(bad("expected CUDA<n>=SIZE, e.g. CUDA0=96GiB"));
        };
        let device = match Device::parse(name.trim()) {
            Some(d @ Device::Cuda(_)) => d,
            Some(Device::Cpu) => return Err(bad("the CPU is not a GPU; size host memory with --host-memory")),
            None => return Err(bad(&format!("'{name}' is not a GPU name; use CUDA0, CUDA1, ..."))),
        };
        let bytes = parse_size(size.trim()).map_err(|msg| bad(&msg))?;
        if bytes == 0 {
            return Err(bad("a GPU with 0 bytes of memory holds nothing"));
        }
        Ok(GpuBudget { device, bytes })
    }

    /// Parses every `--gpu` argument; a GPU declared twice is an error.
    pub fn parse_all<S: AsRef<str>>(args: &[S]) -> Result<Vec<GpuBudget>> {
        let mut out: Vec<GpuBudget> = Vec::with_capacity(args.len());
        for a in args {
            let g = GpuBudget::parse(a.as_ref())?;
            if out.iter().any(|o| o.device == g.device) {
                return Err(Error::bad_value("--gpu", a.as_ref(), format!("{} is declared twice", g.device)));
            }
            out.push(g);
        }
        out.sort_by_key(|g| g.device);
        Ok(out)
    }
}

/// Parses a byte size: `96GiB`, `96G` (both binary), `80GB` (decimal), `512MiB`, `1024` (bytes).
/// Fractions are allowed (`1.5GiB`). The error is the message only; callers add the flag.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!("'{s}' is not a size (e.g. 96GiB, 80GB, 1048576)"));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => KIB,
        "m" | "mib" => MIB,
        "g" | "gib" => GIB,
        "t" | "tib" => TIB,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(format!("unknown unit '{unit}' (use B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB)")),
    };
    let value: f64 = num.parse().map_err(|_| format!("'{s}' is not a size (e.g. 96GiB, 80GB, 1048576)"))?;
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("'{s}' is too large"));
    }
    Ok(bytes.round() as u64)
}

/// Bytes with two decimals in the largest binary unit (KiB to GiB) that keeps the number >= 1.
pub fn human(bytes: u64) -> String {
    in_unit(bytes, unit_for(bytes))
}

/// The unit [`human`] picks for `bytes`: (bytes per unit, name).
pub fn unit_for(bytes: u64) -> (u64, &'static str) {
    match bytes {
        b if b >= GIB => (GIB, "GiB"),
        b if b >= MIB => (MIB, "MiB"),
        _ => (KIB, "KiB"),
    }
}

/// Bytes in a given unit, for tables whose rows share one unit.
pub fn in_unit(bytes: u64, (per, name): (u64, &str)) -> String {
    format!("{:.2} {name}", bytes as f64 / per as f64)
}

/// The value of `-ngl / --n-gpu-layers`: a count, `all`, or `auto` (let `--fit` decide).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuLayers {
    Auto,
    All,
    Count(u32),
}

impl FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<GpuLayers, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(GpuLayers::Auto),
            "all" => Ok(GpuLayers::All),
            // llama.cpp takes -1 for "all" (its default before --fit).
            "-1" => Ok(GpuLayers::All),
            n => n.parse().map(GpuLayers::Count).map_err(|_| format!("'{s}' is not a layer count, 'all' or 'auto'")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        assert_eq!(Device::parse("CPU"), Some(Device::Cpu));
        assert_eq!(Device::parse("cuda1"), Some(Device::Cuda(1)));
        assert_eq!(Device::parse("CUDA12"), Some(Device::Cuda(12)));
        for bad in ["CUDA", "CUDA+1", "GPU0", "", "CUDA0x", "cu"] {
            assert_eq!(Device::parse(bad), None, "{bad}");
        }
        assert_eq!(Device::Cuda(3).to_string(), "CUDA3");
        assert!(Device::Cuda(9) < Device::Cpu);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("96GiB"), Ok(96 * GIB));
        assert_eq!(parse_size("96G"), Ok(96 * GIB));
        assert_eq!(parse_size("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 * GIB / 2));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("96XB").unwrap_err().contains("unknown unit 'XB'"));
        assert!(parse_size("GiB").unwrap_err().contains("not a size"));
        assert_eq!(human(96 * GIB + GIB / 2), "96.50 GiB");
        assert_eq!(human(3 * MIB), "3.00 MiB");
        assert_eq!(human(512), "0.50 KiB");
    }

    #[test]
    fn gpu_specs_and_their_errors() {
        assert_eq!(GpuBudget::parse("CUDA0=96GiB").unwrap(), GpuBudget { device: Device::Cuda(0), bytes: 96 * GIB });
        let e = |a: &str| GpuBudget::parse(a).unwrap_err().to_string();
        assert_eq!(e("CUDA0"), "--gpu 'CUDA0': expected CUDA<n>=SIZE, e.g. CUDA0=96GiB");
        assert_eq!(e("GPU0=8GiB"), "--gpu 'GPU0=8GiB': 'GPU0' is not a GPU name; use CUDA0, CUDA1, ...");
        assert!(e("CPU=8GiB").contains("--host-memory"));
        assert!(e("CUDA0=lots").contains("'lots' is not a size"));
        let twice = GpuBudget::parse_all(&["CUDA0=8GiB", "cuda0=9GiB"]).unwrap_err().to_string();
        assert_eq!(twice, "--gpu 'cuda0=9GiB': CUDA0 is declared twice");
        let sorted = GpuBudget::parse_all(&["CUDA1=8GiB", "CUDA0=9GiB"]).unwrap();
        assert_eq!(sorted[0].device, Device::Cuda(0));
    }

    #[test]
    fn gpu_layers_values() {
        assert_eq!("999".parse(), Ok(GpuLayers::Count(999)));
        assert_eq!("all".parse(), Ok(GpuLayers::All));
        assert_eq!("-1".parse(), Ok(GpuLayers::All));
        assert_eq!("Auto".parse(), Ok(GpuLayers::Auto));
        assert!("many".parse::<GpuLayers>().is_err());
    }
}
