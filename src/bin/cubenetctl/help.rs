//! The command table and the help texts (`--help`, `COMMAND --help`). The
//! man page (man/cubenetctl.1) says the same at length; the tests check
//! that it names every command and option listed here. ASCII only: help is
//! read in every locale.

#[derive(Debug)]
pub struct CommandDef {
    pub name: &'static str,
    pub args: &'static str,
    pub summary: &'static str,
    /// What the command prints and its exit status.
    pub help: &'static str,
    /// The command's own options (after the command name); "" if none.
    pub options: &'static str,
}

/// The first entry is the default command.
pub const COMMANDS: &[CommandDef] = &[
    CommandDef {
        name: "list",
        args: "",
        summary: "List sandbox networks (the default command)",
        help: "Prints one line per network, sorted by sandbox id: SANDBOX, SANDBOX-IP,
TAP, MTU, PORTS and CNI, then 'N networks.'. No cell contains spaces:
PORTS is a comma-separated list of PROTO:CONTAINER:HOST[:HOSTIP] (the
--port syntax of 'ensure'; HOSTIP only when not 0.0.0.0), '-' if none;
CNI is CONTAINER/IFNAME@NETNS for networks made by cube-cni, '-'
otherwise. With --no-legend, only the rows: six fields split by
whitespace. With --json, an array of network objects.",
        options: "",
    },
    CommandDef {
        name: "status",
        args: "ID",
        summary: "Show everything about one network",
        help: "Prints every field of network ID as aligned 'Key: value' lines: 'IPv6
egress: no' comes with why and what opens it; Traffic counts packets as
the device does (a GSO packet once) and, for a direction with a limit,
the shaper's segments (packets on the wire, as the metrics count them).
With --json, the network object (the same object varlink's GetNetwork
returns). Exit status 3 if there is no such network.",
        options: "",
    },
    CommandDef {
        name: "ensure",
        args: "ID [OPTIONS...]",
        summary: "Create a network, or converge it to OPTIONS",
        help: "Calls EnsureNetwork and prints the resulting network like 'status'
(with --quiet nothing: the exit status says it worked; with --json the
network object). EnsureNetwork is declarative: an option left out means its default, so
repeating the command returns the same network and a changed one
converges it (same address and TAP). Errors name the option, e.g.
'--port tcp:80:8080 (port_mappings[0]): ...'.",
        options: "  --port=PROTO:CONTAINER[:HOST[:HOSTIP]]
                          Map a port (repeatable). PROTO is tcp or udp;
                          CONTAINER 1-65535; HOST 0-65535, 0 or empty: the
                          agent picks one; HOSTIP empty: the agent's default
                          bind address.
                          e.g. --port tcp:80  --port udp:53:25053:127.0.0.1
  --allow-out=CIDR|NAME   Allow egress to CIDR, or a domain pattern
                          (example.com, *.example.com) (repeatable)
  --deny-out=CIDR|NAME    Deny egress to CIDR or NAME (repeatable)
  --egress-mode=MODE      dns (default) or sni: TCP to 80/443 also goes
                          through the agent's proxy, which checks the TLS
                          SNI or HTTP Host against the names
  --egress-rate=RATE      Limit what the sandbox sends to the world,
                          bits/s with k/M/G (e.g. 100M); 0: the agent's
                          default (unlimited unless configured)
  --ingress-rate=RATE     Limit what the world sends to it, likewise
  --egress-burst=SIZE     Bytes an idle sandbox may send at once, with
                          k/M (default 64k); also --ingress-burst
  --no-internet           No internet access
  --mtu=N                 TAP MTU (default: the agent's)
  --metadata=KEY=VALUE    Attach metadata (repeatable)
  --idempotency-key=KEY   A repeat with the same key returns the stored
                          network without re-applying anything
  --clone-of=ID           A new network takes sandbox ID's spec (ports
                          get fresh host ports): a VM clone restored from
                          a snapshot of it; only --metadata,
                          --idempotency-key and --paused may come with it
  --paused                The sandbox's VM is paused: packets for it are
                          dropped, the first one of each pause reported
                          (TrafficWhilePaused); leave it out to resume
  --tap-owner=UID[:GID]   Hand the TAP over by name to a VMM running as
                          UID (in group GID): for Firecracker
                          (host_dev_name) and QEMU (ifname=); the agent
                          keeps no fd of it, open-tap is refused
  --egress-rules=FILE     Egress rules from FILE (- for stdin), a JSON
                          array: [{\"host\": \"api.example.com\",
                          \"set_headers\": {\"Authorization\": \"...\"},
                          \"methods\": [\"GET\"], \"paths\": [\"/v1\"],
                          \"plain_http\": false}]; header values are
                          secrets: keep them in a file (0600), never on a
                          command line; they are shown as sha256:DIGEST",
    },
    CommandDef {
        name: "egress-rules",
        args: "ID FILE",
        summary: "Replace a network's egress rules with FILE's",
        help: "Calls SetEgressRules: network ID's egress rules become those of FILE
(- for stdin), nothing else changes (for a CNI attachment, whose
configuration is no place for secrets: ID is cni:CONTAINER:IFNAME). FILE
is a JSON array of rules as for 'ensure --egress-rules'; [] removes
them. The file is checked before anything is sent: an unknown key or a
wrong type is named as 'FILE: [i].field'. No message and no output
carries a header's value: the agent shows each as sha256: and 12 hex
digits. Prints the network like 'status' (with --quiet nothing; with
--json the network object). Exit status 3 if there is no such network.",
        options: "",
    },
    CommandDef {
        name: "egress-ca",
        args: "",
        summary: "Print the node CA certificate of egress rules (PEM)",
        help: "Prints the certificate (PEM) of the node CA the agent signs egress
rules' hosts with, which guests must trust (the Manager property
EgressCaCertificate; also the file egress-ca.crt in the agent's state
directory). With --json, {\"certificate\": PEM}. Exit status 1 if the
egress gateway does not run.",
        options: "",
    },
    CommandDef {
        name: "release",
        args: "ID",
        summary: "Release a network",
        help: "Calls ReleaseNetwork. Prints 'released ID' (not with --quiet) and exits
0, or prints 'cubenetctl: ID: no such network' on stderr and exits 3 if
it did not exist. With --json, {\"sandbox_id\": ID, \"released\": BOOL}
(same exit status).",
        options: "",
    },
    CommandDef {
        name: "reconcile",
        args: "[ID]",
        summary: "Re-check networks against the kernel, repair drift",
        help: "Calls ReconcileNetwork for ID, or for every network without ID, and
prints the report: checked, repaired, removed, errors. Exit status 1 if
the report lists errors.",
        options: "",
    },
    CommandDef {
        name: "health",
        args: "",
        summary: "Show the agent's health checks",
        help: "Prints a CHECK / OK / DETAIL table (DETAIL is the rest of the line) and
'healthy' or 'degraded' (not with --quiet or --no-legend). Exit status 0
if healthy, 1 if degraded. With --json,
{\"healthy\": BOOL, \"checks\": [{\"name\", \"ok\", \"detail\"}...]}.",
        options: "",
    },
    CommandDef {
        name: "capacity",
        args: "",
        summary: "Show the node's headroom (for schedulers)",
        help: "Calls Capacity and prints a RESOURCE / VALUE table: networks, free
addresses, idle and creatable TAPs, free host ports, SNAT flows, flow
table and learned-address fill, bandwidth committed against the node's
totals (bits/s; a total of 0 is not set), then the node's labels. Cheap
enough to poll every second. With --json, the object Capacity returns
(the varlink type NodeCapacity).",
        options: "",
    },
    CommandDef {
        name: "open-tap",
        args: "ID... -- COMMAND [ARGS...]",
        summary: "Run COMMAND with the networks' TAPs as fds 3, 4, ...",
        help: "Calls OpenTap for each ID (a fresh duplicate of the agent's TAP fd:
IFF_TAP, IFF_NO_PI, 12-byte virtio-net header) and execs COMMAND with
the first as file descriptor 3, the next as 4, and so on, e.g.

  cubenetctl open-tap sbx-1 -- qemu-system-x86_64 -netdev tap,id=n0,fd=3,vnet_hdr=on ...
  cubenetctl open-tap sbx-1 sbx-1b -- cloud-hypervisor \\
      --net fd=3,mac=GUEST_MAC,id=net0 fd=4,mac=GUEST_MAC_B,id=net1 ...

With one ID the '--' may be left out. A network made with --tap-owner
has no fd to hand out: its VMM opens the TAP by name.

COMMAND's exit status is then the status; if COMMAND cannot be
executed: 127 (not found) or 126 (other errors).",
        options: "",
    },
    CommandDef {
        name: "metrics",
        args: "",
        summary: "Print the agent's metrics as OpenMetrics text",
        help: "Reads the agent's metrics socket (its report_socket: $CUBENETCTL_REPORT,
else /run/systemd/report/org.cube.NetworkAgent) and prints every metric
as OpenMetrics text, as Prometheus reads it: per sandbox (label
sandbox_id) bytes, packets and device drops by direction (tx = sent by
the sandbox, rx = delivered to it) and live flows; node-wide networks,
idle TAPs, free addresses, health, flow tables, datapath events and
EnsureNetwork/ReleaseNetwork latency. The same families are served to
systemd as io.systemd.Metrics. Exit status 4 if the socket cannot be
reached or reading is not allowed.",
        options: "",
    },
    CommandDef {
        name: "top",
        args: "[OPTIONS...]",
        summary: "Show the busiest sandboxes, refreshed",
        help: "Reads the agent's metrics socket (like 'metrics') every --interval
seconds and prints a table of every sandbox sorted by traffic rate:
SANDBOX, TX/s and RX/s (bytes per second sent by and delivered to the
sandbox), TXPKT/s, RXPKT/s, DROPS/s (the datapath's drops of its
packets, every reason) and FLOWS (live). On a terminal each table
replaces the last; otherwise tables follow each other, separated by an
empty line. Runs until interrupted, or --count tables. Exit status 4 if
the socket cannot be reached or reading is not allowed.",
        options: "  --interval=SECS         Seconds between tables (0.1-3600, default 2)
  --count=N               Stop after N tables",
    },
    CommandDef {
        name: "watch",
        args: "",
        summary: "Follow every change, one line per event",
        help: "Subscribes to the agent's varlink WatchNetworks stream (socket:
--varlink) and prints a header line (not with --no-legend), then one line
per event until interrupted: SEQ KIND SANDBOX SANDBOX-IP TAP PORTS
[NOTE], where KIND is current (the networks at the start, one line
each), created, updated, repaired (NOTE: what was repaired), released
('-' for the address, TAP and ports) or traffic_while_paused (NOTE: the
first packet for a paused sandbox: PROTO/PORT from REMOTE:PORT via
reply, port_mapping or host). NOTE is 'paused' for a current or created
network whose VM is paused, and 'paused' or 'resumed' for an update
that paused or resumed it. With --json, one JSON object per line: the event as varlink sends it
({\"seq\", \"kind\", \"sandbox_id\", \"network\", \"repairs\",
\"networks\", \"traffic\"}). Exit status 1 if the agent ends the stream (it stops, or
this watcher fell behind: EventsLost), 4 if the socket cannot be reached.",
        options: "",
    },
    CommandDef {
        name: "flows",
        args: "[ID] [OPTIONS...]",
        summary: "Show the flow log: connections made and refused",
        help: "Reads the agent's flow log over varlink WatchFlows (socket: --varlink):
the records the agent kept of the last hour (of sandbox ID only, with
ID), or with --follow every new record until interrupted. Prints a
header line (not with --no-legend), then one line per record: TIME
(HH:MM:SS.mmm, UTC) SANDBOX EVENT (start, end, refused) PROTO GUEST
REMOTE (IP:PORT as the guest sees them, [IPv6]:PORT) NODE (the node's
side of a translated flow, '-' if none) VERDICT (forwarded, dropped)
DETAIL (the rest of the line: why it was refused, the DNS name of the
remote address, and for an end its totals: bytes/packets sent and
received by the sandbox and its duration, e.g. 'out=1200/3 in=400/2
1.5s'; arrows for out= and in= in a UTF-8 locale). A watcher that reads
too slowly, or a sandbox whose events the datapath dropped, loses
records: '# N records lost' on stderr. With --json, one JSON object per
line: the record as varlink sends it ({\"time\", \"time_unix_ns\",
\"sandbox_id\", \"event\", \"family\", \"protocol\", \"direction\",
\"guest\", \"remote\", \"node\", \"verdict\", \"reason\",
\"dns_name\", \"totals\"}), and {\"lost\": N} for lost records. Exit
status 0 once the history is printed, 1 if the agent ends a --follow
stream, 4 if the socket cannot be reached.",
        options: "  --denied                Refused records only
  -f --follow             Follow new records (history: none unless
                          --since)
  --since=DURATION        Begin with the records of the last DURATION:
                          30s, 10m, 1h or seconds, at most 1h (default
                          1h; with --follow 0)",
    },
];

pub fn find_command(name: &str) -> Option<&'static CommandDef> {
    COMMANDS.iter().find(|c| c.name == name)
}

const OPTIONS_HELP: &str = "Options:
  -h --help               Show this help ('COMMAND --help': that command's)
  -V --version            Show the version
     --bus=BUS            system (default), session, or a D-Bus address such as
                          unix:path=/run/dbus/system_bus_socket; default from
                          $CUBENETCTL_BUS
     --varlink=PATH       The agent's varlink socket (watch, flows); default from
                          $CUBENETCTL_VARLINK, else
                          /run/cube-network-agent/org.cube.NetworkAgent
     --json=pretty|short|off
                          JSON output: pretty (indented), short (one line
                          each), off (text, the default); --json alone: short
  -j                      --json=pretty on a terminal, --json=short otherwise
  -q --quiet              No informational lines ('N networks.', 'released
                          ID', the network 'ensure' made, health's
                          verdict); errors still go to stderr
     --no-legend          No column headers and summary lines
     --no-pager           Accepted for compatibility: cubenetctl never pages";

const EXIT_HELP: &str = "Exit status:
  0  success (health: healthy)
  1  the agent returned an error, printed as 'cubenetctl: NAME: MESSAGE'
     (health: degraded; reconcile: the report lists errors)
  2  usage error
  3  no such network (NotFound, or release of a network that did not exist)
  4  the agent is unreachable (no bus or socket, name not owned, access denied)";

fn usage_line(c: &CommandDef) -> String {
    if c.args.is_empty() {
        c.name.to_owned()
    } else {
        format!("{} {}", c.name, c.args)
    }
}

pub fn main_help() -> String {
    let mut s = String::from(
        "cubenetctl [OPTIONS...] COMMAND [ARGS...]\n\n\
         Query and control cube-network-agent (org.cube.NetworkAgent).\n\nCommands:\n",
    );
    for c in COMMANDS {
        let head = usage_line(c);
        if head.len() > 22 {
            s.push_str(&format!("  {head}\n  {:22}  {}\n", "", c.summary));
        } else {
            s.push_str(&format!("  {head:22}  {}\n", c.summary));
        }
    }
    s.push('\n');
    s.push_str(OPTIONS_HELP);
    s.push_str("\n\n");
    s.push_str(EXIT_HELP);
    s.push_str("\n\nSee 'man cubenetctl' for more.\n");
    s
}

/// One command's usage, what it does and its own options; the global
/// options and the exit status table are in `cubenetctl --help`.
pub fn command_help(c: &CommandDef) -> String {
    let mut s = format!(
        "cubenetctl [OPTIONS...] {}\n\n{}.\n\n{}\n",
        usage_line(c),
        c.summary,
        c.help
    );
    if !c.options.is_empty() {
        s.push_str(&format!("\nOptions:\n{}\n", c.options));
    }
    s.push_str(
        "\nSee 'cubenetctl --help' for the global options and the exit status,\n\
         'man cubenetctl' for more.\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_is_ascii_and_commands_are_unique() {
        assert!(main_help().is_ascii());
        for c in COMMANDS {
            assert!(command_help(c).is_ascii(), "{}", c.name);
            assert_eq!(find_command(c.name).map(|f| f.name), Some(c.name));
            assert!(main_help().contains(&format!("  {}", usage_line(c))));
        }
    }

    #[test]
    fn command_help_does_not_repeat_the_global_tables() {
        for c in COMMANDS {
            let h = command_help(c);
            assert!(!h.contains("Exit status:"), "{}", c.name);
            assert!(!h.contains("--bus=BUS"), "{}", c.name);
            assert!(h.contains("cubenetctl --help"), "{}", c.name);
        }
    }
}
