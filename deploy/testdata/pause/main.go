// Command pause is the pod sandbox of the one-node cluster test
// (deploy/cluster_test.go): it reaps children and waits for SIGTERM, as
// Kubernetes' pause image does; no registry is reachable to pull that one.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for {
			var ws syscall.WaitStatus
			syscall.Wait4(-1, &ws, 0, nil)
		}
	}()
	<-c
}
