package e2e

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

// TestDemo runs the README's demo command as written, so it cannot rot.
func TestDemo(t *testing.T) {
	kerneltest.RequireKernel(t)
	need(t, "curl", "bpftool", "nft")
	out, err := exec.Command("timeout", "180", "../scripts/demo").CombinedOutput()
	if err != nil {
		t.Fatalf("scripts/demo: %v\n%s", err, out)
	}
	for _, want := range []string{"SYNs that reached the server while open: 0", `"state": 1`, "half_open  closed     probes_succeeded"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the demo's output lacks %q:\n%s", want, out)
		}
	}
}
