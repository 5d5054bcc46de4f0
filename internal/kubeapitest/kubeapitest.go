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
//
// StartWith runs the same pair inside a network namespace of the test's
// own, advertised on an address there (the kubernetes Service's endpoint),
// optionally with kube-controller-manager and kube-scheduler beside it
// (kubetest/build-cluster builds those): the control plane of the one-node
// cluster test.
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
	"encoding/base64"
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

	"github.com/breakerd/breakerd/internal/kerneltest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"
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

	dir  string
	opts Options
	// The command lines of etcd and kube-apiserver, for Restart.
	etcdArgs, apiArgs []string
	pki               *pkiFiles
	procs             []*proc
	logs              *bytes.Buffer
	mu                sync.Mutex
}

// Options say where and with what StartWith runs the API server.
type Options struct {
	// Do runs f on a thread inside the network namespace the processes
	// start in and the Server's clients dial from (kerneltest.Host.Do);
	// nil: this process's own. In a namespace of the test's own,
	// kube-apiserver binds every address there, not only loopback.
	Do func(f func() error) error
	// AdvertiseAddress is published as the endpoint of the kubernetes
	// Service (the lease reconciler), so pods reach the API through its
	// cluster IP (10.96.0.1, in the serving certificate). Needs Do: empty
	// keeps the loopback-only server with no such endpoint.
	AdvertiseAddress string
	// Controllers runs kube-controller-manager (every default controller:
	// DaemonSets, service accounts, the kube-root-ca.crt ConfigMap,
	// EndpointSlices, garbage collection) and kube-scheduler against it,
	// from ClusterBinaries, and turns the ServiceAccount admission plugin
	// on (it needs the accounts the controller manager makes).
	Controllers bool
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
	if err := s.do(cmd.Start); err != nil {
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	s.procs = append(s.procs, p)
	return p, nil
}

// do runs f in the Server's network namespace.
func (s *Server) do(f func() error) error {
	if s.opts.Do == nil {
		return f()
	}
	return s.opts.Do(f)
}

// dial opens a connection from the Server's network namespace (a socket
// stays in the namespace it was made in).
func (s *Server) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := s.do(func() error {
		var err error
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Kubeconfig writes a kubeconfig file with the admin's credentials (for
// kubectl, the kubelet, kube-proxy) and returns its path; the file goes
// when the Server does.
func (s *Server) Kubeconfig(tb testing.TB) string {
	tb.Helper()
	path := filepath.Join(s.dir, "admin.kubeconfig")
	if err := os.WriteFile(path, s.kubeconfig(), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

func (s *Server) kubeconfig() []byte {
	b64 := base64.StdEncoding.EncodeToString
	return fmt.Appendf(nil, `apiVersion: v1
kind: Config
clusters: [{name: t, cluster: {server: %q, certificate-authority-data: %s}}]
users: [{name: u, user: {client-certificate-data: %s, client-key-data: %s}}]
contexts: [{name: c, context: {cluster: t, user: u}}]
current-context: c
`, s.URL, b64(s.CAData), b64(s.Admin.CertData), b64(s.Admin.KeyData))
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
	return &rest.Config{Host: s.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAData: s.CAData}, QPS: 50, Burst: 100,
		Dial: s.dialer()}
}

// dialer is nil (client-go's own) unless the Server runs in a namespace.
func (s *Server) dialer() func(ctx context.Context, network, addr string) (net.Conn, error) {
	if s.opts.Do == nil {
		return nil
	}
	return s.dial
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

// binaries is a directory of built binaries, found or built once.
type binaries struct {
	once sync.Once
	dir  string
	err  error
}

// get returns the directory named by env, or the one script (a
// kubetest/ build script, cached) prints, and checks it holds names.
func (b *binaries) get(env, script string, names ...string) (string, error) {
	b.once.Do(func() {
		if b.dir = os.Getenv(env); b.dir == "" {
			root, err := repoRoot()
			if err != nil {
				b.err = err
				return
			}
			cmd := exec.Command(filepath.Join(root, "kubetest", script))
			cmd.Stderr = os.Stderr // a build takes minutes: its progress shows
			out, err := cmd.Output()
			if err != nil {
				b.err = fmt.Errorf("kubetest/%s: %w", script, err)
				return
			}
			b.dir = strings.TrimSpace(string(out))
		}
		for _, n := range names {
			if _, err := os.Stat(filepath.Join(b.dir, n)); err != nil {
				b.err = fmt.Errorf("no %s in %s: %w", n, b.dir, err)
			}
		}
	})
	return b.dir, b.err
}

var apiBinaries, clusterBinaries binaries

// Binaries returns the directory holding etcd and kube-apiserver: from
// BREAKERD_KUBE_BIN, or built (cached) by kubetest/build.
func Binaries() (string, error) {
	return apiBinaries.get("BREAKERD_KUBE_BIN", "build", "etcd", "kube-apiserver")
}

// ClusterBinaries returns the directory holding kube-controller-manager,
// kube-scheduler, kube-proxy and kubectl: from BREAKERD_KUBE_CLUSTER_BIN,
// or built (cached) by kubetest/build-cluster. Only the one-node cluster
// test needs them, so only it calls this (a build takes minutes).
func ClusterBinaries() (string, error) {
	return clusterBinaries.get("BREAKERD_KUBE_CLUSTER_BIN", "build-cluster",
		"kube-controller-manager", "kube-scheduler", "kube-proxy", "kubectl")
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
	return StartWith(tb, Options{})
}

// StartWith is Start with options: in a network namespace, advertised
// there, with the controller manager and the scheduler.
func StartWith(tb testing.TB, opts Options) *Server {
	tb.Helper()
	if opts.AdvertiseAddress != "" && opts.Do == nil {
		tb.Fatal("kubeapitest: an advertise address needs a network namespace of the test's own (Options.Do)")
	}
	if os.Getenv("BREAKERD_VMTEST") != "" {
		// The API server's side does not depend on the kernel, and the
		// VM has neither its binaries nor a network to them: these tests
		// run on the host (in CI too), not in vmtest's emulated VM (the
		// same rule as the browser tests; kerneltest.Emulated).
		tb.Skip("Kubernetes API tests run on the host, not in the VM")
	}
	if kerneltest.Fast() {
		tb.Skip("Kubernetes API test skipped: BREAKERD_FAST is set (scripts/test-fast)")
	}
	bin, err := Binaries()
	if err != nil {
		unavailable(tb, "%v", err)
	}
	dir, err := os.MkdirTemp("", "breakerd-kubeapi-")
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{dir: dir, opts: opts, logs: &bytes.Buffer{}}
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
	if opts.Controllers {
		if err := s.startControllers(); err != nil {
			tb.Logf("control plane output:\n%s", tail(s.Logs(), 8000))
			tb.Fatal(err)
		}
	}
	return s
}

// startControllers runs kube-controller-manager and kube-scheduler with
// the admin's credentials, and waits for the first service account (made
// by the controller manager) and for the scheduler's health.
func (s *Server) startControllers() error {
	bin, err := ClusterBinaries()
	if err != nil {
		return err
	}
	kc := filepath.Join(s.dir, "controllers.kubeconfig")
	if err := os.WriteFile(kc, s.kubeconfig(), 0o600); err != nil {
		return err
	}
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	common := []string{"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc,
		"--leader-elect=false", "--bind-address=127.0.0.1", "--v=0"}
	kcm, err := s.run("kube-controller-manager", exec.Command(filepath.Join(bin, "kube-controller-manager"), append(common,
		"--secure-port="+strconv.Itoa(ports[0]), "--cert-dir="+filepath.Join(s.dir, "kcm-certs"),
		// kube-root-ca.crt in every namespace: the CA pods' projected
		// service account volumes trust the API server with.
		"--root-ca-file="+s.pki.caCert,
		"--service-account-private-key-file="+s.pki.saKey,
		"--use-service-account-credentials=false",
		// Its default, /usr/libexec/kubernetes/..., it would make.
		"--flex-volume-plugin-dir="+filepath.Join(s.dir, "flexvolume"))...))
	if err != nil {
		return err
	}
	sched, err := s.run("kube-scheduler", exec.Command(filepath.Join(bin, "kube-scheduler"), append(common,
		"--secure-port="+strconv.Itoa(ports[1]), "--cert-dir="+filepath.Join(s.dir, "scheduler-certs"))...))
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(s.Admin)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for {
		for _, p := range []*proc{kcm, sched} {
			select {
			case <-p.done:
				return fmt.Errorf("%s exited: %s", p.name, p.cmd.ProcessState)
			default:
			}
		}
		// The service account controller's first account, and the root
		// CA published: pods can be admitted and mount their tokens.
		_, errSA := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		_, errCA := cs.CoreV1().ConfigMaps("default").Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		if errSA == nil && errCA == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kube-controller-manager: no default service account and kube-root-ca.crt within 60 s (%v; %v)", errSA, errCA)
		case <-time.After(200 * time.Millisecond):
		}
	}
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
	var sans []net.IP
	if s.opts.AdvertiseAddress != "" {
		adv := net.ParseIP(s.opts.AdvertiseAddress)
		if adv == nil {
			return fmt.Errorf("advertise address %q is not an IP address", s.opts.AdvertiseAddress)
		}
		// The kubernetes Service's cluster IP (the first of the range
		// below), which in-cluster clients dial, and the endpoint.
		sans = append(sans, net.IPv4(10, 96, 0, 1), adv)
	}
	pki, err := writePKI(s.dir, sans)
	if err != nil {
		return err
	}
	data := filepath.Join(s.dir, "etcd-"+strconv.Itoa(etcdPort))
	etcdURL := "http://127.0.0.1:" + strconv.Itoa(etcdPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	s.etcdArgs = []string{filepath.Join(bin, "etcd"),
		"--name=kubeapitest", "--data-dir=" + data,
		"--listen-client-urls=" + etcdURL, "--advertise-client-urls=" + etcdURL,
		"--listen-peer-urls=" + peerURL, "--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubeapitest=" + peerURL,
		"--log-level=warn", "--quota-backend-bytes=1073741824"}
	etcd, err := s.run("etcd", exec.Command(s.etcdArgs[0], s.etcdArgs[1:]...))
	if err != nil {
		return err
	}
	s.URL = "https://127.0.0.1:" + strconv.Itoa(apiPort)
	// Loopback only, with no kubernetes Service endpoint (a loopback
	// advertise address cannot be published; nothing needs it) and no
	// service account admission (no controller manager makes the
	// accounts); or, in a namespace of the test's own, every address
	// there, the advertised one published by the lease reconciler.
	bind, advertise, reconciler := "127.0.0.1", "127.0.0.1", "none"
	if s.opts.AdvertiseAddress != "" {
		bind, advertise, reconciler = "0.0.0.0", s.opts.AdvertiseAddress, "lease"
	}
	var admission []string
	if !s.opts.Controllers {
		admission = []string{"--disable-admission-plugins=ServiceAccount"}
	}
	s.apiArgs = append([]string{filepath.Join(bin, "kube-apiserver"),
		"--etcd-servers=" + etcdURL,
		"--bind-address=" + bind, "--advertise-address=" + advertise, "--secure-port=" + strconv.Itoa(apiPort),
		"--cert-dir=" + filepath.Join(s.dir, "certs"),
		"--tls-cert-file=" + pki.serverCert, "--tls-private-key-file=" + pki.serverKey,
		"--client-ca-file=" + pki.caCert,
		"--service-account-key-file=" + pki.saKey, "--service-account-signing-key-file=" + pki.saKey,
		"--service-account-issuer=https://kubernetes.default.svc",
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
		"--endpoint-reconciler-type=" + reconciler,
		"--enable-priority-and-fairness=false",
		"--v=0"}, admission...)
	apisrv, err := s.run("kube-apiserver", exec.Command(s.apiArgs[0], s.apiArgs[1:]...))
	if err != nil {
		return err
	}
	s.CAData = pki.caPEM
	s.pki = pki
	s.Admin = &rest.Config{Host: s.URL, QPS: 100, Burst: 200, TLSClientConfig: rest.TLSClientConfig{
		CAData: pki.caPEM, CertData: pki.adminCertPEM, KeyData: pki.adminKeyPEM}, Dial: s.dialer()}
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
		RootCAs: pool, Certificates: []tls.Certificate{cert}}, DialContext: s.dialer()}}
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

// PID returns the process ID of the process the Server started under
// name ("etcd", "kube-apiserver", …), or 0 when there is none: a test
// reads the process's CPU time and memory from /proc/PID.
func (s *Server) PID(name string) int {
	for _, p := range s.procs {
		if p.name == name {
			return p.cmd.Process.Pid
		}
	}
	return 0
}

// Stop ends the API server and etcd now (a test of what breakerd does
// when the API goes away); cleanup still removes the directories.
func (s *Server) Stop() { s.kill() }

// Restart starts etcd and kube-apiserver again after Stop, on the same
// addresses, data and certificates (what was stored before Stop is
// there again, and clients configured before it reach the new server),
// and waits until the API server is ready.
func (s *Server) Restart(tb testing.TB) {
	tb.Helper()
	if len(s.procs) > 0 || s.opts.Controllers {
		tb.Fatal("kubeapitest: Restart is for a Server stopped by Stop, without Controllers")
	}
	etcd, err := s.run("etcd", exec.Command(s.etcdArgs[0], s.etcdArgs[1:]...))
	if err == nil {
		var apisrv *proc
		if apisrv, err = s.run("kube-apiserver", exec.Command(s.apiArgs[0], s.apiArgs[1:]...)); err == nil {
			err = s.waitReady(60*time.Second, etcd, apisrv)
		}
	}
	if err != nil {
		tb.Fatalf("restarting the API server: %v\n%s", err, tail(s.Logs(), 8000))
	}
}

type pkiFiles struct {
	caCert, serverCert, serverKey, saKey string
	caPEM, adminCertPEM, adminKeyPEM     []byte
}

// writePKI makes a CA, a serving certificate for 127.0.0.1 (and sans), an
// admin client certificate (system:masters) and a service-account signing
// key.
func writePKI(dir string, sans []net.IP) (*pkiFiles, error) {
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
	srvCert, srvKey, err := leaf(2, "kube-apiserver", nil, x509.ExtKeyUsageServerAuth, append([]net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}, sans...))
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

// InstallCRD creates the CustomResourceDefinition in the repository's
// file deploy/NAME and waits (up to 30 s) until it is established and
// its resource is served.
func (s *Server) InstallCRD(tb testing.TB, name string) {
	tb.Helper()
	data := deployFile(tb, name)
	var crd map[string]any
	if err := yaml.UnmarshalStrict(data, &crd); err != nil {
		tb.Fatalf("decoding %s: %v", name, err)
	}
	dyn, err := dynamic.NewForConfig(s.Admin)
	if err != nil {
		tb.Fatal(err)
	}
	ctx := context.Background()
	crdGVR := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	u, err := dyn.Resource(crdGVR).Create(ctx, &unstructured.Unstructured{Object: crd}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("creating the CRD of %s: %v", name, err)
	}
	group, _, _ := unstructured.NestedString(u.Object, "spec", "group")
	plural, _, _ := unstructured.NestedString(u.Object, "spec", "names", "plural")
	versions, _, _ := unstructured.NestedSlice(u.Object, "spec", "versions")
	if len(versions) == 0 {
		tb.Fatalf("the CRD of %s has no version", name)
	}
	version, _ := versions[0].(map[string]any)["name"].(string)
	gvr := schema.GroupVersionResource{Group: group, Version: version, Resource: plural}
	if !kerneltest.WaitFor(30*time.Second, func() bool {
		u, err := dyn.Resource(crdGVR).Get(ctx, u.GetName(), metav1.GetOptions{})
		if err != nil {
			return false
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, c := range conds {
			m, _ := c.(map[string]any)
			if m["type"] == "Established" && m["status"] == "True" {
				_, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{})
				return err == nil
			}
		}
		return false
	}) {
		tb.Fatalf("the CRD of %s is not established within 30 s", name)
	}
}

// deployFile reads the repository's file deploy/NAME.
func deployFile(tb testing.TB, name string) []byte {
	tb.Helper()
	root, err := repoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(root, "deploy", name))
	if err != nil {
		tb.Fatal(err)
	}
	return data
}
