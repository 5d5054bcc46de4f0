package maps

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Capabilities breakerd needs, with why. CAP_SYS_ADMIN also grants what
// CAP_BPF and CAP_PERFMON grant (the kernel accepts either).
var neededCaps = []struct {
	bit  uint
	name string
	why  string
}{
	{39, "CAP_BPF", "for loading programs and creating maps"},
	{38, "CAP_PERFMON", "for the verifier's pointer access and bpf_skc_to_tcp_sock in the observation program"},
	{12, "CAP_NET_ADMIN", "for attaching to cgroup socket hooks"},
}

const capSysAdmin = 21

// CheckCapabilities reports which capabilities the process lacks, naming
// each and why it is needed, so a misconfigured deployment fails with a
// clear message instead of a verifier error.
func CheckCapabilities() error {
	eff, err := effectiveCaps()
	if err != nil {
		return err
	}
	has := func(bit uint) bool { return eff&(1<<bit) != 0 }
	var missing []string
	for _, c := range neededCaps {
		if has(c.bit) || (c.bit != 12 && has(capSysAdmin)) {
			continue
		}
		missing = append(missing, fmt.Sprintf("%s (%s)", c.name, c.why))
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing capabilities: %s", strings.Join(missing, ", "))
	}
	return nil
}

func effectiveCaps() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, fmt.Errorf("reading capabilities: %w", err)
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return 0, fmt.Errorf("parsing CapEff: %w", err)
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("no CapEff in /proc/self/status")
}
