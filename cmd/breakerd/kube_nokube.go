//go:build nokube

package main

import (
	"errors"
	"log/slog"
	"os"

	"github.com/breakerd/breakerd/kube"
)

// errNoKube refuses Kubernetes API configuration in a build without the
// Kubernetes client.
var errNoKube = errors.New("--kubeconfig: this breakerd was built with -tags nokube, without the Kubernetes client; build it without that tag (go build ./cmd/breakerd) to reach the Kubernetes API")

// kubeClient returns no client: this build has none (-tags nokube, as
// scripts/demo builds it). An explicit --kubeconfig is refused rather than
// ignored; in a pod, where the default build would use the service
// account, it says so, since Service targets and pod workloads then match
// nothing.
func kubeClient(kubeconfig, node string, log *slog.Logger) (*kube.Client, error) {
	if kubeconfig != "" {
		return nil, errNoKube
	}
	if os.Getenv("KUBERNETES_SERVICE_HOST") != "" {
		log.Warn("in a Kubernetes pod, but this breakerd was built with -tags nokube, without the Kubernetes client: Service targets and pod workloads match nothing")
		return nil, nil
	}
	log.Info("no Kubernetes API (built with -tags nokube): Service targets match nothing")
	return nil, nil
}
