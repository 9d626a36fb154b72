// cnirun: a minimal real CNI runtime client for the cube-cni tests, over
// Debian's libcni 1.1.2 (golang-github-appc-cni-dev) and containerd's
// go-cni 1.1.7 (golang-github-containerd-go-cni-dev). Built offline in
// GOPATH mode by tests/cni/build-cnirun.sh.
//
//	cnirun add|check|del NETNAME NETNS_PATH
//	cnirun podip NETNAME NETNS_PATH   (an ADD through go-cni, as containerd's CRI does it)
//	cnirun validate NETNAME           (libcni ValidateNetworkList: VERSION of every plugin)
//	cnirun version PLUGIN_TYPE        (libcni GetVersionInfo)
//
// Environment:
//
//	NETCONFPATH      directory holding NETNAME's *.conflist (default /etc/cni/net.d)
//	CNI_PATH         plugin search path, ':'-separated (required)
//	CNI_CACHE_DIR    libcni cache directory (default libcni's /var/lib/cni)
//	CNI_CONTAINERID  container id (required for add/check/del/podip)
//	CNI_IFNAME       interface name (default eth0; podip needs it to end in "0")
//	CNI_ARGS         optional K=V;K=V plugin args (RuntimeConf.Args)
//	CAP_ARGS         optional JSON object of capability args, e.g.
//	                 {"portMappings":[{"hostPort":8080,"containerPort":80,"protocol":"tcp"}]}
//	CNIRUN_TIMEOUT   seconds for the whole operation (default 60)
//
// Output: add prints the result JSON (as libcni decoded the chain's last
// result) on stdout; podip prints the pod IP CRI would pick on the first
// line, then "additional=IP,IP" and one "iface NAME mac=.. sandbox=.. ips=.."
// line per interface of go-cni's Result. check/del print nothing.
//
// Like libcni (and unlike a runtime), add does not DEL after a failed ADD:
// the caller does, as the spec requires of runtimes.
//
// Exit status: 0 success; 1 the CNI operation failed (stderr carries
// "cnirun: VERB failed: code=N msg=... [details=...] (libcni context)" when the chain
// returned a CNI error object, otherwise the plain error); 2 usage or
// setup error (bad arguments, config not found, bad CAP_ARGS).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	gocni "github.com/containerd/go-cni"
	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
)

func usage(msg string) {
	fmt.Fprintf(os.Stderr, "cnirun: %s\nusage: cnirun add|check|del|podip NETNAME NETNS_PATH | cnirun validate NETNAME | cnirun version PLUGIN_TYPE\n", msg)
	os.Exit(2)
}

func setupErr(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "cnirun: "+format+"\n", a...)
	os.Exit(2)
}

// fail reports a failed CNI operation; a CNI error object keeps its code.
func fail(verb string, err error) {
	var cerr *types.Error
	if errors.As(err, &cerr) {
		line := fmt.Sprintf("cnirun: %s failed: code=%d msg=%s", verb, cerr.Code, cerr.Msg)
		if cerr.Details != "" {
			line += " details=" + cerr.Details
		}
		if err != error(cerr) {
			line += fmt.Sprintf(" (%v)", err) // libcni's context: which plugin
		}
		fmt.Fprintln(os.Stderr, line)
	} else {
		fmt.Fprintf(os.Stderr, "cnirun: %s failed: %v\n", verb, err)
	}
	os.Exit(1)
}

func getenv(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func cniArgs() [][2]string {
	var out [][2]string
	for _, kv := range strings.Split(os.Getenv("CNI_ARGS"), ";") {
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			setupErr("CNI_ARGS: %q is not K=V", kv)
		}
		out = append(out, [2]string{k, v})
	}
	return out
}

func capArgs() map[string]interface{} {
	s := os.Getenv("CAP_ARGS")
	if s == "" {
		return nil
	}
	m := map[string]interface{}{}
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		setupErr("CAP_ARGS is not a JSON object: %v", err)
	}
	return m
}

// selectPodIPs is containerd v1.6's pod IP choice, copied from
// containerd release/1.6 pkg/cri/server/sandbox_run.go, func selectPodIPs
// (1.6.20 is what Debian 12 ships): the first IPv4 of the default
// interface's IPConfigs wins, everything else is "additional".
func selectPodIPs(ipConfigs []*gocni.IPConfig) (string, []string) {
	var (
		additionalIPs []string
		ip            string
	)
	for _, c := range ipConfigs {
		if c.IP.To4() != nil && ip == "" {
			ip = c.IP.String()
		} else {
			additionalIPs = append(additionalIPs, c.IP.String())
		}
	}
	if ip != "" {
		return ip, additionalIPs
	}
	if len(ipConfigs) == 1 {
		return additionalIPs[0], nil
	}
	return additionalIPs[0], additionalIPs[1:]
}

// podIP runs an ADD the way containerd's CRI (1.6) does it: go-cni
// Setup, then Result.Interfaces[defaultIfName].IPConfigs through
// selectPodIPs. go-cni attributes every result IP without an "interface"
// index to the default interface prefix+"0" (go-cni 1.1.7 result.go:75 and
// :108-113, getInterfaceName), in the order of result.ips.
func podIP(ctx context.Context, confDir, netName, netns, ifName string, paths []string, cacheDir string) {
	if !strings.HasSuffix(ifName, "0") || len(ifName) < 2 {
		setupErr("podip: CNI_IFNAME %q must end in 0 (go-cni names interfaces PREFIX0, PREFIX1, ...)", ifName)
	}
	if cacheDir != "" {
		// go-cni builds its CNIConfig without a cache dir: the global
		// default is what it uses. Same cache file name as "cnirun add"
		// (NETNAME-CONTAINERID-IFNAME), so "cnirun del" undoes a podip.
		libcni.CacheDir = cacheDir
	}
	confList, err := libcni.LoadConfList(confDir, netName)
	if err != nil {
		setupErr("podip: loading %q from %s: %v", netName, confDir, err)
	}
	g, err := gocni.New(gocni.WithPluginDir(paths), gocni.WithInterfacePrefix(ifName[:len(ifName)-1]))
	if err != nil {
		setupErr("podip: go-cni: %v", err)
	}
	if err := g.Load(gocni.WithConfListBytes(confList.Bytes)); err != nil {
		setupErr("podip: go-cni load: %v", err)
	}
	var opts []gocni.NamespaceOpts
	for k, v := range capArgs() {
		if k == "portMappings" {
			// As CRI does: through go-cni's PortMapping struct, which has no
			// json tags, so the plugin sees {"HostPort":..,"ContainerPort":..,
			// "Protocol":..,"HostIP":..} in runtimeConfig.portMappings.
			raw, _ := json.Marshal(v)
			var pm []gocni.PortMapping
			if err := json.Unmarshal(raw, &pm); err != nil {
				setupErr("CAP_ARGS portMappings: %v", err)
			}
			opts = append(opts, gocni.WithCapabilityPortMap(pm))
			continue
		}
		opts = append(opts, gocni.WithCapability(k, v))
	}
	for _, kv := range cniArgs() {
		opts = append(opts, gocni.WithArgs(kv[0], kv[1]))
	}
	res, err := g.Setup(ctx, os.Getenv("CNI_CONTAINERID"), netns, opts...)
	if err != nil {
		fail("podip", err)
	}
	cfg, ok := res.Interfaces[ifName]
	if !ok || len(cfg.IPConfigs) == 0 {
		fail("podip", fmt.Errorf("no IP attributed to %s (CRI: failed to find network info for sandbox)", ifName))
	}
	ip, extra := selectPodIPs(cfg.IPConfigs)
	fmt.Println(ip)
	fmt.Printf("additional=%s\n", strings.Join(extra, ","))
	names := make([]string, 0, len(res.Interfaces))
	for n := range res.Interfaces {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := res.Interfaces[n]
		var ips []string
		for _, ipc := range c.IPConfigs {
			ips = append(ips, ipc.IP.String())
		}
		fmt.Printf("iface %s mac=%s sandbox=%s ips=%s\n", n, c.Mac, c.Sandbox, strings.Join(ips, ","))
	}
}

func main() {
	if len(os.Args) < 3 {
		usage("missing arguments")
	}
	verb := os.Args[1]
	timeout := 60
	if s := os.Getenv("CNIRUN_TIMEOUT"); s != "" {
		t, err := strconv.Atoi(s)
		if err != nil || t <= 0 {
			setupErr("CNIRUN_TIMEOUT %q is not a positive integer", s)
		}
		timeout = t
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeout)*time.Second)
	defer cancel()

	confDir := getenv("NETCONFPATH", "/etc/cni/net.d")
	cniPath := os.Getenv("CNI_PATH")
	if cniPath == "" {
		setupErr("CNI_PATH is not set")
	}
	paths := filepath.SplitList(cniPath)
	cacheDir := os.Getenv("CNI_CACHE_DIR")
	cni := libcni.NewCNIConfigWithCacheDir(paths, cacheDir, nil)

	switch verb {
	case "version":
		if len(os.Args) != 3 {
			usage("version takes PLUGIN_TYPE")
		}
		vi, err := cni.GetVersionInfo(ctx, os.Args[2])
		if err != nil {
			fail(verb, err)
		}
		fmt.Println(strings.Join(vi.SupportedVersions(), " "))
		return
	case "validate":
		if len(os.Args) != 3 {
			usage("validate takes NETNAME")
		}
		list, err := libcni.LoadConfList(confDir, os.Args[2])
		if err != nil {
			setupErr("loading %q from %s: %v", os.Args[2], confDir, err)
		}
		caps, err := cni.ValidateNetworkList(ctx, list)
		if err != nil {
			fail(verb, err)
		}
		sort.Strings(caps)
		fmt.Printf("cniVersion=%s capabilities=%s\n", list.CNIVersion, strings.Join(caps, ","))
		return
	case "add", "check", "del", "podip":
	default:
		usage("unknown verb " + strconv.Quote(verb))
	}
	if len(os.Args) != 4 {
		usage(verb + " takes NETNAME NETNS_PATH")
	}
	netName, netns := os.Args[2], os.Args[3]
	if os.Getenv("CNI_CONTAINERID") == "" {
		setupErr("CNI_CONTAINERID is not set")
	}
	ifName := getenv("CNI_IFNAME", "eth0")
	if verb == "podip" {
		podIP(ctx, confDir, netName, netns, ifName, paths, cacheDir)
		return
	}

	list, err := libcni.LoadConfList(confDir, netName)
	if err != nil {
		setupErr("loading %q from %s: %v", netName, confDir, err)
	}
	rt := &libcni.RuntimeConf{
		ContainerID:    os.Getenv("CNI_CONTAINERID"),
		NetNS:          netns,
		IfName:         ifName,
		Args:           cniArgs(),
		CapabilityArgs: capArgs(),
	}
	switch verb {
	case "add":
		res, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			fail(verb, err)
		}
		if err := res.PrintTo(os.Stdout); err != nil {
			setupErr("printing result: %v", err)
		}
		fmt.Println()
	case "check":
		if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
			fail(verb, err)
		}
	case "del":
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			fail(verb, err)
		}
	}
}
