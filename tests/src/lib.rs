//! Helpers for punchclock's end-to-end tests: start real `punchclock`
//! processes on free loopback ports, talk to them over real gRPC, and wait
//! on events (not on sleeps).
