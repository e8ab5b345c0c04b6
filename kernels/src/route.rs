//! Which route every op takes: this crate's loops over host memory, or MLX's own ops.
//!
//! The loops read and write an array's data in place, which is only possible where MLX keeps
//! it in host memory: when MLX computes on the CPU. Elsewhere (Metal, CUDA) every op is MLX's.
//! `HOST_KERNELS=mlx` takes MLX's ops on the CPU too, so that the route a GPU or a Mac runs is
//! the one tested on any machine; each copy of this crate in the process (the host's and each
//! plugin's) reads the same variable and takes the same route.

use std::sync::OnceLock;

use mlx_rs::{Device, DeviceType};

/// The variable that picks the route: `auto` (or unset), `cpu` or `mlx`.
pub const KERNELS_ENV: &str = "HOST_KERNELS";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// This crate's loops wherever they apply, MLX's ops for the rest.
    Cpu,
    /// MLX's ops for everything.
    Mlx,
}

/// The route in use and why, in words (what `host doctor` prints).
#[derive(Clone, Debug)]
pub struct Choice {
    pub route: Route,
    pub why: String,
    /// Whether MLX computes on the CPU (whichever route serves the ops).
    pub device_is_cpu: bool,
}

/// What a value of [`KERNELS_ENV`] asks for: `None` for auto.
fn asked(value: Option<&str>) -> Result<Option<Route>, String> {
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(None),
        Some("cpu") => Ok(Some(Route::Cpu)),
        Some("mlx") => Ok(Some(Route::Mlx)),
        Some(other) => Err(format!("{KERNELS_ENV}={other:?} is not a route; use auto, cpu or mlx")),
    }
}

/// Refuses a value of [`KERNELS_ENV`] that names no route (the host checks it at start-up).
pub fn check_env() -> Result<(), String> {
    asked(std::env::var(KERNELS_ENV).ok().as_deref()).map(|_| ())
}

/// The route for what was asked and where MLX computes.
fn choose(asked: Result<Option<Route>, String>, device: Option<DeviceType>) -> Choice {
    let on_cpu = matches!(device, Some(DeviceType::Cpu));
    let device = match device {
        Some(DeviceType::Cpu) => "the CPU",
        Some(DeviceType::Gpu) => "the GPU",
        None => "an unknown device",
    };
    let (route, why) = match asked {
        Ok(Some(Route::Mlx)) => (Route::Mlx, format!("{KERNELS_ENV}=mlx asks for MLX's ops")),
        Ok(Some(Route::Cpu)) if on_cpu => (Route::Cpu, format!("{KERNELS_ENV}=cpu, and MLX computes on {device}")),
        Ok(Some(Route::Cpu)) => {
            (Route::Mlx, format!("{KERNELS_ENV}=cpu, but MLX computes on {device}, whose memory the loops cannot read"))
        }
        Ok(None) if on_cpu => (Route::Cpu, format!("MLX computes on {device}")),
        Ok(None) => (Route::Mlx, format!("MLX computes on {device}")),
        Err(e) => (Route::Mlx, e),
    };
    Choice { route, why, device_is_cpu: on_cpu }
}

/// The route this process takes, decided on first use.
pub fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let device = Device::try_default().ok().and_then(|d| d.get_type().ok());
        choose(asked(std::env::var(KERNELS_ENV).ok().as_deref()), device)
    })
}

/// Whether MLX computes on the CPU (whichever route serves the ops).
pub fn device_is_cpu() -> bool {
    choice().device_is_cpu
}

/// Whether this crate's loops serve the ops they cover: MLX computes on the CPU and
/// [`KERNELS_ENV`] does not ask for MLX's ops.
pub fn on_cpu() -> bool {
    choice().route == Route::Cpu
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loops_serve_only_a_cpu_device_and_only_when_not_asked_for_mlx() {
        let cpu = Some(DeviceType::Cpu);
        let gpu = Some(DeviceType::Gpu);
        for (value, device, route) in [
            (None, cpu, Route::Cpu),
            (Some("auto"), cpu, Route::Cpu),
            (Some("cpu"), cpu, Route::Cpu),
            (Some("mlx"), cpu, Route::Mlx),
            (None, gpu, Route::Mlx),
            (Some("cpu"), gpu, Route::Mlx),
            (Some("mlx"), gpu, Route::Mlx),
            (None, None, Route::Mlx),
        ] {
            let choice = choose(asked(value), device);
            assert_eq!(choice.route, route, "{value:?} on {device:?}: {}", choice.why);
        }
    }

    #[test]
    fn an_unknown_route_is_refused_by_name() {
        let e = asked(Some("metal")).unwrap_err();
        assert!(e.contains("\"metal\"") && e.contains("auto, cpu or mlx"), "{e}");
        assert!(asked(Some(" mlx ")).is_ok());
    }
}
