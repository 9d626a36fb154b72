#!/usr/bin/env bash
# `make install` / `make uninstall` into a throw-away DESTDIR, as a package
# build would: every file lands where the tools look for it, binaries are
# stripped, each man page renders with `man -l` without warnings, the
# completions load, and uninstall removes exactly what install put there.
# Needs the release binaries (cargo build --release --bins). Prints
# "ok - ..." / "not ok - ..." and "N passed, M failed"; exits non-zero on a
# failure. Touches nothing outside its temporary directory.
set -u
cd "$(dirname "$0")/../.."
PASS=0 FAIL=0
ok() { echo "ok - $*"; PASS=$((PASS + 1)); }
nok() { echo "not ok - $*"; FAIL=$((FAIL + 1)); }
D=$(mktemp -d /tmp/cube-install.XXXXXX)
trap 'rm -rf "$D"' EXIT

if out=$(make -s install NO_BUILD=1 DESTDIR="$D" 2>&1); then ok "make install DESTDIR=..."; else nok "make install: $out"; fi
want=(
  usr/libexec/cube-network-agent usr/bin/cubenetctl opt/cni/bin/cube-cni
  usr/share/man/man1/cubenetctl.1 usr/share/man/man8/cube-network-agent.8 usr/share/man/man8/cube-cni.8
  usr/share/bash-completion/completions/cubenetctl usr/share/zsh/vendor-completions/_cubenetctl
  usr/lib/systemd/system/cube-network-agent.service usr/lib/systemd/system/cube-network-agent.socket
  usr/share/dbus-1/system.d/org.cube.NetworkAgent.conf
  usr/share/dbus-1/system-services/org.cube.NetworkAgent.service
  usr/share/polkit-1/actions/org.cube.NetworkAgent.policy
  usr/share/doc/cube-network-agent/50-cube-network-agent.rules.example
  usr/share/doc/cube-network-agent/10-cube.conflist
  usr/share/doc/cube-network-agent/systemd.md usr/share/doc/cube-network-agent/security.md
)
have=$(cd "$D" && find . -type f | sed 's|^\./||' | sort)
expect=$(printf '%s\n' "${want[@]}" | sort)
if [ "$have" = "$expect" ]; then ok "exactly the expected ${#want[@]} files"; else
  nok "installed files differ: $(diff <(echo "$expect") <(echo "$have") | grep '^[<>]' | tr '\n' ' ')"; fi
for b in usr/libexec/cube-network-agent usr/bin/cubenetctl opt/cni/bin/cube-cni; do
  if [ -f "$D/$b" ] && ! readelf -S "$D/$b" 2>/dev/null | grep -qE '\.symtab|\.debug_info'; then
    ok "$b is stripped ($(stat -c %s "$D/$b") bytes)"
  else nok "$b is not stripped"; fi
done
grep -q "^ExecStart=/usr/libexec/cube-network-agent" "$D/usr/lib/systemd/system/cube-network-agent.service" &&
  ok "the unit starts the installed daemon" || nok "ExecStart= of the installed unit"
for m in "$D"/usr/share/man/man*/*; do
  warn=$(MANWIDTH=80 LC_ALL=C.UTF-8 man --warnings -l "$m" 2>&1 >/dev/null)
  lines=$(MANWIDTH=80 man -l "$m" 2>/dev/null | wc -l)
  if [ -z "$warn" ] && [ "$lines" -gt 20 ]; then ok "man -l ${m##*/} renders ($lines lines, no warnings)"
  else nok "man -l ${m##*/}: ${warn:-only $lines lines}"; fi
done
comp=$(bash -c "source '$D/usr/share/bash-completion/completions/cubenetctl' && complete -p cubenetctl" 2>&1)
[[ "$comp" == "complete "*" cubenetctl" ]] && ok "bash completion loads: $comp" || nok "bash completion: $comp"
if command -v zsh >/dev/null; then
  zsh -n "$D/usr/share/zsh/vendor-completions/_cubenetctl" && ok "zsh completion parses" || nok "zsh -n _cubenetctl"
else
  nok "zsh is not installed (scripts/deps.sh installs it)"
fi
"$D/usr/bin/cubenetctl" --version | grep -q '^cubenetctl ' && ok "installed cubenetctl runs" || nok "installed cubenetctl --version"
"$D/opt/cni/bin/cube-cni" --version | grep -q '^CNI cube-cni plugin v' && ok "installed cube-cni runs" || nok "installed cube-cni --version"

if out=$(make -s uninstall DESTDIR="$D" 2>&1); then ok "make uninstall DESTDIR=..."; else nok "make uninstall: $out"; fi
left=$(cd "$D" && find . -type f | sed 's|^\./||')
[ -z "$left" ] && ok "uninstall removed every file it installed" || nok "left after uninstall: $left"
echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
