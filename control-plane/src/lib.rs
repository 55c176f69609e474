//! punchclock control plane: store, election, scheduling, dispatch and the
//! gRPC services. See `control-plane/README.md` for the module map.

pub mod clock;
pub mod config;
pub mod error;
pub mod model;
pub mod repo;
pub mod schedule;
pub mod store;

pub use error::{Error, Result};
pub mod api;
pub mod auth;
pub mod bootstrap;
pub mod conns;
pub mod dispatch;
pub mod election;
pub mod engine;
pub mod events;
pub mod http;
pub mod metrics;
pub mod notify;
pub mod service;
pub mod stats;
pub mod telemetry;
pub mod timing;
pub mod ui;
pub mod views;
pub mod watch;
pub mod worker;
