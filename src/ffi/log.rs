//! `GPUPOOL_LOG` for C and Python callers: a small `tracing` subscriber
//! that prints gpupool's events on stderr, installed by the first
//! `gpupool_init` when the variable is set.
//!
//! The filter is a comma list of directives in `EnvFilter`'s basic form:
//! a level (`info`), or a target prefix and a level (`gpupool=debug`,
//! `gpupool::pool=trace`). An event is shown when the most specific
//! directive whose target is a prefix of the event's target (a level alone
//! matches every target) allows its level; an event no directive matches
//! is not shown. Levels: `off`, `error`, `warn`, `info`, `debug`, `trace`.
//! Anything else is an error naming the directive, so a typo never
//! silently turns logging off.
//!
//! The library has no logging framework of its own to offer: a Rust
//! program that embeds gpupool installs its own subscriber (the `gpupool`
//! tool uses `tracing-subscriber`), and then this one is never installed.

use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};

/// A parsed `GPUPOOL_LOG` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Filter {
    /// `(target prefix, level)`, most specific first; `""` matches all.
    directives: Vec<(String, LevelFilter)>,
}

impl Filter {
    /// Parses a comma list of `level` or `target=level` directives.
    pub(super) fn parse(s: &str) -> Result<Filter, String> {
        let mut directives = Vec::new();
        for d in s.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let (target, level) = match d.split_once('=') {
                Some((t, l)) => (t.trim(), l.trim()),
                None => ("", d),
            };
            let level = level.parse::<LevelFilter>().map_err(|_| {
                format!("{d:?}: not a level (off, error, warn, info, debug, trace)")
            })?;
            if target.contains(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
                return Err(format!(
                    "{d:?}: a target is a module path such as gpupool::pool"
                ));
            }
            directives.push((target.to_string(), level));
        }
        // Longest prefix first; among equals the last one written wins.
        directives.reverse();
        directives.sort_by_key(|d| std::cmp::Reverse(d.0.len()));
        Ok(Filter { directives })
    }

    /// The level allowed for `target`: that of the most specific matching
    /// directive, `OFF` where none matches.
    fn level_for(&self, target: &str) -> LevelFilter {
        self.directives
            .iter()
            .find(|(t, _)| {
                target.starts_with(t.as_str())
                    && (t.is_empty()
                        || target.len() == t.len()
                        || target[t.len()..].starts_with("::"))
            })
            .map_or(LevelFilter::OFF, |&(_, l)| l)
    }

    fn max_level(&self) -> LevelFilter {
        self.directives
            .iter()
            .map(|&(_, l)| l)
            .max()
            .unwrap_or(LevelFilter::OFF)
    }
}

/// Prints enabled events as `LEVEL target: message key=value ...` lines on
/// stderr. Spans are only numbered: their fields are not printed.
struct StderrLog {
    filter: Filter,
    next_span: AtomicU64,
}

impl Subscriber for StderrLog {
    fn register_callsite(&self, m: &'static Metadata<'static>) -> Interest {
        if self.enabled(m) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, m: &Metadata<'_>) -> bool {
        *m.level() <= self.filter.level_for(m.target())
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.filter.max_level())
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.next_span.fetch_add(1, Ordering::Relaxed))
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, e: &Event<'_>) {
        let m = e.metadata();
        let mut line = Line(format!("{:>5} {}:", m.level(), m.target()));
        e.record(&mut line);
        line.0.push('\n');
        // Nothing useful can be done when stderr is gone.
        let _ = std::io::stderr().lock().write_all(line.0.as_bytes());
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// One event's text, its fields appended by [`Visit`].
struct Line(String);

impl Visit for Line {
    fn record_str(&mut self, f: &Field, v: &str) {
        if f.name() == "message" {
            let _ = write!(self.0, " {v}");
        } else {
            let _ = write!(self.0, " {}={v}", f.name());
        }
    }

    fn record_debug(&mut self, f: &Field, v: &dyn fmt::Debug) {
        if f.name() == "message" {
            let _ = write!(self.0, " {v:?}");
        } else {
            let _ = write!(self.0, " {}={v:?}", f.name());
        }
    }
}

/// Installs the stderr subscriber for `filter` as the process's global
/// default; `false` where the process already has one (a host program's
/// own, or an earlier install), which is kept.
pub(super) fn install(filter: Filter) -> bool {
    let sub = StderrLog {
        filter,
        next_span: AtomicU64::new(1),
    };
    tracing::subscriber::set_global_default(sub).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_specific_directive_decides() {
        let f = Filter::parse("warn, gpupool=info ,gpupool::pool=trace").unwrap();
        assert_eq!(f.level_for("gpupool::pool::heap"), LevelFilter::TRACE);
        assert_eq!(f.level_for("gpupool::ffi"), LevelFilter::INFO);
        assert_eq!(f.level_for("gpupool"), LevelFilter::INFO);
        // A prefix matches whole path segments only.
        assert_eq!(f.level_for("gpupoolx"), LevelFilter::WARN);
        assert_eq!(f.level_for("other"), LevelFilter::WARN);
        assert_eq!(f.max_level(), LevelFilter::TRACE);
    }

    #[test]
    fn unmatched_targets_are_off_and_bad_directives_are_errors() {
        let f = Filter::parse("gpupool=info").unwrap();
        assert_eq!(f.level_for("hyper"), LevelFilter::OFF);
        assert_eq!(Filter::parse("").unwrap().max_level(), LevelFilter::OFF);
        for bad in ["loud", "gpupool=loud", "gpupool[span]=info", "a b=info"] {
            let e = Filter::parse(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_last_of_equal_directives_wins() {
        let f = Filter::parse("gpupool=error,gpupool=debug").unwrap();
        assert_eq!(f.level_for("gpupool::pool"), LevelFilter::DEBUG);
    }
}
