//! Real message brokers for tests, from Debian's packages: a RabbitMQ node
//! (`rabbitmq-server`) and a NATS server with JetStream (`nats-server`),
//! each on free loopback ports with its own node name, data directory and
//! config, stopped when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::etcd::free_port;

/// Debian's RabbitMQ launcher (run directly: the `/usr/sbin` wrapper
/// switches to the `rabbitmq` user and its system directories).
const RABBITMQ: &str = "/usr/lib/rabbitmq/bin/rabbitmq-server";

fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A RabbitMQ node.
pub struct Rabbit {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// AMQP port on 127.0.0.1.
    pub port: u16,
    dist_port: u16,
    node: String,
    conf: String,
}

impl Rabbit {
    /// Starts a node with `extra` lines of `rabbitmq.conf` (e.g.
    /// `consumer_timeout = 10000`) and waits until it takes connections.
    pub async fn start(extra: &str) -> Rabbit {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let dist_port = free_port();
        let node = format!("pc{port}@localhost");
        let conf = format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{extra}\n");
        let mut r = Rabbit { child: None, dir, port, dist_port, node, conf };
        r.launch().await;
        r
    }

    async fn launch(&mut self) {
        let d = self.dir.path();
        std::fs::write(d.join("rabbit.conf"), &self.conf).expect("rabbit.conf");
        std::fs::write(d.join("enabled_plugins"), "[].\n").expect("enabled_plugins");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join("rabbit.log")).expect("log");
        use std::os::unix::process::CommandExt;
        let child = Command::new(RABBITMQ)
            .env("HOME", d)
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("rabbit"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .env("RABBITMQ_LOGS", "-")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {RABBITMQ} (install rabbitmq-server: make deps): {e}"));
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(c) = lapin::Connection::connect(&self.url(), lapin::ConnectionProperties::default()).await {
                let _ = c.close(200, "ready".into()).await;
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "RabbitMQ did not start: {}", self.log());
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `amqp://127.0.0.1:PORT/%2f` (the default vhost, guest allowed on loopback).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The node's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("rabbit.log")).unwrap_or_default()
    }

    /// Kills the node (SIGKILL): a broker that goes away.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c);
        }
    }

    /// Starts it again on the same ports and data (durable queues come back).
    pub async fn restart(&mut self) {
        self.kill();
        self.launch().await;
    }

    /// A connection and a channel.
    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let c = lapin::Connection::connect(&self.url(), lapin::ConnectionProperties::default()).await.expect("connect to RabbitMQ");
        let ch = c.create_channel().await.expect("channel");
        (c, ch)
    }

    /// Declares a durable queue (with `x-max-priority` 10).
    pub async fn declare(&self, queue: &str) {
        let (_c, ch) = self.channel().await;
        let mut args = lapin::types::FieldTable::default();
        args.insert("x-max-priority".into(), lapin::types::AMQPValue::ShortShortUInt(10));
        ch.queue_declare(queue.into(), lapin::options::QueueDeclareOptions { durable: true, ..Default::default() }, args)
            .await
            .expect("queue_declare");
    }

    /// Messages ready in `queue` (not counting unacknowledged ones).
    pub async fn ready(&self, queue: &str) -> u32 {
        let (_c, ch) = self.channel().await;
        let q = ch
            .queue_declare(queue.into(), lapin::options::QueueDeclareOptions { passive: true, ..Default::default() }, Default::default())
            .await
            .expect("passive declare");
        q.message_count()
    }

    /// `rabbitmqctl ARGS` against this node.
    pub fn ctl(&self, args: &[&str]) -> String {
        let out = Command::new("/usr/lib/rabbitmq/bin/rabbitmqctl")
            .args(["-n", &self.node])
            .args(args)
            .env("HOME", self.dir.path())
            .output()
            .expect("rabbitmqctl");
        String::from_utf8_lossy(&out.stdout).to_string()
    }
}

impl Drop for Rabbit {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A persistent publisher on one channel, with publisher confirms.
pub struct Publisher {
    _conn: lapin::Connection,
    ch: lapin::Channel,
}

impl Publisher {
    /// Opens it.
    pub async fn new(rabbit: &Rabbit) -> Publisher {
        let (conn, ch) = rabbit.channel().await;
        ch.confirm_select(Default::default()).await.expect("confirm_select");
        Publisher { _conn: conn, ch }
    }

    /// Publishes `body` to `queue` (persistent, with `message_id` and
    /// `priority` when given) and waits for the broker's confirm.
    pub async fn publish(&self, queue: &str, body: &[u8], message_id: Option<&str>, priority: Option<u8>) {
        let mut props = lapin::BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = message_id {
            props = props.with_message_id(id.into());
        }
        if let Some(p) = priority {
            props = props.with_priority(p);
        }
        self.ch.basic_publish("".into(), queue.into(), Default::default(), body, props).await.expect("publish").await.expect("confirm");
    }
}

impl Publisher {
    /// Publishes each `(body, message_id)` to `queue` (persistent), then
    /// waits for every confirm: as fast as the broker takes them.
    pub async fn publish_all(&self, queue: &str, messages: impl IntoIterator<Item = (Vec<u8>, String)>) {
        let mut confirms = Vec::new();
        for (body, id) in messages {
            let props = lapin::BasicProperties::default().with_delivery_mode(2).with_message_id(id.into());
            confirms.push(self.ch.basic_publish("".into(), queue.into(), Default::default(), &body, props).await.expect("publish"));
        }
        for c in confirms {
            c.await.expect("confirm");
        }
    }
}

/// A NATS server with JetStream.
pub struct Nats {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Client port on 127.0.0.1.
    pub port: u16,
}

impl Nats {
    /// Starts it (JetStream on, its store in a temporary directory) and
    /// waits until it takes connections.
    pub async fn start() -> Nats {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let mut n = Nats { child: None, dir, port };
        n.launch().await;
        n
    }

    async fn launch(&mut self) {
        let d = self.dir.path();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(d.join("nats.log")).expect("log");
        use std::os::unix::process::CommandExt;
        let store: PathBuf = d.join("js");
        let child = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js", "-sd"])
            .arg(&store)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn nats-server (install nats-server: make deps): {e}"));
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if async_nats::connect(self.url()).await.is_ok() {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "nats-server did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills it (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(&mut c);
        }
    }

    /// Starts it again on the same port and store.
    pub async fn restart(&mut self) {
        self.kill();
        self.launch().await;
    }

    /// A JetStream context.
    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::new(async_nats::connect(self.url()).await.expect("connect to NATS"))
    }

    /// Creates stream `name` over `subjects`.
    pub async fn stream(&self, name: &str, subjects: &[&str]) {
        let js = self.jetstream().await;
        js.get_or_create_stream(async_nats::jetstream::stream::Config {
            name: name.into(),
            subjects: subjects.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        })
        .await
        .expect("create stream");
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.kill();
    }
}
