// Package kubeapitest starts a real etcd and kube-apiserver on loopback for
// a test: unique ports and data directories, self-signed certificates made
// in the test, a service-account signing key, RBAC authorization. The
// binaries are built from the pinned modules of kubetest/ (its own Go
// module, so the product's go.mod stays clean) by kubetest/build, which
// caches them; BREAKERD_KUBE_BIN names a directory that already holds them.
//
// Without the binaries (or when they cannot start) a test skips with the
// reason; with CI set it fails instead, so CI never passes on a skipped
// Kubernetes suite.
package kubeapitest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Server is a running etcd + kube-apiserver pair.
type Server struct {
	// Admin is a client configuration with cluster-admin rights (a client
	// certificate in system:masters).
	Admin *rest.Config
	// URL is the API server's address (https://127.0.0.1:PORT).
	URL string
	// CAData is the PEM certificate of the CA that signed the serving
	// certificate.
	CAData []byte

	dir   string
	procs []*proc
	logs  *bytes.Buffer
	mu    sync.Mutex
}

// proc is a started process and its exit.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
}

func (s *Server) run(name string, cmd *exec.Cmd) (*proc, error) {
	w := lockedWriter{&s.mu, s.logs}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	s.procs = append(s.procs, p)
	return p, nil
}

// Clientset returns a clientset with cluster-admin rights.
func (s *Server) Clientset(tb testing.TB) *kubernetes.Clientset {
	tb.Helper()
	cs, err := kubernetes.NewForConfig(s.Admin)
	if err != nil {
		tb.Fatalf("clientset: %v", err)
	}
	return cs
}

// TokenConfig returns a client configuration that authenticates with a
// bearer token (a service account's, from the TokenRequest API).
func (s *Server) TokenConfig(token string) *rest.Config {
	return &rest.Config{Host: s.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: s.CAData}, QPS: 50, Burst: 100}
}

// Logs returns what etcd and kube-apiserver printed so far.
func (s *Server) Logs() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.logs.String()
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.b.Len() > 4<<20 {
		return len(p), nil // keep the first 4 MiB
	}
	return w.b.Write(p)
}

// unavailable skips, or fails under CI.
func unavailable(tb testing.TB, format string, args ...any) {
	tb.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("CI") != "" {
		tb.Fatalf("kube-apiserver unavailable under CI: %s", msg)
	}
	tb.Skipf("kube-apiserver unavailable: %s", msg)
}

var (
	binOnce sync.Once
	binDir  string
	binErr  error
)

// Binaries returns the directory holding etcd and kube-apiserver: from
// BREAKERD_KUBE_BIN, or built (cached) by kubetest/build.
func Binaries() (string, error) {
	binOnce.Do(func() {
		if d := os.Getenv("BREAKERD_KUBE_BIN"); d != "" {
			binDir = d
		} else {
			root, err := repoRoot()
			if err != nil {
				binErr = err
				return
			}
			out, err := exec.Command(filepath.Join(root, "kubetest", "build")).Output()
			if err != nil {
				binErr = fmt.Errorf("kubetest/build: %w", err)
				return
			}
			binDir = strings.TrimSpace(string(out))
		}
		for _, b := range []string{"etcd", "kube-apiserver"} {
			if _, err := os.Stat(filepath.Join(binDir, b)); err != nil {
				binErr = fmt.Errorf("no %s in %s: %w", b, binDir, err)
			}
		}
	})
	return binDir, binErr
}

func repoRoot() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", fmt.Errorf("cannot find the repository")
	}
	return filepath.Join(filepath.Dir(file), "..", ".."), nil
}

// freePorts returns n distinct loopback ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var out []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}

// Start runs etcd and kube-apiserver for the test and stops both (by
// PID) and removes their directories when it ends. In vmtest's VM it
// skips the test (it runs on the host).
func Start(tb testing.TB) *Server {
	tb.Helper()
	if os.Getenv("BREAKERD_VMTEST") != "" {
		// The API server's side does not depend on the kernel, and the
		// VM has neither its binaries nor a network to them: these tests
		// run on the host (in CI too), not in vmtest's emulated VM (the
		// same rule as the browser tests; kerneltest.Emulated).
		tb.Skip("Kubernetes API tests run on the host, not in the VM")
	}
	bin, err := Binaries()
	if err != nil {
		unavailable(tb, "%v", err)
	}
	dir, err := os.MkdirTemp("", "breakerd-kubeapi-")
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{dir: dir, logs: &bytes.Buffer{}}
	tb.Cleanup(s.stop)
	for range 3 { // a port taken between freePorts and the bind: try again
		if err = s.start(bin); err == nil || !strings.Contains(s.Logs(), "address already in use") {
			break
		}
		s.kill()
	}
	if err != nil {
		tb.Logf("etcd and kube-apiserver output:\n%s", tail(s.Logs(), 8000))
		unavailable(tb, "%v", err)
	}
	return s
}

func tail(s string, n int) string {
	if len(s) > n {
		return "…" + s[len(s)-n:]
	}
	return s
}

func (s *Server) start(bin string) error {
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	etcdPort, peerPort, apiPort := ports[0], ports[1], ports[2]
	pki, err := writePKI(s.dir)
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "etcd-"+strconv.Itoa(etcdPort))
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	etcd, err := s.run("etcd", exec.Command(filepath.Join(bin, "etcd"),
		"--name=kubeapitest", "--data-dir="+data,
		"--listen-client-urls="+etcdURL, "--advertise-client-urls="+etcdURL,
		"--listen-peer-urls="+peerURL, "--initial-advertise-peer-urls="+peerURL,
		"--initial-cluster=kubeapitest="+peerURL,
		"--log-level=warn", "--quota-backend-bytes=1073741824"))
	if err != nil {
		return err
	}
	s.URL = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	apisrv, err := s.run("kube-apiserver", exec.Command(filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers="+etcdURL,
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(apiPort),
		"--cert-dir="+filepath.Join(s.dir, "certs"),
		"--tls-cert-file="+pki.serverCert, "--tls-private-key-file="+pki.serverKey,
		"--client-ca-file="+pki.caCert,
		"--service-account-key-file="+pki.saKey, "--service-account-signing-key-file="+pki.saKey,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
		// A loopback advertise address cannot be published as the
		// kubernetes Service's endpoint; nothing needs that Service.
		"--endpoint-reconciler-type=none",
		// No controller manager runs: pods may not wait for a default
		// service account that nothing would create.
		"--disable-admission-plugins=ServiceAccount",
		"--enable-priority-and-fairness=false",
		"--v=0"))
	if err != nil {
		return err
	}
	s.CAData = pki.caPEM
	s.Admin = &rest.Config{Host: s.URL, QPS: 100, Burst: 200, TLSClientConfig: rest.TLSClientConfig{
		CAData: pki.caPEM, CertData: pki.adminCertPEM, KeyData: pki.adminKeyPEM}}
	return s.waitReady(60*time.Second, etcd, apisrv)
}

// waitReady polls /readyz until it answers 200.
func (s *Server) waitReady(limit time.Duration, procs ...*proc) error {
	cert, err := tls.X509KeyPair(s.Admin.CertData, s.Admin.KeyData)
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.CAData)
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: pool, Certificates: []tls.Certificate{cert}}}}
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	for {
		for _, p := range procs {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited: %s", p.name, p.cmd.ProcessState)
			default:
			}
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/readyz", nil)
		if resp, err := hc.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-apiserver not ready within %v", limit)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// kill stops both processes by PID and waits for them.
func (s *Server) kill() {
	for i := len(s.procs) - 1; i >= 0; i-- {
		p := s.procs[i]
		_ = p.cmd.Process.Kill()
		<-p.done
	}
	s.procs = nil
}

func (s *Server) stop() {
	s.kill()
	os.RemoveAll(s.dir)
}

// Stop ends the API server and etcd now (a test of what breakerd does
// when the API goes away); cleanup still removes the directories.
func (s *Server) Stop() { s.kill() }

type pkiFiles struct {
	caCert, serverCert, serverKey, saKey string
	caPEM, adminCertPEM, adminKeyPEM     []byte
}

// writePKI makes a CA, a serving certificate for 127.0.0.1, an admin
// client certificate (system:masters) and a service-account signing key.
func writePKI(dir string) (*pkiFiles, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubeapitest-ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, cn string, org []string, usage x509.ExtKeyUsage, ips []net.IP) ([]byte, []byte, error) {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, nil, err
		}
		t := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn, Organization: org},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IPAddresses: ips,
			DNSNames: []string{"localhost"}, ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, t, ca, &k.PublicKey, caKey)
		if err != nil {
			return nil, nil, err
		}
		kd, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			return nil, nil, err
		}
		return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kd}), nil
	}
	srvCert, srvKey, err := leaf(2, "kube-apiserver", nil, x509.ExtKeyUsageServerAuth, []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback})
	if err != nil {
		return nil, err
	}
	admCert, admKey, err := leaf(3, "kubeapitest-admin", []string{"system:masters"}, x509.ExtKeyUsageClientAuth, nil)
	if err != nil {
		return nil, err
	}
	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	saDER, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return nil, err
	}
	f := &pkiFiles{caCert: filepath.Join(dir, "ca.crt"), serverCert: filepath.Join(dir, "server.crt"),
		serverKey: filepath.Join(dir, "server.key"), saKey: filepath.Join(dir, "sa.key"),
		caPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), adminCertPEM: admCert, adminKeyPEM: admKey}
	for path, data := range map[string][]byte{f.caCert: f.caPEM, f.serverCert: srvCert, f.serverKey: srvKey,
		f.saKey: pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saDER})} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return nil, err
		}
	}
	return f, nil
}
