//! Configuration (placeholder while it is written).
/// Which backend.
#[derive(Debug, Clone)]
pub enum BackendKind {}
/// Pool config.
#[derive(Debug, Clone, Default)]
pub struct PoolConfig;
/// Sim config.
#[derive(Debug, Clone, Default)]
pub struct SimConfig;
