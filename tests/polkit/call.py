#!/usr/bin/python3
# Calls the agent on the system bus as whoever runs it (Debian's python3-dbus).
# Prints "OK <summary>" (exit 0) or "ERR <error name> <message>" (exit 1).
#   call.py EnsureNetwork ID | ReleaseNetwork ID | ReconcileNetwork ID |
#           GetNetwork ID | ListNetworks | Health | OpenTap ID | Property NAME
#           (OpenTap: "OK fd N /dev/net/tun iff: TAP", what the fd is attached to)
#   call.py --interactive EnsureNetwork ID
#           the same through GDBus with ALLOW_INTERACTIVE_AUTHORIZATION set
#           (python3-dbus cannot set that header flag)
#   call.py --varlink SOCKET METHOD [ID]
#           the same method over the agent's varlink socket
#   call.py --varlink-orphan SOCKET METHOD [ID]
#           the same, called by a child after the process that connected
#           (and made one call, so the agent has identified it) exited
#   call.py ObjectGet ID NAME | ObjectGetAll ID | ManagedObjects |
#           ManagerGetAll | Introspect PATH
#           reads through the object tree (per-network objects, the
#           ObjectManager, introspection)
#   call.py --signals SECONDS
#           subscribes to every signal the agent sends for SECONDS and
#           prints "OK n=N members..." (what reached this process)
#   call.py --all-signals SECONDS
#           subscribes to every signal on the bus whoever sends it (no sender
#           filter: also what a connection sends before it owns a name) and
#           prints "OK n=N members... added=PATHS" for the signals on
#           /org/cube/NetworkAgent paths (PATHS: the objects
#           InterfacesAdded announced, or -)
import os
import sys

import dbus

I = "org.cube.NetworkAgent"
m, args = sys.argv[1], sys.argv[2:]
if m in ("--varlink", "--varlink-orphan"):
    import json
    import socket

    path, method = args[0], args[1]
    params = {"sandbox_id": args[2]} if len(args) > 2 else {}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)

    def call():
        s.sendall(json.dumps({"method": I + "." + method, "parameters": params}).encode() + b"\0")
        buf = b""
        while not buf.endswith(b"\0"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return json.loads(buf.rstrip(b"\0"))

    if m == "--varlink-orphan":
        # The process that connected makes one call (so the agent has
        # accepted and identified it), exits; a child calls on its
        # connection once it is gone (its pid could then be another
        # process's).
        call()
        parent = os.getpid()
        if os.fork() != 0:
            os._exit(0)
        while os.getppid() == parent:
            import time
            time.sleep(0.01)
    r = call()
    if "error" in r:
        print("ERR", r["error"], r.get("parameters", {}).get("message", ""))
        sys.exit(1)
    p = r.get("parameters", {})
    if "network" in p:
        print("OK", p["network"]["sandbox_id"], p["network"]["sandbox_ip"])
    elif "networks" in p:
        print("OK", ",".join(sorted(n["sandbox_id"] for n in p["networks"])) or "-")
    else:
        print("OK", json.dumps(p, sort_keys=True))
    sys.exit(0)
if m == "--signals":
    from gi.repository import Gio, GLib

    bus = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
    seen = []
    bus.signal_subscribe(I, None, None, None, None, Gio.DBusSignalFlags.NONE,
                         lambda c, snd, path, iface, member, params: seen.append(member))
    print("READY", flush=True)
    loop = GLib.MainLoop()
    GLib.timeout_add(int(float(args[0]) * 1000), loop.quit)
    loop.run()
    print("OK n=%d %s" % (len(seen), ",".join(sorted(set(seen))) or "-"))
    sys.exit(0)
if m == "--all-signals":
    from gi.repository import Gio, GLib

    bus = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
    seen, added = [], []

    def on_signal(c, snd, path, iface, member, params):
        if not path.startswith("/org/cube/NetworkAgent"):
            return
        seen.append(member)
        if member == "InterfacesAdded":
            added.append(params.unpack()[0].rsplit("/", 1)[-1])

    bus.signal_subscribe(None, None, None, None, None, Gio.DBusSignalFlags.NONE, on_signal)
    print("READY", flush=True)
    loop = GLib.MainLoop()
    GLib.timeout_add(int(float(args[0]) * 1000), loop.quit)
    loop.run()
    print("OK n=%d %s added=%s" % (len(seen), ",".join(sorted(set(seen))) or "-",
                                   ",".join(sorted(added)) or "-"))
    sys.exit(0)
if m == "--interactive":
    from gi.repository import Gio, GLib

    bus = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
    try:
        r = bus.call_sync(I, "/org/cube/NetworkAgent", I, args[0],
                          GLib.Variant("(sa{sv})", (args[1], {})), None,
                          Gio.DBusCallFlags.ALLOW_INTERACTIVE_AUTHORIZATION, -1, None)
        print("OK", r.unpack()[0]["sandbox_id"])
    except GLib.Error as e:
        name = Gio.DBusError.get_remote_error(e)
        Gio.DBusError.strip_remote_error(e)
        print("ERR", name, e.message)
        sys.exit(1)
    sys.exit(0)
try:
    o = dbus.SystemBus().get_object(I, "/org/cube/NetworkAgent", introspect=False)
    if m == "EnsureNetwork":
        r = o.EnsureNetwork(args[0], dbus.Dictionary({}, signature="sv"), dbus_interface=I)
        print("OK", r["sandbox_id"], r["sandbox_ip"], r["tap_name"])
    elif m == "ReleaseNetwork":
        print("OK", bool(o.ReleaseNetwork(args[0], dbus_interface=I)))
    elif m == "ReconcileNetwork":
        print("OK checked", int(o.ReconcileNetwork(args[0], dbus_interface=I)["checked"]))
    elif m == "GetNetwork":
        print("OK", o.GetNetwork(args[0], dbus_interface=I)["sandbox_ip"])
    elif m == "ListNetworks":
        ids = sorted(str(n["sandbox_id"]) for n in o.ListNetworks(dbus_interface=I))
        print("OK", ",".join(ids) or "-")
    elif m == "Health":
        print("OK", bool(o.Health(dbus_interface=I)[0]))
    elif m == "OpenTap":
        fd = o.OpenTap(args[0], dbus_interface=I).take()
        with open("/proc/self/fdinfo/%d" % fd) as f:   # "iff:\tNAME" on a tun/tap fd
            iff = [" ".join(l.split()) for l in f if l.startswith("iff:")]
        print("OK fd", fd, os.readlink("/proc/self/fd/%d" % fd), *iff)
        os.close(fd)
    elif m == "Property":
        print("OK", o.Get(I, args[0], dbus_interface="org.freedesktop.DBus.Properties"))
    elif m == "ManagerGetAll":
        props = o.GetAll(I, dbus_interface="org.freedesktop.DBus.Properties")
        print("OK", ",".join(sorted(str(k) for k in props)))
    elif m in ("ObjectGet", "ObjectGetAll"):
        # sd_bus_path_encode: bytes outside [A-Za-z0-9] (and a leading digit) as _xx
        esc = "".join(c if c.isascii() and c.isalnum() and not (i == 0 and c.isdigit())
                      else "_%02x" % ord(c) for i, c in enumerate(args[0]))
        n = dbus.SystemBus().get_object(I, "/org/cube/NetworkAgent/network/" + esc,
                                        introspect=False)
        P = "org.freedesktop.DBus.Properties"
        if m == "ObjectGet":
            print("OK", n.Get(I + ".Network", args[1], dbus_interface=P))
        else:
            print("OK", n.GetAll(I + ".Network", dbus_interface=P)["SandboxIp"])
    elif m == "ManagedObjects":
        objs = o.GetManagedObjects(dbus_interface="org.freedesktop.DBus.ObjectManager")
        ids = sorted(str(v[I + ".Network"]["SandboxId"]) for v in objs.values()
                     if I + ".Network" in v)
        print("OK", ",".join(ids) or "-")
    elif m == "Introspect":
        x = dbus.SystemBus().get_object(I, args[0], introspect=False)
        xml = x.Introspect(dbus_interface="org.freedesktop.DBus.Introspectable")
        import re
        print("OK", ",".join(sorted(re.findall(r'<node name="([^"]+)"', xml))) or "-")
    else:
        sys.exit("unknown method " + m)
except dbus.DBusException as e:
    print("ERR", e.get_dbus_name(), e.get_dbus_message())
    sys.exit(1)
