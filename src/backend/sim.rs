//! The simulator backend (placeholder while it is written).
