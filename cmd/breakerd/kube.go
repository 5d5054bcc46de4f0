//go:build !nokube

package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/breakerd/breakerd/kube"
)

// kubeClient returns the Kubernetes API client: from --kubeconfig, else
// from the pod's service account when running in a cluster, else nil (no
// API: breakerd runs as before; Service targets match nothing).
func kubeClient(kubeconfig, node string, log *slog.Logger) (*kube.Client, error) {
	var cfg *rest.Config
	var err error
	switch {
	case kubeconfig != "":
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
	default:
		cfg, err = rest.InClusterConfig()
		if errors.Is(err, rest.ErrNotInCluster) {
			log.Info("no Kubernetes API (not in a cluster, no --kubeconfig): Service targets match nothing")
			return nil, nil
		}
		if err != nil {
			// In a pod whose service account token is not mounted.
			log.Warn("no Kubernetes API: the in-cluster configuration is incomplete (is the service account token mounted?); Service targets match nothing", "err", err)
			return nil, nil
		}
	}
	if node == "" {
		node = os.Getenv("NODE_NAME")
	}
	if node == "" {
		node, _ = os.Hostname()
	}
	c, err := kube.New(kube.Options{Config: cfg, NodeName: node, Logger: log})
	if err != nil {
		return nil, err
	}
	log.Info("Kubernetes API configured", "host", cfg.Host, "node", node)
	return c, nil
}
