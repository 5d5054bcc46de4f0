// Command breakerd is the circuit breaker daemon. Until the daemon lands
// (see the README) it loads and checks the kernel side: breakerd probe
// prints what the running kernel offers.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/breakerd/breakerd/maps"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] != "probe" {
		fmt.Fprintf(os.Stderr, "breakerd: unknown command %q (only \"probe\" exists yet)\n", os.Args[1])
		os.Exit(2)
	}
	out, _ := json.MarshalIndent(maps.ProbeFeatures(), "", "  ")
	fmt.Println(string(out))
}
