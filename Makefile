# cube-network-agent: build, install and check the systemd/D-Bus integration.
#
#   make install                      build (cargo build --release --bins) and install into /
#   make install NO_BUILD=1 DESTDIR=/some/root   install already-built binaries under a root
#   make uninstall                    remove exactly what install put there
#                                     (the same DESTDIR and directory variables)
#
# Installed: the daemon, cubenetctl and cube-cni (stripped), the man pages
# cubenetctl(1), cube-network-agent(8) and cube-cni(8), bash and zsh
# completions for cubenetctl, the systemd units, the D-Bus policy and
# activation file, the polkit actions, and docs with the example polkit
# rule and CNI configuration. The state and runtime directories come from
# the unit (StateDirectory=, RuntimeDirectory=); nothing else is created.
#   make check-units                  systemd-analyze verify + security exposure score
#   make test-systemd                 tests/systemd/run.sh (throw-away systemd container)
#
# The daemon goes to $(LIBEXECDIR) (it is started by systemd, D-Bus or the
# varlink socket, not by hand); the CLI to $(BINDIR). Units, the bus policy,
# the activation file and polkit files go to the fixed directories systemd,
# dbus-daemon and polkitd read, whatever PREFIX is. The CNI plugin goes to
# $(CNIBINDIR), where runtimes look for plugins; its example conflist goes
# to $(DOCDIR) (installing it into /etc/cni/net.d is the operator's choice:
# runtimes use the first file there).

PREFIX        ?= /usr
BINDIR        ?= $(PREFIX)/bin
LIBEXECDIR    ?= $(PREFIX)/libexec
UNITDIR       ?= /usr/lib/systemd/system
DBUSPOLICYDIR ?= /usr/share/dbus-1/system.d
DBUSSERVICEDIR ?= /usr/share/dbus-1/system-services
POLKITACTIONDIR ?= /usr/share/polkit-1/actions
DOCDIR        ?= /usr/share/doc/cube-network-agent
MANDIR        ?= $(PREFIX)/share/man
BASHCOMPDIR   ?= $(PREFIX)/share/bash-completion/completions
ZSHCOMPDIR    ?= $(PREFIX)/share/zsh/vendor-completions
CNIBINDIR     ?= /opt/cni/bin
STRIP         ?= strip
CARGO         ?= cargo
TARGETDIR     ?= target/release
NO_BUILD      ?=
DESTDIR       ?=

# The path written into the units (ExecStart=); the repository's unit says
# /usr/libexec/cube-network-agent and is rewritten when LIBEXECDIR differs.
DAEMON        := $(LIBEXECDIR)/cube-network-agent

UNITS         := systemd/cube-network-agent.service systemd/cube-network-agent.socket
POLKIT_POLICIES = $(wildcard polkit/*.policy)
POLKIT_EXAMPLES = $(wildcard polkit/*.rules.example)
MAN1          := $(wildcard man/*.1)
MAN8          := $(wildcard man/*.8)
DOCS          := docs/systemd.md docs/security.md

# $(call install_bus_file,SRC,DEST): install SRC as DEST (0644) so that it
# appears whole and readable at once. The bus watches these directories and
# reloads on every file closed or renamed there; install(1) creates the file
# 0600 and chmods it only after closing it, so a bus (running as messagebus)
# reloading right then cannot read it: dbus-broker-launch then rejects the
# whole configuration, or skips the activation file, until the next change
# (measured: 8 of 20 such reloads). A hidden temporary name, which neither
# bus reads (no .conf / .service suffix), renamed into place, does not race.
install_bus_file = install -D -m 0644 $(1) $(dir $(2)).$(notdir $(2)).tmp && mv -f $(dir $(2)).$(notdir $(2)).tmp $(2)

.PHONY: all build install uninstall check-units test-systemd

all: build

build:
	$(CARGO) build --release --bins

install: $(if $(NO_BUILD),,build)
	@test -x $(TARGETDIR)/cube-network-agent || { echo "$(TARGETDIR)/cube-network-agent is not built (drop NO_BUILD=1 or run cargo build --release --bins)" >&2; exit 1; }
	install -D -m 0755 --strip --strip-program=$(STRIP) $(TARGETDIR)/cube-network-agent $(DESTDIR)$(DAEMON)
	install -D -m 0755 --strip --strip-program=$(STRIP) $(TARGETDIR)/cubenetctl $(DESTDIR)$(BINDIR)/cubenetctl
	install -D -m 0755 --strip --strip-program=$(STRIP) $(TARGETDIR)/cube-cni $(DESTDIR)$(CNIBINDIR)/cube-cni
	for m in $(MAN1); do install -D -m 0644 $$m $(DESTDIR)$(MANDIR)/man1/$${m##*/} || exit 1; done
	for m in $(MAN8); do install -D -m 0644 $$m $(DESTDIR)$(MANDIR)/man8/$${m##*/} || exit 1; done
	if [ -f completions/cubenetctl.bash ]; then install -D -m 0644 completions/cubenetctl.bash $(DESTDIR)$(BASHCOMPDIR)/cubenetctl; fi
	if [ -f completions/_cubenetctl ]; then install -D -m 0644 completions/_cubenetctl $(DESTDIR)$(ZSHCOMPDIR)/_cubenetctl; fi
	install -D -m 0644 examples/cni/10-cube.conflist $(DESTDIR)$(DOCDIR)/10-cube.conflist
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	for u in $(UNITS); do \
	    sed 's|/usr/libexec/cube-network-agent|$(DAEMON)|g' $$u > $(DESTDIR)$(UNITDIR)/$${u##*/} && \
	    chmod 0644 $(DESTDIR)$(UNITDIR)/$${u##*/} || exit 1; \
	done
	$(call install_bus_file,dbus/org.cube.NetworkAgent.conf,$(DESTDIR)$(DBUSPOLICYDIR)/org.cube.NetworkAgent.conf)
	$(call install_bus_file,dbus/org.cube.NetworkAgent.service,$(DESTDIR)$(DBUSSERVICEDIR)/org.cube.NetworkAgent.service)
	for p in $(POLKIT_POLICIES); do install -D -m 0644 $$p $(DESTDIR)$(POLKITACTIONDIR)/$${p##*/} || exit 1; done
	for r in $(POLKIT_EXAMPLES); do install -D -m 0644 $$r $(DESTDIR)$(DOCDIR)/$${r##*/} || exit 1; done
	for d in $(DOCS); do install -D -m 0644 $$d $(DESTDIR)$(DOCDIR)/$${d##*/} || exit 1; done
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
	    echo "systemctl daemon-reload"; systemctl daemon-reload; \
	else \
	    echo "(not reloading systemd: DESTDIR is set or systemd is not PID 1)"; \
	fi

uninstall:
	rm -f $(DESTDIR)$(DAEMON)
	rm -f $(DESTDIR)$(BINDIR)/cubenetctl
	rm -f $(DESTDIR)$(CNIBINDIR)/cube-cni
	rm -f $(addprefix $(DESTDIR)$(MANDIR)/man1/,$(notdir $(MAN1)))
	rm -f $(addprefix $(DESTDIR)$(MANDIR)/man8/,$(notdir $(MAN8)))
	rm -f $(DESTDIR)$(BASHCOMPDIR)/cubenetctl $(DESTDIR)$(ZSHCOMPDIR)/_cubenetctl
	rm -f $(addprefix $(DESTDIR)$(UNITDIR)/,$(notdir $(UNITS)))
	rm -f $(DESTDIR)$(DBUSPOLICYDIR)/org.cube.NetworkAgent.conf
	rm -f $(DESTDIR)$(DBUSSERVICEDIR)/org.cube.NetworkAgent.service
	rm -f $(addprefix $(DESTDIR)$(POLKITACTIONDIR)/,$(notdir $(POLKIT_POLICIES)))
	rm -f $(addprefix $(DESTDIR)$(DOCDIR)/,$(notdir $(POLKIT_EXAMPLES)) $(notdir $(DOCS)) 10-cube.conflist)
	-rmdir $(DESTDIR)$(DOCDIR) 2>/dev/null || true
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
	    echo "systemctl daemon-reload"; systemctl daemon-reload; \
	fi

# systemd-analyze verify needs ExecStart= to exist: verify a copy of the
# units whose ExecStart= points at the installed daemon if there is one,
# else at the built one in $(TARGETDIR).
check-units:
	@set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	if [ -x "$(DAEMON)" ]; then exe="$(DAEMON)"; \
	elif [ -x "$(TARGETDIR)/cube-network-agent" ]; then exe="$(CURDIR)/$(TARGETDIR)/cube-network-agent"; \
	else exe="$(DAEMON)"; echo "note: no daemon built or installed; verify will say ExecStart= is missing" >&2; fi; \
	for u in $(UNITS); do sed "s|/usr/libexec/cube-network-agent|$$exe|g" $$u > $$tmp/$${u##*/}; done; \
	echo "== systemd-analyze verify (ExecStart=$$exe)"; \
	out=$$(systemd-analyze verify $$tmp/cube-network-agent.socket $$tmp/cube-network-agent.service 2>&1) || rc=$$?; \
	if [ -n "$$out" ]; then echo "$$out"; fi; \
	if [ -n "$$out" ] || [ "$${rc:-0}" != 0 ]; then echo "verify: FAILED" >&2; exit 1; fi; \
	echo "verify: clean"; \
	echo "== systemd-analyze security --offline=yes systemd/cube-network-agent.service"; \
	systemd-analyze security --offline=yes --no-pager systemd/cube-network-agent.service | grep -v '^✓'

test-systemd:
	tests/systemd/run.sh
