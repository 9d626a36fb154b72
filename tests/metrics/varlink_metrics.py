#!/usr/bin/env python3
"""io.systemd.Metrics through the reference Python varlink client (PyPI
`varlink`, installed by scripts/deps.sh into a venv): it reads the agent's
interface descriptions with org.varlink.service.GetInterfaceDescription,
parses them with its own IDL parser and checks every reply against them.

    varlink_metrics.py SOCKET

Prints one JSON object: {"info": GetInfo, "describe": [...], "list": [...]}.
Exit status 1 (with the reason on stderr) when a call fails."""
import json
import sys

import varlink


def main():
    address = "unix:" + sys.argv[1]
    with varlink.Client(address=address) as client:
        info = client.get_interface("org.varlink.service")  # parsed IDL
        assert info is not None
        with client.open("org.varlink.service") as svc:
            got_info = dict(svc.GetInfo())
        with client.open("io.systemd.Metrics") as m:
            describe = [dict(r) for r in m.Describe(_more=True)]
            listed = [dict(r) for r in m.List(_more=True)]
    print(json.dumps({"info": got_info, "describe": describe, "list": listed}))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the reason, for the test's message
        print(f"varlink_metrics.py: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
