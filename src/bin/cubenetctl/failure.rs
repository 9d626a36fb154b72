//! What ends a run: an exit status (a contract for scripts, listed in
//! `--help` and the man page) and the message printed as
//! `cubenetctl: MESSAGE` on stderr.

/// Success (health: healthy).
pub const EXIT_OK: u8 = 0;
/// The agent returned an error (health: degraded; reconcile: the report
/// lists errors).
pub const EXIT_AGENT: u8 = 1;
/// Usage error.
pub const EXIT_USAGE: u8 = 2;
/// No such network.
pub const EXIT_NOT_FOUND: u8 = 3;
/// The agent is unreachable (no bus or socket, name not owned, denied).
pub const EXIT_UNREACHABLE: u8 = 4;

#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub msg: String,
}

impl Failure {
    pub fn new(code: u8, msg: impl Into<String>) -> Failure {
        Failure {
            code,
            msg: msg.into(),
        }
    }

    /// A usage error, with a pointer to the help.
    pub fn usage(msg: impl Into<String>) -> Failure {
        Failure::new(
            EXIT_USAGE,
            format!("{} (see 'cubenetctl --help')", msg.into()),
        )
    }

    /// Every line of the message with the `cubenetctl: ` prefix, so that
    /// each line on stderr says where it came from.
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        let msg = if self.msg.is_empty() {
            "failed"
        } else {
            self.msg.as_str()
        };
        msg.lines().map(|l| format!("cubenetctl: {l}"))
    }
}

pub type Res<T> = Result<T, Failure>;

/// Where the example polkit rule is: the installed copy (`make install`),
/// else the source tree's (a quick start from a checkout).
const RULES_EXAMPLES: [&str; 2] = [
    "/usr/share/doc/cube-network-agent/50-cube-network-agent.rules.example",
    "/usr/local/share/doc/cube-network-agent/50-cube-network-agent.rules.example",
];

/// The hint after a refusal: what grants access and where the example is.
pub fn access_hint() -> String {
    let example = RULES_EXAMPLES
        .iter()
        .find(|p| std::path::Path::new(p).exists())
        .copied()
        .unwrap_or("polkit/50-cube-network-agent.rules.example in the agent's source");
    format!(
        " (root may do everything; other users need a polkit grant of \
         org.cube.NetworkAgent.read or .manage: copy {example} to /etc/polkit-1/rules.d/ \
         and edit its group)"
    )
}

/// What a command asks `main` to do once its connection is closed.
pub enum Outcome {
    Exit(u8),
    /// `open-tap`: exec the command with the TAPs on fds 3, 4, ...
    Exec(Vec<std::os::fd::OwnedFd>, Vec<String>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_is_prefixed() {
        let f = Failure::new(EXIT_AGENT, "Failed: one\ntwo");
        let l: Vec<String> = f.lines().collect();
        assert_eq!(l, ["cubenetctl: Failed: one", "cubenetctl: two"]);
        assert_eq!(
            Failure::usage("x").msg,
            "x (see 'cubenetctl --help')",
            "usage errors point at the help"
        );
    }
}
