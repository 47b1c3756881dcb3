//! Device topology (being written).
