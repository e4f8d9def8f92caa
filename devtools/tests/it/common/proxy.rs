//! A userspace TCP proxy in front of one node's port. It refuses, and cuts,
//! connections whose source IP is blocked: a network partition made from
//! outside the node, which never cooperates with it.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;

use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tokio::sync::watch;

pub struct Proxy {
    pub addr: String,
    blocked: Arc<Mutex<HashSet<IpAddr>>>,
    changed: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let blocked: Arc<Mutex<HashSet<IpAddr>>> = Arc::default();
        let (changed, rx) = watch::channel(0u64);
        let target = target.to_string();
        let b = blocked.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((inbound, peer)) = listener.accept().await else {
                    return;
                };
                if b.lock().unwrap().contains(&peer.ip()) {
                    drop(inbound);
                    continue;
                }
                let target = target.clone();
                let b = b.clone();
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(&target).await else {
                        return;
                    };
                    let _ = inbound.set_nodelay(true);
                    let _ = outbound.set_nodelay(true);
                    let mut inbound = inbound;
                    let cut = async {
                        loop {
                            if rx.changed().await.is_err() {
                                return;
                            }
                            if b.lock().unwrap().contains(&peer.ip()) {
                                return;
                            }
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut => {}
                    }
                });
            }
        });
        Proxy {
            addr,
            blocked,
            changed,
            task,
        }
    }

    pub fn block(&self, ip: IpAddr) {
        self.blocked.lock().unwrap().insert(ip);
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn unblock_all(&self) {
        self.blocked.lock().unwrap().clear();
        self.changed.send_modify(|v| *v += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
