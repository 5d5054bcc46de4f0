// Command helper runs internal/kerneltest's client and pool helpers: what
// a test binary does when it is re-executed as one, without the test
// binary's package initialisation (the daemon's links client-go and takes
// about 0.3 s to start in vmtest's emulated VM). vmtest packs it into the
// VM and names it in kerneltest.HelperBinaryEnv.
package main

import (
	"fmt"
	"os"

	"github.com/breakerd/breakerd/internal/kerneltest"
)

func main() {
	code, ok := kerneltest.RunHelper()
	if !ok {
		fmt.Fprintln(os.Stderr, "helper: no helper spec in the environment (it is started by internal/kerneltest)")
		os.Exit(2)
	}
	os.Exit(code)
}
