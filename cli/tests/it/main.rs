//! The node's own binary, `coordinator`, as a production host runs it. The
//! behaviour of its commands is tested in depth through the development
//! binary (dtx-devtools' `tests/it`), which runs the same code from this
//! crate; here: that this binary has exactly the node's commands, and that
//! three of its processes form a cluster that decides a transaction and
//! answers `admin status`.

mod t10_node_binary;
